"""Windowed labels: ``release_oldest`` on seeded and published pages, and eviction of what it gives back."""

import numpy as np
import pytest

from mmcache import AllocationFailed, CacheConfig, Fingerprint, InvalidRequest, make_manager

P = 2
PROMPT = np.arange(1, 10)  # 4 full pages + 1 token


def make(num_pages=16, **kw):
    """The manager the mode asks for (``make_manager``: a ``ShadowedManager`` for mode shadow)."""
    return make_manager(CacheConfig(num_pages=num_pages, page_size=P, **kw), Fingerprint.for_tests(P))


def prefill(mgr, rid, prompt=PROMPT):
    res = mgr.admit(rid, prompt)
    mgr.reserve(rid, len(prompt) - res.matched_tokens)
    mgr.commit(rid, prompt[res.matched_tokens:])
    return res


def seeded(mode="on", store_at="teardown"):
    """``b`` holds 4 pages seeded from ``a``'s stored run (with store_at='prefill', ``a`` still runs)."""
    mgr = make(mode=mode, store_at=store_at)
    prefill(mgr, "a")
    if store_at == "teardown":
        mgr.teardown("a")
    prefill(mgr, "b")
    return mgr


@pytest.mark.parametrize("mode, store_at", [("on", "teardown"), ("on", "prefill"), ("shadow", "teardown")])
def test_releasing_zero_pages_changes_nothing(mode, store_at):
    # It raised a bare ValueError (min() of no released position) after making the label windowed; in shadow
    # mode the shadow's error escaped the real call.
    mgr = seeded(mode, store_at)
    before = (mgr.state("b"), mgr.pool.refcount.copy(), mgr.index.in_index.copy())
    assert mgr.release_oldest("b", 0).tolist() == []
    after = mgr.state("b")
    assert after.page_indices.tolist() == before[0].page_indices.tolist() and after.seq_len == before[0].seq_len
    assert np.array_equal(mgr.pool.refcount, before[1]) and np.array_equal(mgr.index.in_index, before[2])
    mgr.check_invariants()
    assert getattr(mgr, "shadow_failures", 0) == 0


def test_releasing_zero_pages_does_not_make_the_label_windowed():
    mgr = make()
    prefill(mgr, "w")
    mgr.release_oldest("w", 0)
    assert mgr.teardown("w") == 4  # a windowed label (protected prefix 0) would store nothing
    mgr.check_invariants()


@pytest.mark.parametrize("store_at", ["teardown", "prefill"])
def test_pages_a_window_gave_back_never_make_allocation_fail(store_at):
    # b's oldest two pages go back to the index alone while b keeps the two after them, so no cold tail
    # reaches them; a reserve needing them failed and counted alloc_failures_cache_held.
    mgr = make(num_pages=8 if store_at == "teardown" else 12, store_at=store_at)
    prefill(mgr, "a")
    if store_at == "teardown":
        mgr.teardown("a")
    prefill(mgr, "b")
    if store_at == "prefill":
        mgr.abort("a")  # a's pages stay indexed: b holds the published run, seeded
    held = mgr.state("b").page_indices.tolist()
    mgr.release_oldest("b", 2)
    gave_back = held[:2]
    assert (mgr.pool.refcount[gave_back] == 1).all() and mgr.index.in_index[gave_back].all()
    want = mgr.pool.num_free + 2
    mgr.reserve("b", 1 + want * P)
    mgr.check_invariants()
    assert mgr.metrics.alloc_failures_cache_held == 0 and mgr.metrics.evicted_pages >= 2
    assert not mgr.index.in_index[gave_back].any()
    assert mgr.state("b").page_indices.tolist()[2:4] == held[2:4]  # b keeps its pages, the index let go
    mgr.commit("b", np.arange(1 + want * P) + 100)
    mgr.teardown("b")
    mgr.check_invariants()
    mgr.clear_cache()
    assert mgr.pool.num_free == mgr.pool.num_pages


def test_a_window_allocation_fails_only_when_the_index_alone_holds_nothing():
    mgr = make(num_pages=8)
    prefill(mgr, "a")
    mgr.teardown("a")
    prefill(mgr, "b")
    mgr.release_oldest("b", 2)
    with pytest.raises(AllocationFailed):
        mgr.reserve("b", 1 + (mgr.pool.num_free + 5) * P)  # more than every page but b's own
    assert mgr.metrics.alloc_failures_cache_held == 0 and mgr.metrics.alloc_failures_uncached == 1
    assert not (mgr.index.in_index & (mgr.pool.refcount == 1)).any()
    mgr.check_invariants()


def test_a_typed_error_of_the_shadow_never_escapes_a_real_call_that_took_effect():
    mgr = make(mode="shadow")
    prefill(mgr, "w")

    def refuse(request_id, num_pages):
        raise InvalidRequest("the shadow refuses", request_id)

    mgr.shadow.release_oldest = refuse
    assert len(mgr.release_oldest("w", 1)) == 1  # the real call took effect and returns
    assert mgr.shadow_failures == 1 and "w" not in mgr.shadow
    mgr.teardown("w")
    mgr.check_invariants()


def test_stranded_descendants_are_exactly_the_subtree_below_the_least_recent_stranded_page():
    # Pointer jumping against a walk up each entry's chain, on random forests (duck-typed index and pool).
    from types import SimpleNamespace

    from mmcache.eviction import stranded_descendants

    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(2, 60))
        parent = np.full(n, -1, dtype=np.int32)
        for p in range(1, n):
            if rng.random() < 0.8:
                parent[p] = rng.integers(0, p)  # an earlier page: a forest
        in_index = rng.random(n) < 0.9
        for p in range(n):  # an entry's parent is in the index (eviction removes leaves only)
            q = p
            while q >= 0 and in_index[q]:
                q = parent[q]
            if q >= 0:
                in_index[p] = False
        children = np.bincount(parent[in_index & (parent >= 0)], minlength=n).astype(np.int32)
        refcount = np.where(rng.random(n) < 0.5, 1, 2).astype(np.int32)
        index = SimpleNamespace(in_index=in_index, parent=parent, children=children,
                                stamp=rng.permutation(n).astype(np.int64))
        got = set(stranded_descendants(index, SimpleNamespace(refcount=refcount)).tolist())
        stranded = [p for p in range(n) if in_index[p] and refcount[p] == 1 and children[p] > 0]
        if not stranded:
            assert got == set()
            continue
        top = min(stranded, key=lambda p: index.stamp[p])

        def above(p):
            q = parent[p]
            while q >= 0:
                yield int(q)
                q = parent[q]

        assert got == {p for p in range(n) if in_index[p] and top in above(p)}
