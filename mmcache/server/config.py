"""What ``mmcache serve`` serves and under which limits: one frozen dataclass, checked at construction.

Invariants: at least one model is served: a chat model (at most one of ``preset`` and ``model``), diffusion
pipelines (``diffusion``: at most one per task, text-to-image and text-to-video, checked when they are built) and
a voice-cloning pipeline (``tts``); no two served models share a name. Every limit is a positive int (seconds a
positive finite number), or None where the server derives it from the served model (pixels of an image,
characters of a prompt) or from the tenants (a tenant's part of the waiting queue); the host binds the loopback
address unless told otherwise; ``port`` 0 asks for a free port. A bad value raises ``ServerConfigError`` before
any model is built.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from ..checks import positive_int
from ..errors import MmcacheError


class ServerConfigError(MmcacheError, ValueError):
    """A server setting is out of range."""


DEFAULT_STORE_BYTES = 256 * 2**20
# The server's schedule (``serve_engine_config``). Like vLLM's OpenAI server (decodes first, then prompt chunks
# within a per-step token budget: 2048 tokens by default on CPU), but a budget of thousands of prompt tokens
# beside a decode suits a GPU, where a decode step is bound by reading the weights and a few hundred prompt rows
# ride along almost free. On a CPU every prompt row costs compute: on the small model (2 cores) a decode step
# takes about 17 ms and each prompt row in the same step about 0.7 ms more, so a 2048-token chunk holds every
# decoding request up for about 1.4 s. A step that decodes therefore prefills at most SERVE_MIXED_PREFILL_TOKENS
# prompt tokens (about one decode step's time there); a step with nothing to decode still takes whole chunks.
SERVE_PAGE_SIZE = 16
SERVE_MAX_TOKENS_PER_STEP = 4096
SERVE_MIXED_PREFILL_TOKENS = 32


def serve_engine_config(**changes):
    """The ``EngineConfig`` ``mmcache serve`` runs with, ``changes`` applied (None keeps the server's default).
    Without ``mixed_prefill_tokens``: SERVE_MIXED_PREFILL_TOKENS rounded down to whole pages (at least one),
    at most the chunk. A bad value raises ``EngineConfigError``."""
    from ..engine.config import EngineConfig

    given = {k: v for k, v in changes.items() if v is not None}
    config = EngineConfig(**{"page_size": SERVE_PAGE_SIZE, "max_tokens_per_step": SERVE_MAX_TOKENS_PER_STEP,
                             **given})
    if config.mixed_prefill_tokens is not None:
        return config
    page = config.page_size
    mixed = min(max(page, SERVE_MIXED_PREFILL_TOKENS // page * page), config.prefill_chunk_tokens)
    return dataclasses.replace(config, mixed_prefill_tokens=mixed)


def tiered_engine_config(config, host_tier_bytes: int = 0, disk_tier_bytes: int = 0,
                         disk_tier_dir: str | None = None, preempt_tier_bytes: int = 0):
    """``config`` (an ``EngineConfig``) with a second tier below its chat pool (``mmcache.tier``): host memory,
    local disk and the host memory kept for preempted requests, budgets in bytes, 0 for none. A disk tier needs
    a directory that exists or can be made; a bad value raises ``EngineConfigError``."""
    from ..engine.config import EngineConfigError

    if disk_tier_bytes and disk_tier_dir is not None and os.path.exists(disk_tier_dir) \
            and not os.path.isdir(disk_tier_dir):
        raise EngineConfigError(f"disk_tier_dir {disk_tier_dir!r} is not a directory")
    return dataclasses.replace(config, host_tier_bytes=host_tier_bytes, disk_tier_bytes=disk_tier_bytes,
                               disk_tier_dir=disk_tier_dir, preempt_tier_bytes=preempt_tier_bytes)


def source_name(source: str) -> str:
    """The name clients give for a model served from ``source`` (a preset name, or a folder's last part)."""
    return str(source).rstrip("/\\").replace("\\", "/").rsplit("/", 1)[-1] or str(source)


def parse_size(size: str) -> tuple[int, int] | None:
    """``"WxH"`` as (width, height), or None when it is not two positive whole numbers."""
    if not isinstance(size, str):
        return None
    w, sep, h = size.strip().lower().partition("x")
    if not sep or not (w.isdigit() and h.isdigit() and w.isascii() and h.isascii()):
        return None
    width, height = int(w), int(h)
    return (width, height) if width > 0 and height > 0 else None


@dataclass(frozen=True)
class ServerConfig:
    preset: str | None = None  # an engine preset (text) or a VLM preset
    model: str | None = None  # a local Hugging Face folder (a text model, or a LLaVA or Qwen2-VL one)
    chat_template: str | None = None  # a Jinja file the chat model's prompts are rendered with; None: its own
    diffusion: tuple[str, ...] = ()  # diffusion presets or local diffusers folders (SD3 images, Wan videos)
    tts: str | None = None  # a voice-cloning preset or a local CSM folder
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port
    api_keys: tuple[str, ...] = ()  # empty: no key asked; two or more: each key is its own tenant
    served_model_name: str | None = None  # the chat model's name; default: the preset name or the folder's name
    max_waiting: int = 256  # requests accepted but not yet started beyond which a request gets 503
    engine_config: object = None  # an EngineConfig; None: serve_engine_config()
    store_bytes: int = DEFAULT_STORE_BYTES  # the one encoder-output store's budget, shared by every model
    dtype: str = "float32"
    max_body_bytes: int = 64 * 2**20  # a request body beyond this gets 413
    max_image_bytes: int = 16 * 2**20  # an image beyond this (decoded payload) gets 413
    # an image beyond this gets 413, refused before its pixels are decoded; None: from the VLM's image processor
    # (photos up to 16.8 MP, or twice what the tower sees where that is more: media.photo_pixel_limit)
    max_image_pixels: int | None = None
    max_image_expansion: int = 512  # decoded RGB bytes per byte sent beyond which an image above 4K gets 413
    image_decode_bytes: int | None = None  # what concurrent image decodes hold at once; None: 1 GiB (or one image)
    max_images: int = 16  # images per request
    max_cache_salt: int = 256  # characters of a request's cache_salt
    default_max_tokens: int = 256  # when a request gives neither max_tokens nor max_completion_tokens
    retry_after_s: int = 1  # the Retry-After of a 503
    max_waiting_per_tenant: int | None = None  # a tenant's part of max_waiting; None: an equal split (Tenants.share)
    max_prompt_chars: int | None = None  # characters of a prompt's text; None: from max_model_len (prompts.py)
    max_stop_chars: int = 256  # characters of one stop string
    header_timeout_s: float = 10.0  # a request's headers must arrive within this (connections.py)
    body_timeout_s: float = 30.0  # a request body may pause this long between chunks
    max_connections: int = 4096  # open connections; one more is answered 503 and closed
    metrics_key: str | None = None  # a key /metrics asks for (Authorization: Bearer KEY); None: /metrics is open
    tenant_secret: bytes | None = None  # keys a tenant's salt; None: drawn at random when the server starts
    log_level: str = "warning"
    # ---- image and speech generation ----
    image_sizes: tuple[str, ...] = ()  # "WxH" sizes an image request may ask for; empty: the pipeline's default
    max_images_per_request: int = 4  # an image request's n
    max_inference_steps: int = 50  # an image request's num_inference_steps
    negative_prompt: str = ""  # the deployment's negative prompt, for image requests that send none
    max_speech_chars: int = 4096  # characters of a speech request's input
    max_ref_text_chars: int = 4096  # characters of a speech request's ref_text (the reference clip's transcript)
    max_speech_frames: int = 250  # audio frames a speech request generates at most (Mimi: 12.5 a second)
    max_ref_audio_seconds: float = 30.0  # a reference clip longer than this gets 413
    max_ref_audio_bytes: int = 16 * 2**20  # a reference clip beyond this (decoded payload) gets 413
    max_generation_waiting: int = 16  # image, speech or video requests queued per pipeline beyond which 503
    video_limits: object = None  # a videos.VideoLimits (sizes, frames, steps, fps); None: its defaults
    max_video_jobs: int = 64  # video jobs kept (at least max_generation_waiting); the oldest finished goes first
    max_video_bytes: int = 256 * 2**20  # bytes kept in memory for video jobs: MP4s, prompts and job objects
    # (each API key has an equal share of max_generation_waiting, max_video_jobs and max_video_bytes for videos)

    def __post_init__(self):
        if self.preset is not None and self.model is not None:
            raise ServerConfigError("give at most one of preset and model")
        if self.chat_template is not None:
            self._check_chat_template()
        if isinstance(self.diffusion, str):
            raise ServerConfigError("diffusion must be a list of presets or folders, not one string")
        object.__setattr__(self, "diffusion", tuple(self.diffusion))
        if not self.serves_chat and not self.diffusion and self.tts is None:
            raise ServerConfigError("nothing to serve: give preset or model, diffusion, or tts")
        if self.served_model_name and not self.serves_chat:
            raise ServerConfigError("served_model_name names the chat model; none is served")
        if isinstance(self.api_keys, str):
            raise ServerConfigError("api_keys must be a list of keys, not one string")
        object.__setattr__(self, "api_keys", tuple(self.api_keys))
        for key in self.api_keys:
            if not isinstance(key, str) or not key or not key.isprintable():
                raise ServerConfigError("every API key must be a non-empty printable string")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ServerConfigError(f"port must be an int in [0, 65535], got {self.port!r}")
        if isinstance(self.max_waiting, bool) or not isinstance(self.max_waiting, int) or self.max_waiting < 0:
            raise ServerConfigError(f"max_waiting must be an int >= 0, got {self.max_waiting!r}")
        for name in ("store_bytes", "max_body_bytes", "max_image_bytes", "max_image_expansion", "max_images",
                     "max_cache_salt", "default_max_tokens", "retry_after_s", "max_images_per_request",
                     "max_inference_steps", "max_speech_chars", "max_ref_text_chars", "max_speech_frames",
                     "max_ref_audio_bytes",
                     "max_generation_waiting", "max_video_jobs", "max_video_bytes", "max_stop_chars"):
            if not positive_int(getattr(self, name)):
                raise ServerConfigError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        self._check_image_decoding()
        seconds = self.max_ref_audio_seconds
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < math.inf:
            raise ServerConfigError(f"max_ref_audio_seconds must be a positive number, got {seconds!r}")
        for name in ("max_waiting_per_tenant", "max_prompt_chars"):
            if getattr(self, name) is not None and not positive_int(getattr(self, name)):
                raise ServerConfigError(f"{name} must be a positive int or None, got {getattr(self, name)!r}")
        key = self.metrics_key
        if key is not None and (not isinstance(key, str) or not key or not key.isprintable()):
            raise ServerConfigError("metrics_key must be a non-empty printable string")
        self.connection_limits  # checks the timeouts and the connection cap
        self._check_generation()
        secret = self.tenant_secret
        if secret is not None and (not isinstance(secret, bytes) or len(secret) < 16):
            raise ServerConfigError("tenant_secret must be bytes of at least 16")

    def _check_chat_template(self) -> None:
        """A chat template file is given with a chat model and reads as UTF-8 Jinja source."""
        from encoders.jinja_template import ChatTemplateError, read_template_file

        if not self.serves_chat:
            raise ServerConfigError("chat_template renders the chat model's prompts; none is served")
        if not isinstance(self.chat_template, str) or not self.chat_template:
            raise ServerConfigError(f"chat_template must be the path of a file, got {self.chat_template!r}")
        try:
            read_template_file(self.chat_template)
        except ChatTemplateError as e:
            raise ServerConfigError(str(e)) from None

    def _check_image_decoding(self) -> None:
        """The pixel limit and the decode budget: each None (derived when the VLM is built) or a positive int, and
        a given budget holds one image at a given pixel limit (``media.DECODE_BYTES_PER_PIXEL``)."""
        from encoders.media import DECODE_BYTES_PER_PIXEL

        for name in ("max_image_pixels", "image_decode_bytes"):
            if getattr(self, name) is not None and not positive_int(getattr(self, name)):
                raise ServerConfigError(f"{name} must be a positive int or None, got {getattr(self, name)!r}")
        if self.max_image_pixels and self.image_decode_bytes:
            largest = self.max_image_pixels * DECODE_BYTES_PER_PIXEL
            if self.image_decode_bytes < largest:
                raise ServerConfigError(f"image_decode_bytes ({self.image_decode_bytes}) must hold one image at "
                                        f"max_image_pixels: {largest} bytes")

    def _check_generation(self) -> None:
        if isinstance(self.image_sizes, str):
            raise ServerConfigError("image_sizes must be a list of \"WxH\" sizes, not one string")
        object.__setattr__(self, "image_sizes", tuple(self.image_sizes))
        for size in self.image_sizes:
            if parse_size(size) is None:
                raise ServerConfigError(f"image size {size!r} is not of the form WxH (positive whole numbers)")
        if self.max_generation_waiting > self.max_video_jobs:
            raise ServerConfigError(f"max_generation_waiting ({self.max_generation_waiting}) must not exceed "
                                    f"max_video_jobs ({self.max_video_jobs}): queued video jobs are kept as jobs")
        if not isinstance(self.negative_prompt, str):
            raise ServerConfigError("negative_prompt must be a str")
        names = self.model_names
        if len(set(names)) != len(names):
            raise ServerConfigError(f"two served models share a name: {names}; serve them from different folders "
                                    f"or rename the chat model (served_model_name)")

    @property
    def connection_limits(self):
        """The ``connections.ConnectionLimits`` of these settings (``ServerConfigError`` when out of range)."""
        from .connections import ConnectionLimits

        return ConnectionLimits(self.header_timeout_s, self.body_timeout_s, self.max_connections, self.retry_after_s)

    @property
    def serves_chat(self) -> bool:
        return self.preset is not None or self.model is not None

    @property
    def chat_model_name(self) -> str | None:
        """The name clients give as ``model`` for chat and completions (None: no chat model)."""
        if not self.serves_chat:
            return None
        if self.served_model_name:
            return self.served_model_name
        return self.preset if self.preset is not None else source_name(self.model)

    @property
    def model_names(self) -> list[str]:
        """Every served model's name: the chat model's, each diffusion pipeline's, the voice pipeline's."""
        names = [self.chat_model_name] if self.serves_chat else []
        return names + [source_name(s) for s in self.diffusion] + ([source_name(self.tts)] if self.tts else [])

    @property
    def model_name(self) -> str:
        """The chat model's name, or without one the first served model's (the label of shared metrics)."""
        return self.model_names[0]
