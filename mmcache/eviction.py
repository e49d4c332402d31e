"""Release on shortfall: cold tails first, one batch per run.

The rule (docs/DESIGN.md, "Eviction"): cached pages fill
prepaid headroom and nothing is reclaimed until a live request needs a page. Then, under the manager's lock:
take free pages, then evict cold tails, and only then fail. A *cold tail* starts at the least recently used
evictable leaf: an index page that no request holds (owner count 1, the index) and that no other entry
extends (no children). From it the batch climbs parent by
parent while the parent is also held by the index alone and the batch's page was its only child, i.e. down to
the first page another owner still holds or another branch still needs. The whole batch is dropped at once,
and batches repeat, least recent run first, until the shortfall is covered or nothing evictable is left.

Evicting leaves only keeps every entry's parent in the index, so no page is ever stranded behind a hole.

Cost: the least recent evictable leaf comes off the index's cold-leaf heap (``PrefixIndex.pop_cold_leaf``), so a
batch costs about its own length, whatever the size of the pool; no pass over the pool is made while a leaf
is left.

Windowed labels are the one way an index-only page can sit above pages a live request holds: ``release_oldest``
gives back a seeded (or prefill-published) page while the request keeps the later pages of that chain, which
stay in the index. No leaf is then ever reachable above them. So, when no evictable leaf is left, the batch
*detaches* the least recent such page: its index descendants all leave the index at once (each is held by a
windowed request that released an ancestor, or is index-only and freed), which makes the page a leaf that the
next cold tail takes. The requests keep their pages; only the index's ownership is dropped. A page in a live
request's chain is never detached: a chain runs unbroken from the root, so its ancestors are held too.
After ``evict`` stopped short, therefore, the index alone holds no page at all. Only a live request with
released pages can leave such a page, so the search for one (a pass over the pool) runs only while one lives.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .index import PrefixIndex
from .pool import PagePool

_NEVER = np.iinfo(np.int64).max


def cold_tail(index: PrefixIndex, pool: PagePool) -> np.ndarray:
    """The next batch to evict, tail first: the least recent evictable leaf and its index-only ancestors.

    The leaf comes off the index's cold-leaf heap, so a batch costs its own length (plus a heap pop per
    stale key, each pushed once), whatever the size of the pool."""
    leaf = index.pop_cold_leaf()
    if leaf < 0:
        return np.empty(0, dtype=np.int32)
    batch = [leaf]
    par = int(index.parent[leaf])
    rc, children, in_index, parent = pool.refcount, index.children, index.in_index, index.parent
    while par >= 0 and in_index[par] and rc[par] == 1 and children[par] == 1:
        batch.append(par)
        par = int(parent[par])
    return np.asarray(batch, dtype=np.int32)


def stranded_descendants(index: PrefixIndex, pool: PagePool) -> np.ndarray:
    """The index descendants of the least recent index-only page that has children (empty when there is
    none). Call it only when no leaf is evictable: then every such page sits above pages a windowed request
    still holds (see the module docstring).

    Found by pointer jumping over the whole index at once: each round doubles how far up every entry looks,
    so a chain of depth d costs about log2(d) passes over the pages, not one pass per level."""
    stranded = index.in_index & (pool.refcount == 1) & (index.children > 0)
    if not stranded.any():
        return np.empty(0, dtype=np.int32)
    top = int(np.where(stranded, index.stamp, _NEVER).argmin())
    pages = np.arange(len(index.parent), dtype=np.int32)
    # up[p]: the page 2^k levels above p (p itself past its chain's first page or outside the index)
    up = np.where(index.in_index & (index.parent >= 0), index.parent, pages)
    below = up == top  # whether top lies above p, within the levels looked at so far
    while True:
        further = up[up]
        below |= below[up]
        if np.array_equal(further, up):
            break
        up = further
    below[top] = False  # a first page of its chain points at itself: top is not its own descendant
    return np.flatnonzero(below & index.in_index).astype(np.int32)


def evict(index: PrefixIndex, pool: PagePool, pages_wanted: int, detach: bool = True,
          on_evict: Callable[[np.ndarray], None] | None = None) -> tuple[int, int]:
    """Evict cold tails until ``pages_wanted`` pages were freed or the index alone holds no page.

    Returns ``(pages_freed, batches)``. A batch is never split: it may free more than wanted. A detachment
    counts as a batch; of its pages only those it freed (the index-only ones) count as freed. ``detach=False``
    says no live request has released pages (``release_oldest``), so no index page can be stranded and the
    search for one, a pass over the pool, is skipped.

    ``on_evict(batch)`` is called with each cold tail (tail first, every page still in the index and held by
    it alone) before the batch is dropped, so a second tier can copy the pages down (``tier``). A detachment
    is not offered: it is not one chain, and only windowed labels make one.
    """
    freed = batches = 0
    while freed < pages_wanted:
        batch = cold_tail(index, pool)
        if not len(batch):
            batch = stranded_descendants(index, pool) if detach else batch
            if not len(batch):
                break
        elif on_evict is not None:
            on_evict(batch)
        index.remove(batch)
        freed += len(pool.decref(batch))
        batches += 1
    return freed, batches
