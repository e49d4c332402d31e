"""Deferral of shared prefill: requests that share a prefix compute it once, even when submitted together.

Every scenario checks the engine's invariants after every step, counts the prompt tokens the forwards
computed (``prompt_tokens``), and compares outputs with the same requests run one at a time.
"""

import numpy as np
import pytest

from mmcache.engine import Engine, EngineConfig, EngineConfigError, ForwardError, Request, SamplingParams
from mmcache.presets.text import build_model
from mmcache.engine.sequence import CFG, MAIN

P = 16


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest


@pytest.fixture(scope="module")
def tiny():
    return build_model("tiny", "float32")


def greedy(n=8):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def engine(tiny, **kw):
    kw.setdefault("num_pages", 128)
    kw.setdefault("store_at", "prefill")
    return Engine(tiny[0], tiny[1], EngineConfig(page_size=P, **kw))


def tokens(n, seed):
    return np.random.default_rng(seed).integers(2, 512, size=n).tolist()


def shared_batch(prefix_len=64, tails=(10, 21, 5, 30), seed=0):
    prefix = tokens(prefix_len, seed)
    return prefix, [prefix + tokens(t, seed + 1 + i) for i, t in enumerate(tails)]


def alone(tiny, reqs) -> list[list[int]]:
    """Each request on its own in a cache-off engine: the reference outputs."""
    eng = engine(tiny, cache_mode="off")
    return [eng.generate([r])[0].output_ids for r in reqs]


def drive(eng, reqs, after_step=None) -> dict:
    """Add every request, step to completion checking invariants after each step; outputs by request id."""
    for r in reqs:
        eng.add_request(r)
    outs = {}
    while eng.has_unfinished():
        outs.update({e.request_id: e.output for e in eng.step() if e.finished})
        eng.check_invariants()
        if after_step is not None:
            after_step(eng)
    return outs


def assert_pools_whole(eng):
    eng.check_invariants()
    for m in eng.managers.values():
        assert m.num_requests == 0
        np.testing.assert_array_equal(m.pool.refcount, m.index.in_index.astype(np.int32))


def waiting_ids(eng):
    return [lv.request_id for lv in eng.scheduler.waiting]


def running_ids(eng):
    return [lv.request_id for lv in eng.scheduler.running]


# ---- a batch sharing a prefix -----------------------------------------------------------------------
def test_a_batch_sharing_a_prefix_computes_it_once_with_outputs_of_one_at_a_time(tiny):
    prefix, ps = shared_batch()
    ps.append(list(ps[1]))  # an exact repeat: it matches every page but the one holding its last token
    reqs = [Request(p, greedy(), request_id=i) for i, p in enumerate(ps)]
    want = alone(tiny, reqs)
    eng = engine(tiny)
    outs = drive(eng, reqs)
    tails = sum(len(p) - len(prefix) for p in ps[:-1])
    repeat = len(ps[-1]) - (len(ps[-1]) - 1) // P * P
    assert eng.metrics()["engine"]["prompt_tokens"] == len(prefix) + tails + repeat
    assert [outs[i].matched_tokens for i in range(len(ps))] == [0, 64, 64, 64, (len(ps[-1]) - 1) // P * P]
    assert [outs[i].output_ids for i in range(len(ps))] == want
    # One step each (the prefix fits one chunk); the repeat waits a second step, for its twin's tail page.
    assert eng.metrics()["engine"]["deferrals"] == len(ps)
    assert_pools_whole(eng)

    off = engine(tiny, defer_shared_prefill=False)  # without the policy every request computes the prefix
    outs = drive(off, reqs)
    assert off.metrics()["engine"]["prompt_tokens"] == sum(len(p) for p in ps)
    assert off.metrics()["engine"]["deferrals"] == 0
    assert [outs[i].output_ids for i in range(len(ps))] == want


def test_a_prefix_longer_than_a_chunk_is_waited_for_chunk_by_chunk(tiny):
    # One page per chunk: the owner writes the 4-page prefix over 4 steps; the other request waits for each
    # page and is admitted the step after the last one is published, seeding all four.
    prefix, ps = shared_batch(tails=(10, 21))
    reqs = [Request(p, greedy(), request_id=i) for i, p in enumerate(ps)]
    eng = engine(tiny, prefill_chunk_tokens=P)
    seen = []
    outs = drive(eng, reqs, lambda e: seen.append((running_ids(e), waiting_ids(e))))
    assert seen[:4] == [([0], [1])] * 4 and seen[4] == ([0, 1], [])
    assert eng.metrics()["engine"]["deferrals"] == 4
    assert outs[1].matched_tokens == 64
    assert eng.metrics()["engine"]["prompt_tokens"] == sum(len(p) for p in ps) - len(prefix)
    assert [outs[i].output_ids for i in range(2)] == alone(tiny, reqs)
    assert_pools_whole(eng)


def test_requests_without_a_shared_full_page_are_never_deferred(tiny):
    common = tokens(P - 1, 9)  # shorter than a page: nothing to share
    ps = [tokens(40, s) for s in range(3)] + [common + tokens(30, 20 + s) for s in range(3)]
    reqs = [Request(p, greedy(4), request_id=i) for i, p in enumerate(ps)]
    eng = engine(tiny)
    seen = []
    outs = drive(eng, reqs, lambda e: seen.append(len(running_ids(e))))
    assert seen[0] == len(ps)  # all admitted in the first step
    assert eng.metrics()["engine"]["deferrals"] == 0
    assert eng.metrics()["engine"]["prompt_tokens"] == sum(len(p) for p in ps)
    assert [outs[i].output_ids for i in range(len(ps))] == alone(tiny, reqs)
    assert_pools_whole(eng)


@pytest.mark.parametrize("kw", [dict(store_at="teardown"), dict(cache_mode="shadow"), dict(cache_mode="off")])
def test_without_pages_published_at_prefill_nothing_is_deferred(tiny, kw):
    # Under teardown (or with no seeding index) a deferral would last the owner's whole generation, or
    # seed nothing at the end of it: the policy stays out of the way.
    _, ps = shared_batch()
    reqs = [Request(p, greedy(4), request_id=i) for i, p in enumerate(ps)]
    eng = engine(tiny, **kw)
    outs = drive(eng, reqs)
    assert eng.metrics()["engine"]["deferrals"] == 0
    assert eng.metrics()["engine"]["prompt_tokens"] == sum(len(p) for p in ps)
    assert [outs[i].output_ids for i in range(len(ps))] == alone(tiny, reqs)
    assert_pools_whole(eng)


# ---- the owner goes away ---------------------------------------------------------------------------
def test_a_deferred_request_whose_owner_is_aborted_is_admitted_and_completes(tiny):
    _, ps = shared_batch(tails=(10, 21))
    reqs = [Request(p, greedy(), request_id=i) for i, p in enumerate(ps)]
    eng = engine(tiny, prefill_chunk_tokens=P)
    for r in reqs:
        eng.add_request(r)
    eng.step()
    assert running_ids(eng) == [0] and waiting_ids(eng) == [1]
    eng.step()
    assert eng.abort(0)  # two prefix pages written and published
    eng.check_invariants()
    outs = drive(eng, [])
    assert outs[1].finish_reason == "length" and outs[1].matched_tokens == 2 * P
    assert outs[1].output_ids == alone(tiny, reqs)[1]
    assert_pools_whole(eng)


def test_a_deferred_request_whose_owner_fails_in_a_forward_is_admitted_and_seeds_nothing_unwritten(tiny):
    _, ps = shared_batch(tails=(10, 21))
    reqs = [Request(p, greedy(), request_id=i) for i, p in enumerate(ps)]
    model = build_model("tiny", "float32")[0]
    eng = Engine(model, tiny[1], EngineConfig(page_size=P, num_pages=128, store_at="prefill",
                                              prefill_chunk_tokens=P))
    run, calls = eng.runner.run, []

    def flaky(works):
        calls.append(sorted({w.live.request_id for w in works}))
        if len(calls) == 3:
            raise RuntimeError("injected failure")
        return run(works)

    eng.runner.run = flaky
    outs = drive(eng, reqs)
    assert calls[:3] == [[0], [0], [0]]
    assert outs[0].finish_reason == "error" and isinstance(outs[0].error, ForwardError)
    # Pages 0 and 1 were published by the two forwards that succeeded; page 2's forward failed, so its
    # page was never published and the deferred request computes it.
    assert outs[1].finish_reason == "length" and outs[1].matched_tokens == 2 * P
    assert outs[1].output_ids == alone(tiny, reqs)[1]
    assert eng.metrics()["engine"]["failed_forwards"] == 1
    assert_pools_whole(eng)


def test_a_deferred_request_whose_owner_is_preempted_is_admitted_and_completes(tiny):
    # "long" decodes while the owner writes a 4-page prefix a page per step and request 1 waits for it. Seven
    # pages do not hold all three: when "long" needs a page the owner (the newest running request) is
    # preempted, its published pages are evicted under the pressure, and it is re-admitted at the head of
    # the queue; request 1 waits behind it again and seeds the prefix the second time round.
    _, ps = shared_batch(tails=(10, 21))
    long = Request(tokens(30, 5), greedy(20), request_id="long")
    reqs = [Request(p, greedy(6), request_id=i) for i, p in enumerate(ps)]
    eng = engine(tiny, prefill_chunk_tokens=P, num_pages=7)
    eng.add_request(long)
    eng.step()
    eng.step()
    events = []

    def watch(e):
        for lv in e.scheduler.running + list(e.scheduler.waiting):
            if lv.setbacks.preemptions or lv.setbacks.deferrals:
                events.append((lv.request_id, lv.setbacks.preemptions, lv.setbacks.deferrals))

    outs = drive(eng, reqs, watch)
    assert eng.metrics()["engine"]["preemptions"] == 1 and outs[0].preemptions == 1
    assert (0, 1, 0) in events and (1, 0, 4) in events  # the owner was preempted while request 1 waited
    assert outs[1].matched_tokens == 64 and outs[1].preemptions == 0
    assert all(o.finish_reason == "length" for o in outs.values())
    assert [outs[i].output_ids for i in range(2)] == alone(tiny, reqs)
    assert outs["long"].output_ids == alone(tiny, [long])[0]
    assert_pools_whole(eng)


# ---- bounded skipping, no starvation ----------------------------------------------------------------
def test_later_requests_overtake_a_deferred_one_but_never_take_its_seat(tiny):
    prefix, ps = shared_batch(tails=(10, 21))
    others = [tokens(40, 30 + s) for s in range(4)]
    reqs = [Request(p, greedy(4), request_id=i) for i, p in enumerate(ps)]
    reqs += [Request(p, greedy(4), request_id=f"x{i}") for i, p in enumerate(others)]
    eng = engine(tiny, prefill_chunk_tokens=P, max_num_seqs=3)
    seen = []
    outs = drive(eng, reqs, lambda e: seen.append((running_ids(e), waiting_ids(e))))
    # Step 1: the owner, one non-sharing request (the deferred one keeps the third seat), no more.
    assert seen[0] == ([0, "x0"], [1, "x1", "x2", "x3"])
    # The deferred request goes in the step after the prefix is published, ahead of the later requests.
    admitted = next(i for i, (run, _) in enumerate(seen) if 1 in run)
    assert admitted == 4 and eng.metrics()["engine"]["deferrals"] == 4
    assert outs[1].matched_tokens == len(prefix)
    assert [outs[r.request_id].output_ids for r in reqs] == alone(tiny, reqs)
    assert_pools_whole(eng)


def test_a_deferred_request_is_admitted_on_time_under_a_stream_of_arrivals(tiny):
    prefix, ps = shared_batch(tails=(10, 21))
    eng = engine(tiny, prefill_chunk_tokens=P)
    for i, p in enumerate(ps):
        eng.add_request(Request(p, greedy(4), request_id=i))
    outs, step = {}, 0
    while eng.has_unfinished():
        if step < 12:  # a fresh non-sharing request every step, each admitted past the deferred one
            eng.add_request(Request(tokens(20, 100 + step), greedy(4), request_id=f"s{step}"))
        outs.update({e.request_id: e.output for e in eng.step() if e.finished})
        eng.check_invariants()
        step += 1
        if step == 4:
            assert 1 in waiting_ids(eng) and "s3" in running_ids(eng)
        if step == 5:
            assert 1 in running_ids(eng)
    assert eng.metrics()["engine"]["deferrals"] == 4
    assert outs[1].matched_tokens == len(prefix) and len(outs) == 2 + 12
    assert_pools_whole(eng)


def test_a_request_refused_pages_at_admission_keeps_its_place_behind_a_deferred_one(tiny):
    # Seven pages: the owner's 64-token chunk takes four, so "x" (four pages for its first chunk) is refused
    # and goes back to its own place, behind the deferred request, which then shares the owner's pages.
    _, ps = shared_batch(tails=(10, 21))
    reqs = [Request(p, greedy(6), request_id=i) for i, p in enumerate(ps)]
    reqs.append(Request(tokens(60, 77), greedy(6), request_id="x"))
    eng = engine(tiny, prefill_chunk_tokens=64, num_pages=7)
    seen = []
    outs = drive(eng, reqs, lambda e: seen.append((running_ids(e), waiting_ids(e))))
    assert seen[:2] == [([0], [1, "x"]), ([0, 1], ["x"])]
    assert [outs[r.request_id].output_ids for r in reqs] == alone(tiny, reqs)
    assert eng.metrics()["main"]["lookups"] == 3  # a refused admission is counted once, when it succeeds
    assert_pools_whole(eng)


# ---- classifier-free guidance ----------------------------------------------------------------------
def test_a_negative_prompt_shared_by_a_batch_is_computed_once(tiny):
    neg = tokens(48, 50)  # three full pages; each later request recomputes the page with its last token
    ps = [tokens(n, 60 + n) for n in (25, 40, 33)]
    reqs = [Request(p, greedy(6), request_id=i, negative_prompt=neg, guidance_scale=2.5) for i, p in enumerate(ps)]
    want = alone(tiny, reqs)
    eng = engine(tiny)
    outs = drive(eng, reqs)
    assert [outs[i].negative_matched_tokens for i in range(3)] == [0, 32, 32]
    assert eng.metrics()["engine"]["prompt_tokens"] == sum(map(len, ps)) + len(neg) + 2 * (len(neg) - 32)
    assert eng.metrics()[CFG]["hit_tokens"] == 64 and eng.metrics()[MAIN]["hit_tokens"] == 0
    assert [outs[i].output_ids for i in range(3)] == want
    assert_pools_whole(eng)
    off = engine(tiny, defer_shared_prefill=False)
    drive(off, reqs)
    assert off.metrics()["engine"]["prompt_tokens"] == sum(map(len, ps)) + 3 * len(neg)


def test_defer_setting_is_validated():
    with pytest.raises(EngineConfigError):
        EngineConfig(defer_shared_prefill="yes")


# ---- mixed steps: a step that decodes prefills at most mixed_prefill_tokens ----------------------------
def record_plans(eng) -> list:
    """Wrap the scheduler so that each step's plan is kept as (decode rows, prompt rows) of its works."""
    plans, schedule = [], eng.scheduler.schedule

    def recording():
        plan = schedule()
        decode = sum(w.end - w.start for w in plan.works if w.branch.remaining <= 1 and w.end - w.start == 1)
        plans.append((decode, sum(w.end - w.start for w in plan.works) - decode))
        return plan

    eng.scheduler.schedule = recording
    return plans


def test_a_step_that_decodes_prefills_at_most_mixed_prefill_tokens_all_requests_together(tiny):
    # a decodes 3 tokens; b and c arrive once it decodes and share one page a step beside it, then take whole
    # chunks (b its last 3 pages, c all 3 of its pages) in the step after a ends.
    reqs = [Request(tokens(P, 1), greedy(3), request_id="a"),
            Request(tokens(5 * P, 2), greedy(2), request_id="b"), Request(tokens(3 * P, 3), greedy(2), request_id="c")]
    want = alone(tiny, reqs)
    eng = engine(tiny, cache_mode="off", prefill_chunk_tokens=4 * P, mixed_prefill_tokens=P)
    plans = record_plans(eng)
    eng.add_request(reqs[0])
    eng.step()  # a's prompt alone: one chunk
    outs = drive(eng, reqs[1:])
    assert plans[:4] == [(0, P), (1, P), (1, P), (0, 6 * P)]
    assert all(p <= P for d, p in plans if d)  # every later step beside a decode too
    assert [outs["b"].output_ids, outs["c"].output_ids] == want[1:]


def test_without_mixed_prefill_tokens_a_step_beside_a_decode_takes_whole_chunks(tiny):
    reqs = [Request(tokens(P, 1), greedy(12), request_id="a"), Request(tokens(5 * P, 2), greedy(2), request_id="b")]
    eng = engine(tiny, cache_mode="off", prefill_chunk_tokens=4 * P)
    plans = record_plans(eng)
    eng.add_request(reqs[0])
    eng.step()
    drive(eng, reqs[1:])
    assert (1, 4 * P) in plans  # a's decode beside b's first chunk of four pages


@pytest.mark.parametrize("mixed", [0, P // 2, 3 * P // 2, 8 * P, True])
def test_mixed_prefill_tokens_must_be_whole_pages_within_the_chunk(mixed):
    with pytest.raises(EngineConfigError, match="mixed_prefill_tokens"):
        EngineConfig(page_size=P, prefill_chunk_tokens=4 * P, mixed_prefill_tokens=mixed)
    ok = EngineConfig(page_size=P, prefill_chunk_tokens=4 * P, mixed_prefill_tokens=2 * P)
    assert ok.mixed_prefill_tokens == 2 * P
    assert EngineConfig(page_size=P).mixed_prefill_tokens is None
