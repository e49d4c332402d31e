"""Preemption suspends a request and resumes it (``scheduler``: ``AllocationManager.suspend`` / ``resume``).

* A preempted request keeps its shared pages: while suspended it holds no page, the pages it shared lost one
  owner and stay resident, and it resumes with the same page ids; the pages it owned alone are freed (then
  computed again) or, with tiers, offloaded to the tiers' share for preempted requests and read back.
* Under the exact schedule its logits equal an un-preempted run's bit for bit, with and without tiers, preempted
  in prefill or (with tiers) in decode; the tokens it computed again are exactly the ones nothing restored.
* Under continuous batching in a pool too small for the load, tokens equal cache off's, every step keeps the
  invariants, and each preemption is counted once as a re-admission.
* A request aborted while suspended holds nothing, nor any preempted mark.
* Without tiers every call the scheduler makes on a manager has plain, picklable arguments (a tensor-parallel
  rank replays them by name).
"""

import pickle

import numpy as np
import pytest
import torch

from mmcache.engine import Engine, EngineConfig, Request, SamplingParams
from mmcache.engine.inspect import record_logits
from mmcache.presets.text import build_model

P = 16
TIERS = dict(host_tier_bytes=1 << 20, preempt_tier_bytes=1 << 20)
pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest


@pytest.fixture(scope="module")
def tiny():
    return build_model("tiny", "float32")


def two_prompts(seed=0):
    """A (74 tokens) and B (104 tokens) share a 64-token prefix: four pages."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(2, 512, size=64).tolist()
    return prefix + rng.integers(2, 512, size=10).tolist(), prefix + rng.integers(2, 512, size=40).tolist()


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def finish(eng, events=()):
    outs = {ev.request_id: ev.output for ev in events if ev.finished}
    while eng.has_unfinished():
        outs.update({ev.request_id: ev.output for ev in eng.step() if ev.finished})
        eng.check_invariants()
    return outs


def exact_run(model, tok, store_at, tiers, preempt_at=None):
    """A then B under the exact schedule; B is preempted once its written length reaches ``preempt_at``
    (None: never). Returns the logits, outputs, engine, and what was seen around the preemption."""
    a, b = two_prompts()
    eng = Engine(model, tok, EngineConfig.exact(page_size=P, num_pages=64, store_at=store_at,
                                                **(TIERS if tiers else {})))
    rec = record_logits(eng)
    outs = {"a": eng.generate([Request(a, greedy(6), request_id="a")])[0]}
    eng.add_request(Request(b, greedy(24), request_id="b"))
    mgr, seen = eng.managers["main"], {}
    while preempt_at is not None and eng.has_unfinished():
        live = eng._live_of("b")
        if live is not None and live.admitted and live.branches["main"].computed == preempt_at:
            break
        eng.step()
    if preempt_at is not None:
        held = mgr.page_table("b")
        rc = mgr.pool.refcount.copy()
        seen["shared"] = [pg for pg in held.tolist() if rc[pg] > 1]
        assert held[:len(seen["shared"])].tolist() == seen["shared"]  # the shared pages lead the table
        eng.scheduler.preempt(live)
        assert mgr.pages_held("b") == 0 and mgr.state("b").suspended and live in eng.scheduler.suspended
        assert (mgr.pool.refcount[seen["shared"]] == rc[seen["shared"]] - 1).all()
        assert (mgr.pool.refcount[seen["shared"]] >= 1).all()  # resident: another owner holds each
        eng.check_invariants()
        while not (mgr.pages_held("b") and live.branches["main"].reading is None):
            eng.step()
        seen["restored"] = live.branches["main"].matched  # seeded at the resume (read-ins included)
        seen["resumed_table"] = mgr.page_table("b")
        eng.check_invariants()
    outs.update(finish(eng))
    return rec, outs, eng, seen


# store_at, tiers, where B is preempted (written tokens), tokens restored at its resume
CASES = [
    ("teardown", False, 96, 64),  # prompt pages 4-5 were B's alone: freed, then computed again
    ("prefill", False, 96, 96),  # published as prefill wrote them: shared with the index, they stay
    ("teardown", True, 96, 96),  # B's own pages wait in the tiers' share for preempted requests
    ("teardown", True, 112, 112),  # in decode, at a page boundary: the decoded page is read back too
    ("prefill", True, 112, 112),
]


@pytest.mark.parametrize("store_at,tiers,at,restored", CASES)
def test_a_preempted_request_resumes_with_its_shared_pages_and_the_logits_of_an_unpreempted_run(
        tiny, store_at, tiers, at, restored):
    model, tok = tiny
    rec_p, out_p, eng_p, seen = exact_run(model, tok, store_at, tiers, preempt_at=at)
    rec_r, out_r, eng_r, _ = exact_run(model, tok, store_at, tiers)
    assert eng_p.scheduler.preemptions == 1 and out_p["b"].preemptions == 1
    assert seen["restored"] == restored
    n = len(seen["shared"])
    assert n >= 4 and seen["resumed_table"][:n].tolist() == seen["shared"]  # the same pages, not copies
    # Exactly what nothing restored was computed again; the rest came back as it was written.
    extra = eng_p.counters["forward_tokens"] - eng_r.counters["forward_tokens"]
    assert extra == at - restored
    m = eng_p.metrics()["main"]
    assert m["readmissions"] == 1 and m["readmission_hit_tokens"] == restored
    if tiers:
        own = (at - P * n) // P  # B's pages that no other owner held when it was suspended
        assert m["tiers"]["preempted"]["stored_pages"] == own and m["tiers"]["preempted"]["hits"] == own
    for rid in ("a", "b"):
        assert len(rec_p[rid]) == len(rec_r[rid]) > 0
        assert all(torch.equal(x, y) for x, y in zip(rec_p[rid], rec_r[rid])), rid
        assert out_p[rid].output_ids == out_r[rid].output_ids
    assert out_p["b"].matched_tokens == out_r["b"].matched_tokens == 64  # the first admission's match


def _check_suspended(eng):
    for live in eng.scheduler.suspended:
        assert live in eng.scheduler.waiting and live not in eng.scheduler.running
        for b in live.branches.values():
            assert b.admitted and b.computed == 0
            assert b.manager.pages_held(live.request_id) == 0 and b.manager.state(live.request_id).suspended


@pytest.mark.parametrize("tiers", [False, True])
def test_preemption_under_pressure_gives_cache_off_tokens_and_counts_each_readmission_once(tiny, tiers):
    model, tok = tiny
    rng = np.random.default_rng(1)
    stem = rng.integers(2, 512, size=32).tolist()
    ps = [stem + rng.integers(2, 512, size=int(rng.integers(8, 18))).tolist() for _ in range(4)]
    want = Engine(model, tok, EngineConfig(page_size=P, num_pages=64, cache_mode="off")).generate(ps, greedy(40))
    eng = Engine(model, tok, EngineConfig(page_size=P, num_pages=14, **(TIERS if tiers else {})))
    for i, p in enumerate(ps):
        eng.add_request(Request(p, greedy(40), request_id=i))
    outs, suspended_seen = {}, 0
    while eng.has_unfinished():
        outs.update({ev.request_id: ev.output for ev in eng.step() if ev.finished})
        eng.check_invariants()
        _check_suspended(eng)
        suspended_seen += len(eng.scheduler.suspended)
    m = eng.metrics()
    preemptions = m["engine"]["preemptions"]
    assert preemptions > 0 and suspended_seen > 0
    assert sum(o.preemptions for o in outs.values()) == preemptions
    assert m["main"]["readmissions"] == preemptions  # resumed once each, not also re-admitted
    assert m["main"]["lookups"] == len(ps) + preemptions
    assert m["main"]["alloc_failures_cache_held"] == 0
    assert [outs[i].output_ids for i in range(len(ps))] == [o.output_ids for o in want]
    if tiers:
        assert m["main"]["tiers"]["preempted"]["stored_pages"] > 0 and m["main"]["tiers"]["preempted"]["hits"] > 0
    mgr = eng.managers["main"]
    assert mgr.num_requests == 0 and not mgr._preempted
    assert np.array_equal(mgr.pool.refcount > 0, mgr.index.in_index)


@pytest.mark.parametrize("tiers", [False, True])
def test_a_request_aborted_while_suspended_holds_nothing(tiny, tiers):
    model, tok = tiny
    a, b = two_prompts(3)
    eng = Engine(model, tok, EngineConfig.exact(page_size=P, num_pages=64, store_at="teardown",
                                                **(TIERS if tiers else {})))
    eng.generate([Request(a, greedy(6), request_id="a")])
    eng.add_request(Request(b, greedy(24), request_id="b"))
    live = eng._live_of("b")
    while live.branches["main"].computed < 112:
        eng.step()
    eng.scheduler.preempt(live)
    mgr = eng.managers["main"]
    assert bool(mgr._preempted) == tiers  # with tiers, its index pages count as a preempted request's
    assert eng.abort("b")
    events = eng.step()
    assert [(ev.request_id, ev.finish_reason) for ev in events if ev.finished] == [("b", "abort")]
    assert not eng.has_unfinished() and not eng.scheduler.suspended and mgr.num_requests == 0
    assert not mgr._preempted
    held = mgr.pool.refcount > 0
    assert np.array_equal(held, mgr.index.in_index) and (mgr.pool.refcount[held] == 1).all()
    eng.check_invariants()
    again = eng.generate([Request(b, greedy(4), request_id="b2")])[0]  # the pool and the tiers still serve
    assert again.matched_tokens >= 64 and again.finish_reason == "length"
    eng.check_invariants()


def test_without_tiers_every_call_on_a_manager_has_plain_arguments(tiny):
    """A tensor-parallel rank replays the scheduler's calls by name, so none may carry a callable."""
    model, tok = tiny
    rng = np.random.default_rng(2)
    ps = [rng.integers(2, 512, size=int(rng.integers(40, 50))).tolist() for _ in range(4)]
    eng = Engine(model, tok, EngineConfig(page_size=P, num_pages=14))
    mgr, calls = eng.managers["main"], []
    for name in ("admit", "reserve", "commit", "teardown", "abort", "suspend", "resume", "peek",
                 "complete_read_in"):
        method = getattr(mgr, name)

        def recorded(*args, _name=name, _method=method, **kwargs):
            calls.append((_name, args, kwargs))
            return _method(*args, **kwargs)

        setattr(mgr, name, recorded)
    eng.generate(ps, greedy(40))
    assert eng.scheduler.preemptions > 0
    names = {c[0] for c in calls}
    assert {"suspend", "resume"} <= names
    for name, args, kwargs in calls:
        pickle.dumps((args, kwargs))
        assert not any(callable(v) for v in (*args, *kwargs.values())), name
    assert {tuple(sorted(kw)) for name, _, kw in calls if name == "suspend"} == {()}
    assert {tuple(sorted(kw.items())) for name, _, kw in calls if name == "resume"} == {(("readmission", True),)}
