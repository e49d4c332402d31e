"""Eviction cost follows what it evicts, not the pool: the least recent evictable leaf comes off a heap.

Speed is measured in ``bench core``; here the work is counted instead: every numpy ufunc applied to the
index's and the pool's per-page arrays adds the number of elements it read, so a pass over the pool (the old
evictable mask) shows up as a count that grows with the pool.
"""

import numpy as np

from benchmarks import core
from mmcache import AllocationManager, CacheConfig, Fingerprint

P = 4


class Counted(np.ndarray):
    """An array view that adds the elements each ufunc reads from it to ``Counted.read``."""

    read = 0

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if method == "at":  # ufunc.at(a, indices, ...) reads the indexed elements only
            Counted.read += np.size(inputs[1])
        else:
            Counted.read += sum(x.size for x in inputs if isinstance(x, Counted))
        plain = [x.view(np.ndarray) if isinstance(x, Counted) else x for x in inputs]
        if "out" in kwargs:
            kwargs["out"] = tuple(o.view(np.ndarray) if isinstance(o, Counted) else o for o in kwargs["out"])
        return getattr(ufunc, method)(*plain, **kwargs)


def _count_reads(mgr: AllocationManager) -> None:
    idx, pool = mgr.index, mgr.pool
    for obj, name in ((idx, "in_index"), (idx, "children"), (idx, "stamp"), (idx, "parent"), (pool, "refcount")):
        setattr(obj, name, getattr(obj, name).view(Counted))


def _elements_read_to_evict(num_pages: int, evicted: int) -> int:
    mgr = core._one_page_tails(num_pages)
    _count_reads(mgr)
    mgr.admit("live", [1])
    Counted.read = 0
    mgr.reserve("live", evicted * core.PAGE)
    assert mgr.metrics.evicted_pages == mgr.metrics.eviction_batches == evicted
    return Counted.read


def test_evicting_one_page_tails_reads_as_much_in_a_big_pool_as_in_a_small_one():
    small, big = _elements_read_to_evict(512, 64), _elements_read_to_evict(16384, 64)
    assert big <= 1.25 * small + 64  # a pass over the pool per batch read 64 * 16384 elements


def test_one_page_tails_go_least_recent_first_and_a_hit_moves_a_tail_to_the_back():
    mgr = core._one_page_tails(64)
    tails = np.flatnonzero(mgr.index.in_index & (mgr.index.children == 0))
    oldest = tails[np.argsort(mgr.index.stamp[tails])]
    hit = mgr.pool.ids[[int(mgr.index.parent[oldest[0]]), int(oldest[0])]].reshape(-1)
    mgr.admit("hit", np.concatenate([hit, [7]]))  # matches the oldest tail: it becomes the most recent
    mgr.abort("hit")
    mgr.admit("live", [1])
    mgr.reserve("live", 10 * core.PAGE)
    gone = set(np.flatnonzero(~mgr.index.in_index).tolist())
    assert gone == set(oldest[1:11].tolist())
    mgr.check_invariants()


def test_the_cold_leaf_heap_stays_bounded_by_the_pool_under_hits_without_eviction():
    mgr = AllocationManager(CacheConfig(num_pages=16, page_size=P), Fingerprint.for_tests(P))
    prompt = np.arange(1, 14)  # 3 full pages and a token
    for i in range(400):  # every hit and teardown offers the run's leaf again
        res = mgr.admit(i, prompt)
        mgr.reserve(i, len(prompt) - res.matched_tokens)
        mgr.commit(i, prompt[res.matched_tokens:])
        mgr.teardown(i)
    assert len(mgr.index._cold) <= 2 * mgr.pool.num_pages + 64
    mgr.check_invariants()
