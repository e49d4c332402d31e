"""mmcache: a cross-request cache for multimodal inference.

The core (this package's top-level modules) is engine-agnostic and depends on torch, numpy and xxhash only:

* ``names``     process fingerprint, chained page names, media digests
* ``pool``      page pool with owner counts (and the KV tensor, when one is wanted)
* ``index``     prefix index verified by token ids, extras and parent
* ``eviction``  cold-tail release on shortfall
* ``manager``   the allocation manager: seeding, allocation, storing, suspension, windowing, shadow mode
* ``store``     the encoder-output store

``mmcache.engine`` is the reference host engine; ``encoders`` (a sibling package) holds model adapters.
"""

from .errors import (AllocationFailed, DuplicateRequest, InvalidRequest, MediaDecodeError, MmcacheError,
                     RequestStateError, StoreEntryRejected, TraceFormatError, UnknownRequest)
from .manager import AdmitResult, AllocationManager, CacheConfig, PreparedPrompt, RequestView, ResumeResult
from .metrics import CacheMetrics
from .names import Fingerprint, MediaItem, Namer, as_token_array, canonical_encoding, media_digest
from .pool import KVSpec, PagePool
from .store import EncoderOutputStore, Lease, OutputSpec, StoreMetrics, store_key

__all__ = [
    "AdmitResult", "AllocationFailed", "AllocationManager", "CacheConfig", "CacheMetrics", "DuplicateRequest",
    "EncoderOutputStore", "Fingerprint", "InvalidRequest", "KVSpec", "Lease", "MediaDecodeError", "MediaItem",
    "MmcacheError", "Namer", "OutputSpec", "PagePool", "PreparedPrompt", "RequestStateError", "RequestView",
    "ResumeResult", "StoreEntryRejected", "StoreMetrics", "TraceFormatError", "UnknownRequest", "as_token_array",
    "canonical_encoding", "media_digest", "store_key",
]
__version__ = "0.1.0"
