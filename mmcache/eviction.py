"""Release on shortfall: cold tails first, one batch per run.

The rule (the project's design notes, DESIGN.md in the team's shared folder, "Release"): cached pages fill
prepaid headroom and nothing is reclaimed until a live request needs a page. Then, under the manager's lock:
take free pages, then evict cold tails, and only then fail. A *cold tail* starts at the least recently used
evictable leaf: an index page that no request holds (owner count 1, the index) and that no other entry
extends (no children). From it the batch climbs parent by
parent while the parent is also held by the index alone and the batch's page was its only child, i.e. down to
the first page another owner still holds or another branch still needs. The whole batch is dropped at once,
and batches repeat, least recent run first, until the shortfall is covered or nothing evictable is left.

Evicting leaves only keeps every entry's parent in the index, so no page is ever stranded behind a hole.
"""

from __future__ import annotations

import numpy as np

from .index import PrefixIndex
from .pool import PagePool

_NEVER = np.iinfo(np.int64).max


def evictable_mask(index: PrefixIndex, pool: PagePool) -> np.ndarray:
    """Pages that could be dropped right now: in the index, held by nobody else, extended by no entry."""
    return index.in_index & (pool.refcount == 1) & (index.children == 0)


def cold_tail(index: PrefixIndex, pool: PagePool) -> np.ndarray:
    """The next batch to evict, tail first: the least recent evictable leaf and its index-only ancestors."""
    mask = evictable_mask(index, pool)
    if not mask.any():
        return np.empty(0, dtype=np.int32)
    leaf = int(np.where(mask, index.stamp, _NEVER).argmin())
    batch = [leaf]
    par = int(index.parent[leaf])
    rc, children, in_index, parent = pool.refcount, index.children, index.in_index, index.parent
    while par >= 0 and in_index[par] and rc[par] == 1 and children[par] == 1:
        batch.append(par)
        par = int(parent[par])
    return np.asarray(batch, dtype=np.int32)


def evict(index: PrefixIndex, pool: PagePool, pages_wanted: int) -> tuple[int, int]:
    """Evict cold tails until ``pages_wanted`` pages were freed or none is evictable.

    Returns ``(pages_freed, batches)``. A batch is never split: it may free more than wanted.
    """
    freed = batches = 0
    while freed < pages_wanted:
        batch = cold_tail(index, pool)
        if not len(batch):
            break
        index.remove(batch)
        pool.decref(batch)
        freed += len(batch)
        batches += 1
    return freed, batches
