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


def ceiling_matches(specs: Sequence[RequestSpec], page_size: int,
                    groups: Sequence[int] | None = None) -> np.ndarray:
    """Matched prompt tokens per request (int64, in the order of ``specs``) under an unlimited pool.

    With ``groups`` (one label per request, e.g. its replica), each group has its own unlimited pool: a
    request matches only what earlier requests of its group stored.
    """
    namer = AllocationManager(CacheConfig(num_pages=1, page_size=page_size, mode="on"),
                              replay_fingerprint(page_size), None)
    stored: dict = {}
    out = np.zeros(len(specs), dtype=np.int64)
    for i, spec in enumerate(specs):
        final = namer.prepare(np.concatenate([spec.prompt_ids(), spec.output_ids()]), spec.media(),
                              request_id=spec.request_id)
        names = final.names.tolist()  # the prompt's page names are the leading ones: a chain depends on its past
        seen = stored.setdefault(None if groups is None else groups[i], set())
        cap = (spec.prompt_len - 1) // page_size
        k = 0
        while k < cap and names[k] in seen:
            k += 1
        out[i] = k * page_size
        seen.update(names)
    return out
