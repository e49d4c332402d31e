"""A voice-cloning pipeline as the server and the benchmarks hold it, and CSM's prompt layout.

``VoicePipeline`` pairs a ``CsmForConditionalGeneration`` with its ``CsmProcessor``; its ``codec`` (Mimi) is
the reference-audio encoder whose outputs the store keeps (``encoders.codec``). ``voice_prompt`` lays out one
request: the reference's transcript and audio first, then the text to speak, so the model continues in the
reference's voice. The special tokens of CSM's text may not appear in a caller's text.

``VoicePipeline.interruptible(check)`` runs ``check`` before every decoder layer of the backbone while it is
entered, so a call that ``check`` stops (by raising) ends within one layer, inside a long prefill too; it is
meant for one call at a time on the pipeline (the hooks are the model's while entered).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

from mmcache.errors import InvalidRequest

AUDIO_TOKEN = "<|AUDIO|>"
AUDIO_EOS_TOKEN = "<|audio_eos|>"
SAMPLING_RATE = 24_000  # Mimi's rate


@dataclass
class VoicePipeline:
    model: "torch.nn.Module"  # CsmForConditionalGeneration
    processor: object  # CsmProcessor

    @property
    def codec(self) -> torch.nn.Module:
        return self.model.codec_model

    @property
    def context_length(self) -> int:
        """Positions the backbone was built for: a prompt and its generated frames together fit in them."""
        return int(self.model.config.max_position_embeddings)

    @contextlib.contextmanager
    def interruptible(self, check: Callable[[], None]):
        """While entered, ``check()`` runs before each decoder layer of the backbone (its prefill and every frame):
        a ``check`` that raises stops the call within one layer, not at the end of a prefill whose cost grows
        with the square of the prompt."""
        hooks = [layer.register_forward_pre_hook(lambda module, args: check())
                 for layer in self.model.backbone_model.layers]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()


def voice_prompt(reference_text: str, target_text: str, speaker: int = 0, bos: str = "<|endoftext|>") -> str:
    """CSM's segment layout: the reference's transcript and audio (one ``<|AUDIO|>`` the processor expands to
    the clip's frames), then the text to speak, both as ``speaker``."""
    if not isinstance(reference_text, str) or not isinstance(target_text, str) or not target_text.strip():
        raise InvalidRequest("a voice prompt needs the reference transcript and a non-empty text to speak")
    if isinstance(speaker, bool) or not isinstance(speaker, int) or speaker < 0:
        raise InvalidRequest(f"speaker must be an int >= 0, got {speaker!r}")
    for text in (reference_text, target_text):
        marker = next((m for m in (AUDIO_TOKEN, AUDIO_EOS_TOKEN, bos) if m in text), None)
        if marker is not None:  # it would add an audio slot or start a segment the caller did not ask for
            raise InvalidRequest(f"a voice prompt's text may not contain the special token {marker!r}")
    return (f"{bos}[{speaker}]{reference_text}{bos}{AUDIO_TOKEN}{AUDIO_EOS_TOKEN}"
            f"{bos}[{speaker}]{target_text}{bos}")
