"""What ``mmcache serve`` serves, built from the names in a ``ServerConfig``, and ``serve`` to start it.

* The chat model: ``preset`` (a text preset of ``mmcache.presets.text`` or a VLM preset of
  ``mmcache.presets.vlm``) or ``model`` (a local Hugging Face folder: a LLaVA or Qwen2-VL one through
  ``mmcache.presets.vlm_folder``, any other through ``Engine.from_pretrained``).

* ``--diffusion``: ``tiny-sd3`` (text-to-image) and ``tiny-wan`` (text-to-video), the tiny seeded pipelines of
  ``mmcache.presets.diffusion``, or a local diffusers folder loaded with ``DiffusionPipeline.from_pretrained``
  (never from a hub: a source that is neither a preset nor a folder is refused). A ``StableDiffusion3Pipeline``
  serves ``/v1/images/generations``, a ``WanPipeline`` ``/v1/videos``; any other pipeline class is refused.
* ``--tts``: ``tiny-csm`` (CSM with a narrow Mimi codec) and ``csm-mimi`` (Mimi at its published size), both
  with a tiny backbone (``mmcache.presets.tts``), or a local folder holding a ``CsmForConditionalGeneration``
  and its processor.

Generation presets run in float32 (their reference outputs are float32); a folder loads in the server's ``dtype``.
``build_models`` is called by ``start_server`` once the socket is bound, so a taken address fails before any
model is built.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from ..engine.engine import Engine
from ..engine.models import DTYPES
from ..errors import InvalidRequest
from ..server.config import ServerConfig, ServerConfigError, serve_engine_config
from ..server.launch import IMAGES, SPEECH, VIDEOS, Models, start_server
from .text import engine_from_preset
from .vlm import VLM_PRESETS, VLMPreset, build_vlm, vlm_engine
from .vlm_folder import is_vlm_folder, load_vlm

DIFFUSION_PRESETS = {"tiny-sd3": IMAGES, "tiny-wan": VIDEOS}
TTS_PRESETS = {"tiny-csm": "tiny", "csm-mimi": "mimi"}  # preset -> codec size


def _folder(source: str, what: str) -> Path:
    path = Path(source)
    if not path.is_dir():
        raise ServerConfigError(f"{what} {source!r} is neither a preset nor a local folder")
    return path


def _torch_dtype(dtype: str):
    if dtype not in DTYPES:
        raise ServerConfigError(f"unknown dtype {dtype!r}; known: {', '.join(sorted(DTYPES))}")
    return DTYPES[dtype]


def load_diffusion(source: str, dtype: str) -> tuple[str, object]:
    """(task, pipeline) for a ``--diffusion`` source: task ``images`` for SD3, ``videos`` for Wan."""
    from diffusers import StableDiffusion3Pipeline, WanPipeline

    if source in DIFFUSION_PRESETS:
        from .diffusion import tiny_sd3_pipeline, tiny_wan_pipeline

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
    """The ``encoders.voice.VoicePipeline`` of a ``--tts`` source."""
    from encoders.voice import VoicePipeline

    from .tts import csm_pipeline

    if source in TTS_PRESETS:
        return csm_pipeline(codec=TTS_PRESETS[source])
    from transformers import AutoProcessor, CsmForConditionalGeneration

    path = _folder(source, "tts")
    model = CsmForConditionalGeneration.from_pretrained(path, dtype=_torch_dtype(dtype), local_files_only=True)
    return VoicePipeline(model.eval(), AutoProcessor.from_pretrained(path, local_files_only=True))


def image_limits(config: ServerConfig, vlm: VLMPreset):
    """The image limits of ``vlm`` served under ``config``, paths never read. Without ``max_image_pixels`` the
    pixel limit follows what the model's image processor feeds its tower (``media.photo_pixel_limit``: photos up
    to 16.8 MP, or twice the tower's pixels where that is more); one decode budget serves every intake thread."""
    from encoders.media import ImageLimits, photo_pixel_limit

    pixels = config.max_image_pixels or photo_pixel_limit(vlm.adapter_class.tower_pixels(vlm.image_processor))
    try:
        return ImageLimits(max_bytes=config.max_image_bytes, max_pixels=pixels, allow_paths=False,
                           max_images=config.max_images, max_expansion=config.max_image_expansion,
                           decode_budget_bytes=config.image_decode_bytes)
    except InvalidRequest as e:  # a decode budget below one image at the derived pixel limit
        raise ServerConfigError(f"image limits of {config.chat_model_name}: {e}") from None


def build_engine(config: ServerConfig):
    """An ``Engine`` (text preset or folder) or a ``VLMEngine`` (VLM preset or folder) as ``config`` names; None
    when it names no chat model."""
    if not config.serves_chat:
        return None
    engine_config = config.engine_config or serve_engine_config()
    if config.preset in VLM_PRESETS:
        if config.chat_template is not None:
            raise ServerConfigError(f"--chat-template renders a model folder's chats; the VLM preset {config.preset} "
                                    f"renders with the engine's own template (export it with mmcache export-model "
                                    f"and serve the folder with --model to give it a template)")
        vlm = build_vlm(config.preset, config.dtype)
        return vlm_engine(vlm, engine_config, config.store_bytes, image_limits(config, vlm))
    if config.preset is not None:
        return engine_from_preset(config.preset, config.dtype, engine_config)
    if is_vlm_folder(config.model):
        vlm = load_vlm(config.model, config.dtype, config.chat_template)
        return vlm_engine(vlm, engine_config, config.store_bytes, image_limits(config, vlm))
    return Engine.from_pretrained(config.model, config.dtype, engine_config)


def build_models(config: ServerConfig) -> Models:
    """Every model ``config`` names, built: the chat engine, the diffusion pipelines and the voice pipeline."""
    pipelines = []
    for source in config.diffusion:
        task, pipe = load_diffusion(source, config.dtype)
        pipelines.append((task, source, pipe))
    if config.tts is not None:
        pipelines.append((SPEECH, config.tts, load_tts(config.tts, config.dtype)))
    return Models(build_engine(config), pipelines)


@contextmanager
def serve(config: ServerConfig):
    """``start_server`` over the models ``config`` names (``RunningServer`` inside the block)."""
    with start_server(config, build_models) as srv:
        yield srv
