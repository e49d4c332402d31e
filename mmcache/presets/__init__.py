"""The embedded models: real transformers and diffusers architectures with configs in code and weights drawn
from a fixed seed (no model hub is reachable), their locally trained tokenizers, and what a server builds from
the names in its config.

A layer above the engine, the encoders and the hosts (it builds their objects) and below the command lines and
the benchmarks. Modules: ``text`` (text presets, ``engine_from_preset``), ``export`` (a text preset as a Hugging
Face folder), ``vlm`` (VLM presets, ``vlm_from_preset``), ``diffusion`` (tiny SD3 and Wan pipelines), ``tts``
(CSM with a Mimi codec), ``tokenizer`` (the text and speech presets' byte-level BPE), ``local_tokenizers`` (T5- and
CLIP-layout tokenizers trained on the repository's prompt files), ``serving`` (``serve``: a server over the
models a ``ServerConfig`` names).

Invariant of every preset: its name (and seed and dtype) always give the same config, weights and vocabulary, in
every process, and building leaves the caller's torch RNG as it was.

The names below load their module on first use, so a text engine built from ``text`` never imports the
encoders, and nothing imports the server before ``serve`` is used.
"""

import importlib

_HOME = {"PRESETS": "text", "UnknownPreset": "text", "engine_from_preset": "text", "VLM_PRESETS": "vlm",
         "vlm_from_preset": "vlm", "serve": "serving"}
__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
