"""Counters of one allocation manager. Plain integers, updated under the manager's lock.

Every admission that consults the index counts in ``lookups`` and the ``lookup_*`` / ``hit_*`` counters; a
re-admission (the host admits again a request it preempted) counts there too and also in ``readmission_*``.
``hit_share`` is over first admissions only: a re-admission mostly matches the pages the request itself
stored, which says nothing of reuse between requests. ``per_request_matched`` lists first admissions.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class CacheMetrics:
    lookups: int = 0  # admissions that consulted the index (re-admissions included)
    lookup_pages: int = 0  # full prompt pages eligible for a hit (after the keep-one-token cap)
    lookup_tokens: int = 0  # prompt tokens of those admissions
    hit_pages: int = 0
    hit_tokens: int = 0
    readmissions: int = 0  # admissions of a request the host had torn down before (preemption)
    readmission_lookup_tokens: int = 0  # their prompt tokens (in lookup_tokens too)
    readmission_hit_tokens: int = 0  # their matched tokens (in hit_tokens too)
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
        """Matched prompt tokens over looked-up prompt tokens, of first admissions only."""
        looked = self.lookup_tokens - self.readmission_lookup_tokens
        return (self.hit_tokens - self.readmission_hit_tokens) / looked if looked else 0.0

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "per_request_matched"}
        d["hit_share"] = self.hit_share
        return d
