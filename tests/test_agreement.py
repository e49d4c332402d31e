"""The tensor-parallel agreement in the core: a manager seeds the group's matched length, trimmed before any page
is counted (the group itself is exercised by tests/test_tensor_parallel.py, two processes over gloo)."""

import numpy as np
import pytest

from mmcache.errors import GroupFailed, InvalidRequest
from mmcache.manager import AllocationManager, CacheConfig
from mmcache.names import Fingerprint
from mmcache.tier import TierConfig, Tiers

P = 4


def _fp(rank=0, size=2):
    return Fingerprint(model_digest="m", kv_dtype="none", attention_backend="none", page_size=P, tp_rank=rank,
                       tp_size=size)


def _stored(m, rid, ids):
    m.admit(rid, ids)
    m.reserve(rid, len(ids) - m.seq_len(rid))
    m.commit(rid, ids[m.seq_len(rid):])
    m.teardown(rid)


def test_tensor_parallel_manager_without_agreement_keeps_reuse_off():
    m = AllocationManager(CacheConfig(num_pages=16, page_size=P), _fp())
    assert m.mode == "off" and "agreement" in m.reuse_off


def test_admission_seeds_the_agreed_length_and_counts_only_those_pages():
    asked = []

    def agree(k):
        asked.append(k)
        return min(k, 2)  # another rank holds two pages of the chain

    m = AllocationManager(CacheConfig(num_pages=16, page_size=P), _fp(), agreement=agree)
    assert m.mode == "on" and m.reuse_off is None
    ids = list(range(1, 19))  # 4 full pages and 2 tokens
    _stored(m, "a", ids)
    free = m.pool.num_free
    res = m.admit("b", ids)
    assert asked == [0, 4]  # every admission asks, a miss too
    assert res.matched_pages == 2 and res.matched_tokens == 2 * P and m.seq_len("b") == 2 * P
    assert m.pool.num_free == free  # the pages beyond the agreement took no owner count
    held = m.page_table("b")
    assert [int(m.pool.refcount[pg]) for pg in held] == [2, 2]
    m.abort("b")
    m.check_invariants()
    assert all(int(m.pool.refcount[pg]) == 1 for pg in held)


@pytest.mark.parametrize("answer", [-1, 5, 2.0, True, None])
def test_an_agreement_beyond_the_match_fails_the_group_and_holds_nothing(answer):
    m = AllocationManager(CacheConfig(num_pages=16, page_size=P), _fp(), agreement=lambda k: answer if k else 0)
    ids = list(range(1, 19))
    _stored(m, "a", ids)
    with pytest.raises(GroupFailed, match="agreement answered"):
        m.admit("b", ids)
    assert "b" not in m
    m.check_invariants()


def test_agreement_refuses_tiers_and_non_callables():
    tiers = Tiers(TierConfig(host_pages=4), P)  # metadata only
    with pytest.raises(InvalidRequest, match="no tiers"):
        AllocationManager(CacheConfig(num_pages=16, page_size=P), _fp(), tiers=tiers, agreement=lambda k: k)
    with pytest.raises(InvalidRequest, match="callable"):
        AllocationManager(CacheConfig(num_pages=16, page_size=P), _fp(), agreement=3)


def test_a_prepared_prompt_keeps_what_another_rank_names_it_from():
    m0 = AllocationManager(CacheConfig(num_pages=16, page_size=P), _fp(0), agreement=lambda k: k)
    m1 = AllocationManager(CacheConfig(num_pages=16, page_size=P), _fp(1), agreement=lambda k: k)
    prepared = m0.prepare(list(range(1, 10)), salt="tenant")
    again = m1.prepare(prepared.ids, prepared.media, prepared.salt)
    assert prepared.salt == "tenant" and prepared.media == ()
    assert not np.array_equal(prepared.names, again.names)  # each rank names its own slice's pages
    assert np.array_equal(m1.prepare(prepared.ids, (), "tenant").names, again.names)


def test_a_resume_re_seeds_the_agreed_length():
    answers = iter([0, 0, 1])  # the admissions of "a" and "b" agree on none; the resume's match of 4 is cut to 1

    m = AllocationManager(CacheConfig(num_pages=16, page_size=P), _fp(), agreement=lambda k: min(k, next(answers)))
    ids = list(range(1, 19))
    _stored(m, "a", ids)
    m.admit("b", list(range(1, 19)))
    m.reserve("b", 18 - m.seq_len("b"))
    m.commit("b", ids[m.seq_len("b"):])
    m.suspend("b")
    res = m.resume("b")
    assert res.restored_tokens == P and len(res.pending_ids) == 18 - P
    m.abort("b")
    m.check_invariants()
