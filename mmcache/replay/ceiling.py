"""The ceiling: what an unlimited pool would match, same page size, same order.

An unlimited pool never evicts, so its index holds every full page of every final sequence (prompt and
output) stored so far, and request ``i`` seeds the longest run of its prompt's pages whose names are there,
capped, as seeding is, to leave one prompt token to compute. Page names are chained (``names.Namer``, the
core's naming, computed by ``AllocationManager.prepare``), so a name commits to the whole prefix before it:
presence of each name of the run is the unlimited index's lookup, minus the token comparison that only a
64-bit xxHash collision could change. This module therefore keeps sets of names instead of running a
pool of every page of the trace, which would cost more than the replay itself; the tests check it against
the real manager over a pool larger than the trace and against a brute-force count on token ids.

This is a bound, not the replay's accounting: replayed hits, forfeits and evictions come from the real
manager (``simulate``). No timing enters here; pool size, in-flight overlap and replica routing erode it.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..manager import AllocationManager, CacheConfig
from .simulate import replay_fingerprint
from .workload import RequestSpec


def final_names(specs: Sequence[RequestSpec], page_size: int) -> list[np.ndarray]:
    """Page names of each request's final sequence (prompt, then output), as the manager names them."""
    namer = AllocationManager(CacheConfig(num_pages=1, page_size=page_size, mode="on"),
                              replay_fingerprint(page_size), None)
    return [namer.prepare(np.concatenate([s.prompt_ids(), s.output_ids()]), s.media(), request_id=s.request_id).names
            for s in specs]


def ceiling_from_names(names: Sequence[np.ndarray], prompt_lens: Sequence[int], page_size: int,
                       groups: Sequence | None = None) -> np.ndarray:
    """Matched prompt tokens per request (int64) under an unlimited pool, from each request's final-sequence
    page names (``final_names``) in arrival order. A prompt's page names are the leading ones of its final
    sequence: a chained name depends only on the pages before it.

    With ``groups`` (one label per request, e.g. its replica), each group has its own unlimited pool: a
    request matches only what earlier requests of its group stored.
    """
    stored: dict = {}
    out = np.zeros(len(names), dtype=np.int64)
    for i, (chain, length) in enumerate(zip(names, prompt_lens)):
        chain = chain.tolist()
        seen = stored.setdefault(None if groups is None else groups[i], set())
        cap = (int(length) - 1) // page_size
        k = 0
        while k < cap and chain[k] in seen:
            k += 1
        out[i] = k * page_size
        seen.update(chain)
    return out


def ceiling_matches(specs: Sequence[RequestSpec], page_size: int, groups: Sequence | None = None) -> np.ndarray:
    """``ceiling_from_names`` for request specs in arrival order."""
    return ceiling_from_names(final_names(specs, page_size), [s.prompt_len for s in specs], page_size, groups)
