"""The generation pipelines a server builds from ``--diffusion`` and ``--tts``: an embedded preset or a local folder.

* ``--diffusion``: ``tiny-sd3`` (text-to-image) and ``tiny-wan`` (text-to-video), the tiny seeded pipelines of
  ``encoders.diffusion_presets``, or a local diffusers folder loaded with ``DiffusionPipeline.from_pretrained``
  (never from a hub: a source that is neither a preset nor a folder is refused). A ``StableDiffusion3Pipeline``
  serves ``/v1/images/generations``, a ``WanPipeline`` ``/v1/videos``; any other pipeline class is refused.
* ``--tts``: ``tiny-csm`` (CSM with a narrow Mimi codec) and ``csm-mimi`` (Mimi at its published size), both
  with a tiny backbone (``encoders.tts_presets``), or a local folder holding a ``CsmForConditionalGeneration``
  and its processor.

Presets run in float32 (their reference outputs are float32); a folder loads in the server's ``dtype``.
"""

from __future__ import annotations

from pathlib import Path

from .config import ServerConfigError

IMAGES, VIDEOS, SPEECH = "images", "videos", "speech"

DIFFUSION_PRESETS = {"tiny-sd3": IMAGES, "tiny-wan": VIDEOS}
TTS_PRESETS = {"tiny-csm": "tiny", "csm-mimi": "mimi"}  # preset -> codec size


def _folder(source: str, what: str) -> Path:
    path = Path(source)
    if not path.is_dir():
        raise ServerConfigError(f"{what} {source!r} is neither a preset nor a local folder")
    return path


def _torch_dtype(dtype: str):
    from ..engine.models import DTYPES

    if dtype not in DTYPES:
        raise ServerConfigError(f"unknown dtype {dtype!r}; known: {', '.join(sorted(DTYPES))}")
    return DTYPES[dtype]


def load_diffusion(source: str, dtype: str) -> tuple[str, object]:
    """(task, pipeline) for a ``--diffusion`` source: task ``images`` for SD3, ``videos`` for Wan."""
    from diffusers import StableDiffusion3Pipeline, WanPipeline

    if source in DIFFUSION_PRESETS:
        from encoders.diffusion_presets import tiny_sd3_pipeline, tiny_wan_pipeline

        task = DIFFUSION_PRESETS[source]
        return task, (tiny_sd3_pipeline() if task == IMAGES else tiny_wan_pipeline())
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(_folder(source, "diffusion"), torch_dtype=_torch_dtype(dtype),
                                             local_files_only=True)
    if isinstance(pipe, StableDiffusion3Pipeline):
        return IMAGES, pipe
    if isinstance(pipe, WanPipeline):
        return VIDEOS, pipe
    raise ServerConfigError(f"{source!r} holds a {type(pipe).__name__}; this server serves SD3-family "
                            f"(StableDiffusion3Pipeline) images and Wan (WanPipeline) videos")


def load_tts(source: str, dtype: str):
    """The ``tts_presets.VoicePipeline`` of a ``--tts`` source."""
    from encoders.tts_presets import VoicePipeline, csm_pipeline

    if source in TTS_PRESETS:
        return csm_pipeline(codec=TTS_PRESETS[source])
    from transformers import AutoProcessor, CsmForConditionalGeneration

    path = _folder(source, "tts")
    model = CsmForConditionalGeneration.from_pretrained(path, dtype=_torch_dtype(dtype), local_files_only=True)
    return VoicePipeline(model.eval(), AutoProcessor.from_pretrained(path, local_files_only=True))
