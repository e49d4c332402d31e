"""Engine configuration: one small dataclass whose defaults work for the embedded models.

Invariants (checked at construction, ``EngineConfigError`` otherwise):

* ``prefill_chunk_tokens`` is a positive multiple of ``page_size`` (chunks end on page boundaries);
  ``None`` picks the largest multiple of ``page_size`` not above 2048.
* ``max_tokens_per_step >= page_size``, so every prefill chunk fits some step.
* ``mixed_prefill_tokens`` (None: no bound beyond the chunks) is a positive multiple of ``page_size`` not above
  ``prefill_chunk_tokens``: the prompt tokens, all requests together, of a step that also decodes (see
  ``scheduler``). A serial schedule never mixes, so the exact schedule does not depend on it.
* ``num_pages`` (per label) is explicit or derived from ``kv_cache_bytes``, capped at four times what
  ``max_num_seqs`` sequences of ``max_model_len`` tokens need.
* ``schedule="serial"`` with ``prefill_chunk_tokens == page_size`` (``EngineConfig.exact``) is the schedule
  under which cache-on logits equal cache-off logits bit for bit, for hits on prompt pages (pages of tokens an
  earlier request generated were written by decode steps; see ``scheduler``).
* ``defer_shared_prefill`` only changes the schedule: a waiting request whose next unmatched prompt page a
  running request is writing waits for it to be published instead of computing it too (see ``scheduler``).
  It acts only where full prompt pages are published as prefill writes them (``store_at="prefill"``);
  under ``"teardown"`` nothing a running request writes is visible before it ends, so nothing is deferred.
* ``host_tier_bytes`` and ``disk_tier_bytes`` (0: none, the default) are the budgets of the second tier below
  the main label's pool (``mmcache.tier``): cached pages that eviction frees move to host memory, then to a file
  in a private directory created under ``disk_tier_dir`` (required with a disk tier). A tier hit is read back in
  by a worker thread while its request waits behind the readiness gate (``scheduler``). ``preempt_tier_bytes``
  is the offload budget's explicit share for preempted requests: host memory that a suspended request's own
  pages are copied into, and its cached pages move into when evicted, which cold cache pages cannot take
  (``mmcache.tier``). Only mode ``on`` keeps a tier. A tier smaller
  than one page is none.
* ``tensor_parallel_size > 1`` runs the engine as one rank of a tensor-parallel group (``tp_group``): the
  process group must exist (torchrun, or ``mmcache serve --tensor-parallel-size``), each rank keeps its slice of
  the model and its own pools, and a collective not done within ``tensor_parallel_timeout_s`` fails the group.
* ``compute`` (``ComputeConfig``) holds the settings that only change speed (packed linears, the row and
  tile kernels, layer kernels, the allocator setting, whole hits); see ``compute``. ``ComputeConfig.aten()``
  computes on plain ATen.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..checks import positive_int
from ..errors import MmcacheError
from ..manager import MODES, STORE_AT
from .compute.config import ComputeConfig

SCHEDULES = ("continuous", "serial")


class EngineConfigError(MmcacheError, ValueError):
    """An engine setting is out of range."""


@dataclass(frozen=True)
class EngineConfig:
    page_size: int = 128
    num_pages: int | None = None  # pages per label pool; None: from kv_cache_bytes
    kv_cache_bytes: int = 1 << 30  # per label pool, when num_pages is None
    cfg_num_pages: int | None = None  # pages of the CFG branch's pool (default: as the main pool)
    cache_mode: str = "on"  # "on" | "off" | "shadow"
    # "prefill" | "teardown". Prefill, unlike the core's default (CacheConfig.store_at): this engine batches requests
    # with one prefix together, and they share its pages only if they are published as prefill writes them.
    store_at: str = "prefill"
    max_num_seqs: int = 64
    max_tokens_per_step: int = 4096  # token budget of one forward
    prefill_chunk_tokens: int | None = None
    mixed_prefill_tokens: int | None = None  # prompt tokens of a step that decodes; None: no bound
    schedule: str = "continuous"  # "continuous" | "serial" (one request at a time)
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    seed: int = 0  # seeds the generator that draws per-request seeds when a request gives none
    defer_shared_prefill: bool = True  # compute a prefix that running requests are writing once (scheduler)
    host_tier_bytes: int = 0  # second tier in host memory below the main pool; 0: none
    disk_tier_bytes: int = 0  # second tier on local disk below the host tier; 0: none
    disk_tier_dir: str | None = None  # where the disk tier's private directory is made
    preempt_tier_bytes: int = 0  # host memory kept for preempted requests' pages, beside host_tier_bytes
    compute: ComputeConfig = field(default_factory=ComputeConfig)  # speed only: what the CPU computes with
    tensor_parallel_size: int = 1  # ranks of the model's tensor-parallel group (torch.distributed's default group)
    tensor_parallel_timeout_s: float = 60.0  # a collective of the group not done in this time fails the group

    def __post_init__(self):
        def check(ok: bool, msg: str):
            if not ok:
                raise EngineConfigError(msg)

        check(positive_int(self.page_size), f"page_size must be a positive int, got {self.page_size!r}")
        check(self.num_pages is None or positive_int(self.num_pages), f"bad num_pages {self.num_pages!r}")
        check(self.cfg_num_pages is None or positive_int(self.cfg_num_pages),
              f"bad cfg_num_pages {self.cfg_num_pages!r}")
        check(positive_int(self.kv_cache_bytes), f"bad kv_cache_bytes {self.kv_cache_bytes!r}")
        check(self.cache_mode in MODES, f"cache_mode must be one of {MODES}, got {self.cache_mode!r}")
        check(self.store_at in STORE_AT, f"store_at must be one of {STORE_AT}, got {self.store_at!r}")
        check(positive_int(self.max_num_seqs), f"bad max_num_seqs {self.max_num_seqs!r}")
        check(positive_int(self.max_tokens_per_step) and self.max_tokens_per_step >= self.page_size,
              f"max_tokens_per_step must be an int >= page_size, got {self.max_tokens_per_step!r}")
        if self.prefill_chunk_tokens is None:
            object.__setattr__(self, "prefill_chunk_tokens", max(1, 2048 // self.page_size) * self.page_size)
        check(positive_int(self.prefill_chunk_tokens) and self.prefill_chunk_tokens % self.page_size == 0,
              f"prefill_chunk_tokens must be a positive multiple of page_size, got {self.prefill_chunk_tokens!r}")
        mixed = self.mixed_prefill_tokens
        check(mixed is None or positive_int(mixed) and mixed % self.page_size == 0
              and mixed <= self.prefill_chunk_tokens,
              f"mixed_prefill_tokens must be a positive multiple of page_size not above prefill_chunk_tokens "
              f"({self.prefill_chunk_tokens}), got {self.mixed_prefill_tokens!r}")
        check(self.schedule in SCHEDULES, f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        check(self.max_model_len is None or positive_int(self.max_model_len),
              f"bad max_model_len {self.max_model_len!r}")
        check(isinstance(self.seed, int) and not isinstance(self.seed, bool) and 0 <= self.seed < 2**63,
              f"seed must be an int in [0, 2**63), got {self.seed!r}")
        check(isinstance(self.defer_shared_prefill, bool),
              f"defer_shared_prefill must be a bool, got {self.defer_shared_prefill!r}")
        for name in ("host_tier_bytes", "disk_tier_bytes", "preempt_tier_bytes"):
            v = getattr(self, name)
            check(isinstance(v, int) and not isinstance(v, bool) and v >= 0,
                  f"{name} must be a non-negative int, got {v!r}")
        check(not self.disk_tier_bytes or isinstance(self.disk_tier_dir, str) and self.disk_tier_dir != "",
              f"disk_tier_bytes needs disk_tier_dir, got {self.disk_tier_dir!r}")
        check(isinstance(self.compute, ComputeConfig), f"compute must be a ComputeConfig, got {self.compute!r}")
        check(positive_int(self.tensor_parallel_size),
              f"tensor_parallel_size must be a positive int, got {self.tensor_parallel_size!r}")
        t = self.tensor_parallel_timeout_s
        check(isinstance(t, (int, float)) and not isinstance(t, bool) and 1 <= t <= 3600,
              f"tensor_parallel_timeout_s must be between 1 and 3600 seconds, got {t!r}")

    @classmethod
    def exact(cls, page_size: int = 16, **kw) -> "EngineConfig":
        """The exact schedule (see ``scheduler``): one request at a time, prefill one page per forward."""
        return cls(page_size=page_size, schedule="serial", prefill_chunk_tokens=page_size, **kw)

    def pages_for(self, page_bytes: int, max_model_len: int) -> int:
        if self.num_pages is not None:
            return self.num_pages
        need = 4 * self.max_num_seqs * -(-max_model_len // self.page_size)
        return max(1, min(self.kv_cache_bytes // page_bytes, need))
