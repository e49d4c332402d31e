"""Shadow mode as a wrapper (``mmcache.shadow``): how it is built, what it refuses, and that its mirror follows
the real manager without ever failing it. The mirror's ordering and lock rules are in test_rfc_conformance.py;
random operation sequences drive it in test_manager_stateful.py (``TestShadow``)."""

import numpy as np
import pytest

from mmcache import (AllocationFailed, AllocationManager, CacheConfig, Fingerprint, InvalidRequest, ShadowedManager,
                     make_manager)

P = 4


def config(mode, num_pages=16):
    return CacheConfig(num_pages=num_pages, page_size=P, mode=mode)


def test_make_manager_wraps_mode_shadow_and_the_manager_itself_refuses_it():
    fp = Fingerprint.for_tests(P)
    assert type(make_manager(config("on"), fp)) is AllocationManager
    assert type(make_manager(config("off"), fp)) is AllocationManager
    shadowed = make_manager(config("shadow"), fp)
    assert isinstance(shadowed, ShadowedManager)
    assert (shadowed.mode, shadowed.config.mode, shadowed.real.mode, shadowed.shadow.mode) == \
        ("shadow", "shadow", "off", "on")
    assert shadowed.shadow.pool.kv is None  # metadata only
    with pytest.raises(InvalidRequest, match="make_manager"):
        AllocationManager(config("shadow"), fp)
    with pytest.raises(InvalidRequest, match="CacheConfig"):
        make_manager({"mode": "shadow"}, fp)


def test_a_shadowed_manager_wraps_a_manager_in_mode_off_and_a_mirror_in_mode_on_of_one_page_size():
    fp = Fingerprint.for_tests(P)
    off, on = AllocationManager(config("off"), fp), AllocationManager(config("on"), fp)
    with pytest.raises(InvalidRequest, match="mode off"):
        ShadowedManager(on, on)
    with pytest.raises(InvalidRequest, match="mode off"):
        ShadowedManager(off, off)
    other = AllocationManager(CacheConfig(num_pages=16, page_size=8), Fingerprint.for_tests(8))
    with pytest.raises(InvalidRequest, match="page sizes"):
        ShadowedManager(off, other)
    with pytest.raises(InvalidRequest, match="two AllocationManagers"):
        ShadowedManager(off, None)


def test_a_shadowed_request_keeps_mode_off_pages_while_the_mirror_matches_and_catches_up():
    mgr = make_manager(config("shadow"), Fingerprint.for_tests(P))
    prompt = np.arange(1, 18)
    for rid in ("a", "b"):
        res = mgr.admit(rid, prompt)
        assert res.matched_tokens == 0  # the real manager seeds nothing
        mgr.reserve(rid, len(prompt) + 2)
        if rid == "b":  # the mirror matched 16 tokens: it has written further than the real request
            assert (mgr.seq_len("b"), mgr.shadow.seq_len("b")) == (0, 16)
        mgr.commit(rid, prompt)
        mgr.commit(rid, [7, 8])
        assert mgr.seq_len(rid) == mgr.shadow.seq_len(rid) == 19
        assert mgr.page_table(rid).tolist() == mgr.state(rid).page_indices.tolist()
        mgr.teardown(rid)
    assert mgr.shadow.metrics.hit_tokens == 16 and mgr.metrics.hit_tokens == 0
    cached = mgr.shadow.index.size
    assert mgr.pool.num_free == 16 and mgr.index.size == 0 and cached == 4
    assert mgr.clear_cache() == cached and mgr.shadow.index.size == 0  # the mirror's pages: the real one has none
    mgr.check_invariants()


def test_a_mirror_that_runs_out_of_pages_drops_the_request_and_never_fails_the_real_one():
    fp = Fingerprint.for_tests(P)
    mgr = ShadowedManager(AllocationManager(config("off", 16), fp),
                          AllocationManager(config("on", 2), fp, reuse_gates=False))
    prompt = np.arange(1, 18)
    mgr.admit("big", prompt)
    pages = mgr.reserve("big", len(prompt))  # 5 real pages; the mirror has 2
    assert len(pages) == 5 and mgr.shadow_failures == 1 and "big" not in mgr.shadow
    mgr.commit("big", prompt)  # skipped for the mirror until the request's end
    mgr.teardown("big")
    assert mgr.shadow_failures == 1 and mgr.num_requests == 0
    mgr.admit("small", [1, 2, 3])  # the end reached the mirror: it counts the next request again
    mgr.reserve("small", 3)
    assert "small" in mgr.shadow
    with pytest.raises(AllocationFailed):  # the real manager's own errors are the caller's, as in mode off
        mgr.reserve("small", 100 * P)
    mgr.abort("small")
    mgr.check_invariants()


def test_a_prepared_prompt_named_for_another_mode_is_refused_before_the_real_call():
    fp = Fingerprint.for_tests(P)
    mgr = make_manager(config("shadow"), fp)
    unnamed = make_manager(config("off"), fp).prepare(np.arange(1, 18))  # mode off names no page
    with pytest.raises(InvalidRequest, match="named for another"):
        mgr.admit("a", unnamed)
    assert "a" not in mgr and "a" not in mgr.shadow
    named = mgr.prepare(np.arange(1, 18))
    assert len(named.names) == 4 and mgr.peek(named) == 0  # peek answers for the real pages: mode off


def test_a_resume_as_readmission_is_counted_so_by_the_mirror_too():
    from mmcache.manager import CacheConfig
    from mmcache.names import Fingerprint
    from mmcache.shadow import make_manager

    m = make_manager(CacheConfig(num_pages=16, page_size=4, mode="shadow"), Fingerprint.for_tests(page_size=4))
    ids = list(range(1, 12))
    m.admit("r", ids)
    m.reserve("r", len(ids))
    m.commit("r", ids)
    m.suspend("r")
    m.resume("r", readmission=True)
    assert m.shadow.metrics.readmissions == 1
    m.abort("r")
