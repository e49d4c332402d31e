"""mmcache: a cross-request cache for multimodal inference.

The core (this package's top-level modules) is engine-agnostic and depends on torch, numpy and xxhash only:

* ``names``     process fingerprint, chained page names, media digests
* ``pool``      page pool with owner counts (and the KV tensor, when one is wanted)
* ``index``     prefix index verified by token ids, extras and parent
* ``eviction``  cold-tail release on shortfall
* ``manager``   the allocation manager: seeding, allocation, storing, suspension, windowing
* ``shadow``    shadow mode: a manager in mode off and a metadata-only mirror that counts would-be hits
* ``store``     the encoder-output store
* ``router``    replica choice by rendezvous hashing of a shared page name
* ``metrics``   one manager's counters
* ``errors``, ``checks``  typed errors, input checks

Above it, in layers (docs/DESIGN.md): ``engine`` (the reference engine), ``replay`` (trace replay over
metadata-only pools), ``hosts`` (the engine composed with the encoders: the VLM front end), ``server`` (the
OpenAI-compatible HTTP server), ``presets`` (the embedded models) and ``launcher`` with ``cli`` (the ``mmcache``
command). ``encoders`` (a sibling package) holds the model adapters.
"""

import importlib

from .errors import (AllocationFailed, DuplicateRequest, InvalidRequest, MediaDecodeError, MmcacheError,
                     RequestStateError, StoreEntryRejected, TraceFormatError, UnknownRequest)

# The rest is imported on first use (PEP 562), so that ``import mmcache.cli`` does not load torch before the
# command line has chosen its OpenMP runtime (``mmcache.launcher.openmp``). Name -> the module that defines it.
_LAZY = {
    **dict.fromkeys(["AdmitResult", "AllocationManager", "CacheConfig", "PreparedPrompt", "RequestView",
                     "ResumeResult"], "manager"),
    "CacheMetrics": "metrics",
    **dict.fromkeys(["ShadowedManager", "make_manager"], "shadow"),
    **dict.fromkeys(["Fingerprint", "MediaItem", "Namer", "as_token_array", "canonical_encoding", "media_digest"],
                    "names"),
    **dict.fromkeys(["KVSpec", "PagePool"], "pool"),
    **dict.fromkeys(["EncoderOutputStore", "Lease", "OutputSpec", "StoreMetrics", "store_key"], "store"),
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "AdmitResult", "AllocationFailed", "AllocationManager", "CacheConfig", "CacheMetrics", "DuplicateRequest",
    "EncoderOutputStore", "Fingerprint", "InvalidRequest", "KVSpec", "Lease", "MediaDecodeError", "MediaItem",
    "MmcacheError", "Namer", "OutputSpec", "PagePool", "PreparedPrompt", "RequestStateError", "RequestView",
    "ResumeResult", "ShadowedManager", "StoreEntryRejected", "StoreMetrics", "TraceFormatError", "UnknownRequest",
    "as_token_array", "canonical_encoding", "make_manager", "media_digest", "store_key",
]
__version__ = "0.1.0"
