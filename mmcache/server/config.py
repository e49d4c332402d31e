"""What ``mmcache serve`` serves and under which limits: one frozen dataclass, checked at construction.

Invariants: exactly one of ``preset`` and ``model`` is given; every limit is a positive int; the host binds the
loopback address unless told otherwise; ``port`` 0 asks for a free port. A bad value raises
``ServerConfigError`` before any model is built.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..checks import positive_int
from ..errors import MmcacheError


class ServerConfigError(MmcacheError, ValueError):
    """A server setting is out of range."""


DEFAULT_STORE_BYTES = 256 * 2**20


@dataclass(frozen=True)
class ServerConfig:
    preset: str | None = None  # an engine preset (text) or a VLM preset
    model: str | None = None  # a local Hugging Face folder (text model)
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port
    api_keys: tuple[str, ...] = ()  # empty: no key asked; two or more: each key is its own tenant
    served_model_name: str | None = None  # default: the preset name or the folder's name
    max_waiting: int = 256  # requests accepted but not yet started beyond which a request gets 503
    engine_config: object = None  # an EngineConfig; None: EngineConfig(page_size=16)
    store_bytes: int = DEFAULT_STORE_BYTES  # encoder-output store budget (VLM presets)
    dtype: str = "float32"
    max_body_bytes: int = 64 * 2**20  # a request body beyond this gets 413
    max_image_bytes: int = 16 * 2**20  # an image beyond this (decoded payload) gets 413
    max_image_pixels: int = 50_000_000  # an image beyond this gets 413, refused before its pixels are decoded
    max_images: int = 16  # images per request
    max_cache_salt: int = 256  # characters of a request's cache_salt
    default_max_tokens: int = 256  # when a request gives neither max_tokens nor max_completion_tokens
    retry_after_s: int = 1  # the Retry-After of a 503
    tenant_secret: bytes | None = None  # keys a tenant's salt; None: drawn at random when the server starts
    log_level: str = "warning"

    def __post_init__(self):
        if (self.preset is None) == (self.model is None):
            raise ServerConfigError("give exactly one of preset and model")
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
        for name in ("store_bytes", "max_body_bytes", "max_image_bytes", "max_image_pixels", "max_images",
                     "max_cache_salt", "default_max_tokens", "retry_after_s"):
            if not positive_int(getattr(self, name)):
                raise ServerConfigError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        secret = self.tenant_secret
        if secret is not None and (not isinstance(secret, bytes) or len(secret) < 16):
            raise ServerConfigError("tenant_secret must be bytes of at least 16")

    @property
    def model_name(self) -> str:
        """The name clients give as ``model``."""
        if self.served_model_name:
            return self.served_model_name
        if self.preset is not None:
            return self.preset
        return str(self.model).rstrip("/\\").replace("\\", "/").rsplit("/", 1)[-1] or str(self.model)
