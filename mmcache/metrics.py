"""Counters of one allocation manager. Plain integers, updated under the manager's lock."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class CacheMetrics:
    lookups: int = 0  # admissions that consulted the index
    lookup_pages: int = 0  # full prompt pages eligible for a hit (after the keep-one-token cap)
    lookup_tokens: int = 0  # prompt tokens of those admissions
    hit_pages: int = 0
    hit_tokens: int = 0
    forfeit_pages: int = 0  # pages after the hit that a live request held, unpublished (the in-flight loss)
    forfeit_tokens: int = 0
    stored_pages: int = 0  # pages that entered the index (teardown or publish at prefill)
    duplicate_pages: int = 0  # pages released at storing because an equal entry already existed
    evicted_pages: int = 0
    eviction_batches: int = 0
    alloc_failures_uncached: int = 0  # the cache could not help: nothing evictable was left
    alloc_failures_cache_held: int = 0  # the cache still held index-only pages: must stay 0
    per_request_matched: deque = field(default_factory=lambda: deque(maxlen=100_000))

    def record_match(self, request_id: object, matched_tokens: int) -> None:
        self.per_request_matched.append((request_id, matched_tokens))

    @property
    def hit_share(self) -> float:
        """Matched prompt tokens over all looked-up prompt tokens."""
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "per_request_matched"}
        d["hit_share"] = self.hit_share
        return d
