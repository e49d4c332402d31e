"""Request lifecycle: abort, preemption, failures, bad input, cache modes, CFG, sampling, streaming.

After every scenario the pools are whole: ``check_invariants`` passes and, once nothing runs, every page is
either free or owned by the prefix index alone.
"""

import gc
import threading
import weakref

import numpy as np
import pytest
import torch

from mmcache.errors import AllocationFailed, DuplicateRequest, InvalidRequest
from mmcache.shadow import ShadowedManager
from mmcache.engine import (ComputeConfig, ComputeConfigError, Engine, EngineConfig, EngineConfigError, ForwardError,
                            Request, SamplingError, SamplingParams)
from mmcache.presets.text import build_model
from mmcache.engine.sequence import CFG, MAIN


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest


@pytest.fixture(scope="module")
def tiny():
    return build_model("tiny", "float32")


def greedy(n=12, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def prompts(n, seed=0, lo=20, hi=60):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 512, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def engine(tiny, **kw):
    kw.setdefault("page_size", 16)
    kw.setdefault("num_pages", 128)
    return Engine(tiny[0], tiny[1], EngineConfig(**kw))


def assert_pools_whole(eng: Engine):
    eng.check_invariants()
    assert not eng.has_unfinished()
    for label, m in eng.managers.items():
        assert m.num_requests == 0, label
        # Every page is free or owned by the index alone.
        np.testing.assert_array_equal(m.pool.refcount, m.index.in_index.astype(np.int32))


# ---- abort -----------------------------------------------------------------------------------------
def test_abort_running_and_waiting_requests(tiny):
    eng = engine(tiny, max_num_seqs=2)
    ps = prompts(3)
    reqs = [Request(p, greedy(20), request_id=r) for p, r in zip(ps, "abc")]
    finished = {}
    seen_b = 0
    for ev in eng.stream(reqs):
        if ev.finished:
            finished[ev.request_id] = ev.output
        elif ev.request_id == "b":
            seen_b += 1
            if seen_b == 3:
                assert eng.abort("b")
                assert eng.abort("c")  # still waiting: max_num_seqs is 2
                eng.check_invariants()
    assert not eng.abort("b")
    assert finished["b"].finish_reason == "abort" and len(finished["b"].output_ids) == 3
    assert finished["c"].finish_reason == "abort" and finished["c"].output_ids == []
    assert finished["a"].finish_reason == "length"
    assert finished["a"].output_ids == eng.generate([ps[0]], greedy(20))[0].output_ids
    assert eng.metrics()["main"]["stored_pages"] > 0  # the aborted request's computed pages were kept
    assert_pools_whole(eng)


class _ActAfterCopy(list):
    """The engine's event list, which, once armed with an action, runs it on another thread after ``step``
    copied the events and before it clears them: the interleaving a thread switch between those two lines
    would give."""

    def __init__(self):
        super().__init__()
        self.action, self.thread = None, None

    def __iter__(self):
        yield from self.copy()  # list.copy does not go through __iter__
        if self.action is not None:
            action, self.action = self.action, None
            self.thread = threading.Thread(target=action)
            self.thread.start()
            self.thread.join(timeout=0.2)  # done at once unless step holds the engine's lock


@pytest.mark.parametrize("action", ["abort a running request", "add a request that is refused"])
def test_an_end_reported_from_another_thread_during_a_step_is_never_lost(tiny, traffic, action):
    eng = engine(tiny)
    events = eng._events = _ActAfterCopy()  # before any request takes it as its sink
    ids = [eng.add_request(p, greedy(30), request_id=r) for p, r in zip(prompts(2, seed=5), "ab")]
    t = traffic(eng)
    for _ in range(4):
        t.take(eng.step())
    done = []
    if action.startswith("abort"):
        events.action = lambda: done.append(eng.abort("a"))  # "a" still runs: 30 tokens asked, a few made
    else:
        ids.append("bad")
        events.action = lambda: done.append(eng.add_request([], greedy(), request_id="bad"))
    t.take(eng.step())
    events.thread.join()
    assert done == [True] if action.startswith("abort") else done == ["bad"]
    while eng.has_unfinished():
        t.take(eng.step())
    t.take(eng.step())  # an end reported after the last step
    ended = t.finished
    assert set(ended) == set(ids), "an end reported from the other thread was dropped"
    assert ended["b"].finish_reason == "length"
    assert ended["a"].finish_reason == ("abort" if action.startswith("abort") else "length")
    if "bad" in ended:
        assert isinstance(ended["bad"].error, InvalidRequest)
    assert_pools_whole(eng)


class _EmptiedAfterAppend(list):
    """An event list that another thread's ``step`` empties right after each append."""

    def __init__(self):
        super().__init__()
        self.taken = []

    def append(self, event):
        super().append(event)
        self.taken.append(event)
        self.clear()


def test_add_request_returns_the_refused_requests_id_without_reading_it_back_from_the_events(tiny):
    # It used to return self._events[-1].request_id: an IndexError, or another request's id, once a step on
    # another thread had taken the events in between.
    eng = engine(tiny)
    events = eng._events = _EmptiedAfterAppend()
    assert eng.add_request([], greedy(), request_id="bad") == "bad"
    auto = eng.add_request([], greedy())
    assert [e.request_id for e in events.taken] == ["bad", auto] and str(auto).startswith("req-")
    assert all(isinstance(e.output.error, InvalidRequest) for e in events.taken)
    assert_pools_whole(eng)


# ---- preemption ------------------------------------------------------------------------------------
def test_preemption_when_pages_run_out_recomputes_from_the_cache(tiny):
    ps = prompts(4, seed=1, lo=40, hi=50)
    sp = greedy(40)
    want = [o.output_ids for o in engine(tiny, num_pages=64).generate(ps, sp)]
    eng = engine(tiny, num_pages=14)  # 4 requests need up to 6 pages each
    outs = eng.generate(ps, sp)
    m = eng.metrics()
    assert m["engine"]["preemptions"] > 0
    assert sum(o.preemptions for o in outs) == m["engine"]["preemptions"]
    assert m["main"]["alloc_failures_cache_held"] == 0
    assert [o.output_ids for o in outs] == want
    assert all(o.finish_reason == "length" for o in outs)
    assert_pools_whole(eng)


def test_a_preempted_request_is_reseeded_from_the_pages_its_teardown_stored(tiny):
    # Two requests in 10 pages: the second is preempted once; the first finishes before needing the
    # victim's stored pages, so re-admission seeds from them instead of recomputing.
    ps = prompts(2, seed=0, lo=40, hi=70)
    want = [o.output_ids for o in engine(tiny, num_pages=64).generate(ps, greedy(20))]
    eng = engine(tiny, num_pages=10)
    outs = eng.generate(ps, greedy(20))
    m = eng.metrics()
    assert m["engine"]["preemptions"] == 1 and m["main"]["lookups"] == 3
    assert m["main"]["hit_pages"] >= 3  # only the re-admission can hit: the two first admissions are cold
    assert [o.output_ids for o in outs] == want
    assert_pools_whole(eng)


def test_a_request_that_fails_alone_gives_its_pages_back_before_the_next_is_admitted(tiny):
    # The first request outgrows the pool alone and fails; it held its pages for the rest of that step, so the
    # second, admitted on the same step, found no room and failed too although it fits alone.
    ps = [list(range(10, 22)), list(range(30, 42))]
    sampling = [greedy(12), greedy(2)]
    eng = engine(tiny, page_size=4, num_pages=5, max_num_seqs=1)
    first, second = eng.generate(ps, sampling)
    assert first.finish_reason == "error" and isinstance(first.error, AllocationFailed)
    alone = engine(tiny, page_size=4, num_pages=5, max_num_seqs=1).generate(ps[1:], sampling[1:])[0]
    assert second.finish_reason == "length" and second.output_ids == alone.output_ids
    assert_pools_whole(eng)


def test_intake_sizes_each_prompt_against_its_own_label_s_pool(tiny):
    # The negative prompt was checked against the main pool: refused although the CFG pool held it, or accepted
    # (touching the pools) although the CFG pool could not. A prompt filling the pool exactly was refused even
    # when its single output token needs no slot.
    guided = dict(negative_prompt=list(range(10, 40)), guidance_scale=2.0)  # 30 tokens: 8 pages of 4
    roomy_cfg = engine(tiny, page_size=4, num_pages=5, cfg_num_pages=20)
    out = roomy_cfg.generate([Request([5, 6, 7], greedy(3), **guided)])[0]
    assert out.finish_reason == "length", out.error
    small_cfg = engine(tiny, page_size=4, num_pages=50, cfg_num_pages=2)
    out = small_cfg.generate([Request([5, 6, 7], greedy(3), **guided)])[0]
    assert isinstance(out.error, InvalidRequest) and "its pool has 2" in str(out.error)
    assert CFG not in small_cfg.managers  # refused before any pool was touched
    full = list(range(10, 22))  # 3 pages of 4
    assert engine(tiny, page_size=4, num_pages=3).generate([full], greedy(1))[0].finish_reason == "length"
    out = engine(tiny, page_size=4, num_pages=3).generate([full], greedy(2))[0]
    assert isinstance(out.error, InvalidRequest)  # its first output's KV needs a fourth page


def test_a_request_that_cannot_fit_alone_fails_with_allocation_error(tiny):
    eng = engine(tiny, num_pages=4)
    out, other = eng.generate([prompts(1, seed=2, lo=30, hi=31)[0], [5, 6, 7]], [greedy(100), greedy(4)])
    assert out.finish_reason == "error" and isinstance(out.error, AllocationFailed)
    assert 0 < len(out.output_ids) < 100
    assert other.finish_reason == "length" and len(other.output_ids) == 4
    assert_pools_whole(eng)


# ---- failures inside the forward -------------------------------------------------------------------
def test_exception_inside_forward_fails_only_that_forwards_requests(tiny):
    ps = prompts(4, seed=3)
    want = [o.output_ids for o in engine(tiny).generate(ps, greedy())]
    model = build_model("tiny", "float32")[0]
    eng = Engine(model, tiny[1], EngineConfig(page_size=16, num_pages=128, max_num_seqs=2))
    mlp = model.model.layers[1].mlp
    calls = {"n": 0}
    original = mlp.forward

    def flaky(x):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure")
        return original(x)

    mlp.forward = flaky
    outs = eng.generate(ps, greedy())
    assert [o.finish_reason for o in outs] == ["error", "error", "length", "length"]
    for o in outs[:2]:
        assert isinstance(o.error, ForwardError) and isinstance(o.error.__cause__, RuntimeError)
    assert [o.output_ids for o in outs[2:]] == want[2:]
    assert eng.metrics()["engine"]["failed_forwards"] == 1
    assert_pools_whole(eng)
    assert [o.output_ids for o in eng.generate(ps[:2], greedy())] == want[:2]  # the engine goes on


def test_an_error_output_keeps_no_frames_alive(tiny):
    # The error in an output carried its traceback, whose frames held the engine, the batch and the model's
    # activations, in a cycle only the cyclic collector freed.
    eng = engine(tiny)
    activations = []

    def boom(works):
        hidden = torch.ones(64)
        activations.append(weakref.ref(hidden))
        raise RuntimeError("out of memory")

    eng.runner.run = boom
    gc.disable()  # what is freed must be freed by reference counting alone
    try:
        outs = eng.generate(prompts(2), greedy()) + eng.generate([[3, 4096]], greedy())  # a forward, then intake
        assert activations and activations[0]() is None
    finally:
        gc.enable()
    for o in outs:
        e, chain = o.error, []
        while e is not None:
            chain.append(e.__traceback__)
            e = e.__cause__ or e.__context__
        assert chain and chain == [None] * len(chain), o.error
    assert isinstance(outs[0].error, ForwardError) and "in boom" in outs[0].error.cause_traceback
    assert isinstance(outs[2].error, InvalidRequest)


# ---- bad input -------------------------------------------------------------------------------------
def test_bad_input_gets_a_typed_error_and_leaves_the_others_alone(tiny):
    good = prompts(1, seed=4)[0]
    want = engine(tiny).generate([good], greedy())[0].output_ids
    eng = Engine(tiny[0], None, EngineConfig(page_size=16, num_pages=128))  # no tokenizer
    bad = [
        Request([], greedy()),
        Request([3, 512, 4], greedy()),  # outside the vocabulary of 512
        Request([3, -1, 4], greedy()),
        Request([1.5, 2.0], greedy()),
        Request(list(range(2, 2 + 1024)), greedy()),  # max_model_len is 1024
        Request("text without a tokenizer", greedy()),
        Request(good, SamplingParams(max_tokens=0)),
        Request(good, SamplingParams(temperature=-1.0)),
        Request(good, SamplingParams(top_p=0.0)),
        Request(good, SamplingParams(temperature=float("nan"))),
        Request(good, greedy(), negative_prompt=[]),
        Request(good, greedy(), negative_prompt=[5, 6], guidance_scale=float("inf")),
        Request(good, greedy(), guidance_scale=3.0),  # no negative prompt: it used to run unguided, silently
        Request(good, greedy(), guidance_scale=float("nan")),
        Request([3, True, 4], greedy()),  # a bool among ids (numpy would read it as 1)
        Request(bytearray(b"text"), greedy()),  # numpy would read its byte values as ids
        Request(good, greedy(), negative_prompt=bytearray(b"no"), guidance_scale=3.0),
        Request(good, greedy(), request_id=["not", "hashable"]),
        Request(good, SamplingParams(stop_token_ids=5)),  # not a list: used to raise TypeError out of the call
        Request(good, SamplingParams(ignore_eos="yes")),
    ]
    outs = eng.generate([Request(good, greedy(), request_id="good")] + bad
                        + [Request([5, 6], greedy(), request_id="good")])
    assert outs[0].finish_reason == "length" and outs[0].output_ids == want
    for o in outs[1:-1]:
        assert o.finish_reason == "error" and isinstance(o.error, InvalidRequest), o
        assert o.output_ids == [] and o.first_token_time is None
    assert isinstance(outs[-1].error, DuplicateRequest)
    assert eng.metrics()["main"]["lookups"] == 1
    assert CFG not in eng.managers  # a refused CFG request created no pool
    assert_pools_whole(eng)


@pytest.mark.parametrize("prompts_arg, sampling, says", [
    ((p for p in [[5, 6]]), None, "prompts must be a list of prompts .* got generator"),
    (None, None, "prompts must be a list .* got NoneType"),
    ({"prompt": [5, 6]}, None, "prompts must be a list .* got dict"),
    ([[5, 6]], {"max_tokens": 2}, "sampling must be a SamplingParams, a list of them .* got dict"),
    ([[5, 6]], "greedy", "sampling must be .* got str"),
])
def test_a_call_that_is_not_a_list_of_prompts_and_their_settings_is_refused_whole(tiny, prompts_arg, sampling, says):
    # A generator or None used to fail on len(); a dict of settings was read as a list of its keys.
    eng = engine(tiny)
    with pytest.raises(TypeError, match=says):
        eng.generate(prompts_arg, sampling)
    assert not eng.has_unfinished()
    assert_pools_whole(eng)


def test_abort_of_an_id_no_request_can_have_is_false(tiny):
    eng = engine(tiny)
    eng.add_request([5, 6, 7], greedy(4), request_id="live")
    assert eng.abort(["not", "hashable"]) is False and eng.abort({"a": 1}) is False  # used to raise TypeError
    assert eng.abort("missing") is False and eng.abort("live") is True
    assert_pools_whole(eng)


def test_text_that_is_not_valid_unicode_gets_a_typed_error_and_leaves_the_others_alone(tiny):
    # A lone surrogate (JSON's "\ud800" decodes to one) made the tokenizer raise TypeError, which escaped
    # generate and lost the whole call.
    eng = engine(tiny)
    outs = eng.generate([Request("a cat \ud800", greedy(2)), Request("a cat", greedy(2)),
                         Request("a cat", greedy(2), negative_prompt="\udfff", guidance_scale=2.0),
                         Request("a cat", greedy(2), salt="tenant-\ud800"),
                         Request("a cat", greedy(2), salt=7, request_id="int-salt")])
    assert [o.finish_reason for o in outs] == ["error", "length", "error", "error", "error"]
    assert isinstance(outs[3].error, InvalidRequest) and "salt" in str(outs[3].error)
    # The error names the request it belongs to, like every other bad-input error.
    assert outs[3].error.request_id is not None and outs[4].error.request_id == "int-salt"
    assert str(outs[4].error).startswith("request 'int-salt': salt must be bytes or str")
    assert isinstance(outs[0].error, InvalidRequest) and "surrogate" in str(outs[0].error)
    assert "negative prompt" in str(outs[2].error)
    assert_pools_whole(eng)


def test_a_tokenizer_that_raises_fails_that_request_only(tiny, monkeypatch):
    eng = engine(tiny)
    real = type(eng.tokenizer).__call__

    def picky(self, text, *args, **kwargs):
        if "forbidden" in text:
            raise RuntimeError("the tokenizer's own failure")
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(type(eng.tokenizer), "__call__", picky)
    outs = eng.generate([Request("a forbidden word", greedy(2)), Request("a cat", greedy(2))])
    assert isinstance(outs[0].error, InvalidRequest) and "could not be tokenized" in str(outs[0].error)
    assert isinstance(outs[0].error.__cause__, RuntimeError) and outs[1].finish_reason == "length"
    assert_pools_whole(eng)


def test_engine_config_errors_are_typed():
    with pytest.raises(EngineConfigError):
        EngineConfig(page_size=16, prefill_chunk_tokens=20)
    with pytest.raises(EngineConfigError):
        EngineConfig(cache_mode="sometimes")
    with pytest.raises(EngineConfigError):
        EngineConfig(page_size=16, max_tokens_per_step=8)
    # These were taken as given: a seed numpy refuses only when the engine is built, any truthy flag.
    for name, bad in (("seed", -1), ("seed", "x"), ("seed", 1.5), ("seed", True)):
        with pytest.raises(EngineConfigError, match=name):
            EngineConfig(**{name: bad})
    for name, bad in (("packed_linears", "no"), ("tune_malloc", 0), ("layer_kernels", None), ("row_products", 1)):
        with pytest.raises(ComputeConfigError, match=name):
            ComputeConfig(**{name: bad})
    with pytest.raises(EngineConfigError, match="compute"):
        EngineConfig(compute={"packed_linears": False})
    assert EngineConfig(page_size=48).prefill_chunk_tokens == 2016


# ---- cache modes -----------------------------------------------------------------------------------
def _second_admitted_while_first_runs(eng, shared):
    a = eng.add_request(shared + [7, 8, 9], greedy(30), request_id="a")
    events = []
    while not any(e.request_id == a and e.token_id is not None for e in events):
        events += eng.step()
    eng.add_request(shared + [10, 11], greedy(3), request_id="b")
    outs = {}
    while eng.has_unfinished():
        for e in eng.step():
            if e.finished:
                outs[e.request_id] = e.output
    return outs


def test_store_at_prefill_shares_pages_with_a_request_still_running(tiny):
    shared = prompts(1, seed=5, lo=64, hi=65)[0]
    outs = _second_admitted_while_first_runs(engine(tiny, store_at="prefill"), shared)
    assert outs["b"].matched_tokens == 64
    eng = engine(tiny, store_at="teardown")
    outs_td = _second_admitted_while_first_runs(eng, shared)
    assert outs_td["b"].matched_tokens == 0
    assert eng.metrics()["main"]["forfeit_tokens"] == 64  # held in flight by "a", not yet published
    assert outs_td["b"].output_ids == outs["b"].output_ids
    assert_pools_whole(eng)


def test_shadow_mode_outputs_equal_cache_off_and_counts_would_have_matched_pages(tiny):
    base = prompts(1, seed=6, lo=50, hi=51)[0]
    waves = [[base + [3, 4]], [base + [5], base[:40] + [9]]]
    results = {}
    for mode in ("off", "shadow", "on"):
        eng = engine(tiny, cache_mode=mode)
        assert isinstance(eng.managers[MAIN], ShadowedManager) == (mode == "shadow")  # make_manager's wrapper
        results[mode] = ([o.output_ids for w in waves for o in eng.generate(w, greedy())], eng.metrics()["main"])
        assert_pools_whole(eng)
    assert results["shadow"][0] == results["off"][0] == results["on"][0]
    real, shadow = results["shadow"][1], results["shadow"][1]["shadow"]
    assert real["hit_pages"] == 0 and real["stored_pages"] == 0 and real["shadow_failures"] == 0
    assert shadow["hit_pages"] == results["on"][1]["hit_pages"] == 3 + 2


# ---- classifier-free guidance ----------------------------------------------------------------------
def test_cfg_scale_one_gives_the_unguided_output(tiny):
    p, neg = prompts(2, seed=7)
    eng = engine(tiny)
    plain = eng.generate([p], greedy(16))[0]
    guided = eng.generate([Request(p, greedy(16), negative_prompt=neg, guidance_scale=1.0)])[0]
    assert guided.output_ids == plain.output_ids
    assert_pools_whole(eng)


def test_cfg_matches_a_reference_guidance_loop_and_reuses_negative_prompt_pages(tiny):
    ref = build_model("tiny", "float32")[0]
    p1, p2, neg = prompts(3, seed=8, lo=35, hi=45)
    neg = neg[:40]
    eng = engine(tiny)
    forwards = []
    run = eng.runner.run
    eng.runner.run = lambda works: forwards.append({w.branch.label for w in works}) or run(works)
    scale = 3.0
    out1 = eng.generate([Request(p1, greedy(10), negative_prompt=neg, guidance_scale=scale)])[0]
    out2 = eng.generate([Request(p2, greedy(10), negative_prompt=neg, guidance_scale=scale)])[0]
    assert {MAIN, CFG} in forwards  # both labels' segments shared a forward
    for p, out in ((p1, out1), (p2, out2)):
        toks = []
        with torch.no_grad():
            for _ in range(10):
                cond = ref(torch.tensor([p + toks])).logits[0, -1]
                uncond = ref(torch.tensor([neg + toks])).logits[0, -1]
                toks.append(int(torch.argmax(uncond + scale * (cond - uncond))))
        assert out.output_ids == toks
    unguided = eng.generate([p1], greedy(10))[0].output_ids
    assert unguided != out1.output_ids  # guidance changed the output
    assert out2.negative_matched_tokens == 32 and out2.matched_tokens == 0
    assert eng.metrics()[CFG]["hit_pages"] == 2
    assert_pools_whole(eng)


# ---- sampling, stopping, streaming ------------------------------------------------------------------
def test_seeded_sampling_is_reproducible_and_independent_of_batch(tiny):
    ps = prompts(3, seed=9)
    eng = engine(tiny, cache_mode="off")
    sp = [SamplingParams(max_tokens=10, temperature=0.8, top_k=50, top_p=0.9, seed=s, ignore_eos=True)
          for s in (1, 2, 3)]
    together = [o.output_ids for o in eng.generate(ps, sp)]
    alone = [eng.generate([p], [s])[0].output_ids for p, s in zip(ps, sp)]
    assert together == alone
    other_seed = eng.generate([ps[0]], SamplingParams(max_tokens=10, temperature=0.8, seed=99, ignore_eos=True))
    assert other_seed[0].output_ids != together[0]
    top1 = eng.generate([ps[0]], SamplingParams(max_tokens=10, temperature=1.0, top_k=1, seed=5, ignore_eos=True))
    assert top1[0].output_ids == eng.generate([ps[0]], greedy(10))[0].output_ids


def test_stop_ids_eos_and_model_length(tiny):
    p = prompts(1, seed=10)[0]
    eng = engine(tiny, max_model_len=len(p) + 5)
    full = eng.generate([p], greedy(5))[0].output_ids
    assert len(full) == 5
    stop = eng.generate([p], greedy(5, stop_token_ids=(full[2],)))[0]
    assert stop.finish_reason == "stop" and stop.output_ids == full[:full.index(full[2]) + 1]
    capped = eng.generate([p], greedy(50))[0]
    assert capped.finish_reason == "length" and capped.output_ids == full  # prompt + output == max_model_len
    model = build_model("tiny", "float32")[0]
    model.generation_config.eos_token_id = full[1]
    eos_eng = Engine(model, None, EngineConfig(page_size=16, num_pages=64))
    eos = eos_eng.generate([p], SamplingParams(max_tokens=5, temperature=0.0))[0]
    assert eos.finish_reason == "eos" and eos.output_ids == full[:full.index(full[1]) + 1]
    assert eos_eng.generate([p], greedy(5))[0].output_ids == full  # ignore_eos


def test_stream_events_and_timings(tiny):
    ps = prompts(2, seed=11)
    eng = engine(tiny)
    events = list(eng.stream(ps, greedy(6)))
    outs = [e.output for e in events if e.finished]
    assert len(outs) == 2
    for o in outs:
        toks = [e for e in events if e.request_id == o.request_id and not e.finished]
        assert [e.token_id for e in toks] == o.output_ids
        assert [e.time for e in toks] == o.token_times
        assert o.arrival_time <= o.first_token_time == o.token_times[0]
        assert o.token_times == sorted(o.token_times)
        last = max(i for i, e in enumerate(events) if e.request_id == o.request_id)
        assert events[last].finished
    assert [o.output_ids for o in eng.generate(ps, greedy(6))] == [o.output_ids for o in sorted(
        outs, key=lambda o: int(o.request_id.split("-")[1]))]


def test_a_stream_left_early_releases_its_requests(tiny):
    eng = engine(tiny)
    stream = eng.stream(prompts(3, seed=12), greedy(20))
    assert next(stream).token_id is not None
    stream.close()
    assert not eng.has_unfinished()
    assert_pools_whole(eng)


def test_non_finite_logits_fail_only_that_request_with_a_sampling_error(tiny):
    eng = engine(tiny)
    run = eng.runner.run

    def poisoned(works):
        logits = run(works).clone()  # the engine's rows are inference tensors
        for i, w in enumerate([w for w in works if w.wants_logits]):
            if w.live.request_id == "bad":
                logits[i] = float("nan")
        return logits

    eng.runner.run = poisoned
    p = prompts(1, seed=13)[0]
    random = SamplingParams(max_tokens=4, temperature=1.0, seed=0, ignore_eos=True)
    bad, good = eng.generate([Request(p, random, request_id="bad"), Request(p, greedy(4), request_id="good")])
    assert bad.finish_reason == "error" and isinstance(bad.error, SamplingError)
    assert good.finish_reason == "length" and len(good.output_ids) == 4
    assert_pools_whole(eng)


def test_huge_integer_temperatures_and_guidance_scales_neither_raise_out_of_a_step(tiny, monkeypatch):
    # A Python int temperature or guidance scale beyond int64 (finite, so accepted) made torch raise
    # OverflowError inside the step, which escaped generate; any exception while sampling now ends only its
    # request with SamplingError. An int too large for a float is refused at intake.
    eng = engine(tiny)
    p = prompts(1, seed=13)[0]
    outs = eng.generate([Request(p, SamplingParams(max_tokens=3, temperature=10**30, seed=0, ignore_eos=True)),
                         Request(p, greedy(3), negative_prompt=[5, 6], guidance_scale=10**30),
                         Request(p, greedy(3), negative_prompt=[5, 6], guidance_scale=10**400),
                         Request(p, SamplingParams(max_tokens=3, temperature=10**400)),
                         Request(p, greedy(3), request_id="good")])
    assert outs[0].finish_reason == "length" and len(outs[0].output_ids) == 3
    assert outs[1].finish_reason == "length" or isinstance(outs[1].error, SamplingError)
    assert all(isinstance(o.error, InvalidRequest) for o in outs[2:4]), outs
    assert outs[4].finish_reason == "length"
    import mmcache.engine.engine as engine_module

    def broken(*args):
        raise ValueError("a sampler bug")

    monkeypatch.setattr(engine_module, "sample", broken)
    bad, good = eng.generate([Request(p, SamplingParams(max_tokens=3, seed=0), request_id="bad"),
                              Request(p, greedy(3), request_id="good")])
    assert isinstance(bad.error, SamplingError) and isinstance(bad.error.__cause__, ValueError)
    assert good.finish_reason == "length"
    assert_pools_whole(eng)


def test_top_k_and_top_p_restrict_the_sampled_support():
    from mmcache.engine.sampling import guided, sample

    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    gen = torch.Generator().manual_seed(0)

    def support(**kw):
        sp = SamplingParams(temperature=1.0, **kw)
        return {sample(logits, sp, gen) for _ in range(300)}

    assert support() == {0, 1, 2, 3}
    assert support(top_p=0.6) == {0, 1}  # 0.5 < 0.6, so the second token is kept; 0.8 covers it
    assert support(top_p=0.4) == {0}
    assert support(top_k=3) == {0, 1, 2}
    assert sample(logits, SamplingParams(temperature=0.0), None) == 0
    cond, uncond = torch.tensor([1.0, 3.0]), torch.tensor([2.0, 1.0])
    assert torch.equal(guided(cond, uncond, 2.0), torch.tensor([0.0, 5.0]))


def test_cfg_requests_survive_preemption_and_abort(tiny):
    ps = prompts(3, seed=14, lo=30, hi=40)
    negs = prompts(3, seed=15, lo=20, hi=30)
    reqs = [Request(p, greedy(24), negative_prompt=n, guidance_scale=2.0) for p, n in zip(ps, negs)]
    want = [o.output_ids for o in engine(tiny, num_pages=64).generate(reqs)]
    eng = engine(tiny, num_pages=9, cfg_num_pages=7)
    outs = eng.generate(reqs)
    assert eng.metrics()["engine"]["preemptions"] > 0
    assert [o.output_ids for o in outs] == want
    assert_pools_whole(eng)
    stream = eng.stream(reqs[:2])
    first = next(stream)
    assert eng.abort(first.request_id)
    rest = list(stream)
    aborted = [e.output for e in rest if e.finished and e.request_id == first.request_id]
    assert aborted[0].finish_reason == "abort"
    assert_pools_whole(eng)


def test_a_cfg_pool_shortage_preempts_only_requests_holding_cfg_pages(tiny):
    # Two CFG requests outgrow a 6-page CFG pool while they decode; the two newer requests carry no negative
    # prompt, so preempting them would free no CFG page: the newer CFG request is the one preempted.
    ps = prompts(4, seed=14, lo=30, hi=40)
    negs = prompts(2, seed=15, lo=30, hi=40)
    reqs = [Request(ps[i], greedy(24), negative_prompt=negs[i], guidance_scale=2.0) for i in range(2)]
    reqs += [Request(p, greedy(24)) for p in ps[2:]]
    want = [o.output_ids for o in engine(tiny, num_pages=64).generate(reqs)]
    eng = engine(tiny, num_pages=64, cfg_num_pages=6)
    outs = eng.generate(reqs)
    assert [o.preemptions for o in outs] == [0, 1, 0, 0]
    assert [o.output_ids for o in outs] == want
    assert_pools_whole(eng)


def test_clear_cache_drops_every_cached_page_but_none_a_live_request_holds(tiny):
    p = prompts(1, seed=16, lo=50, hi=51)[0]
    eng = engine(tiny, cache_mode="shadow")
    eng.generate([p], greedy(4))
    assert eng.clear_cache() == 3  # the shadow's three stored pages
    eng = engine(tiny)
    eng.generate([p], greedy(4))
    cached = eng.metrics()["main"]["cached_pages"]
    eng.add_request(p, greedy(20), request_id="live")
    eng.step()  # "live" is admitted and holds the cached pages it matched
    assert eng.clear_cache() == cached - 3
    eng.abort("live")
    assert eng.clear_cache() > 0 and eng.metrics()["main"]["cached_pages"] == 0
    assert eng.generate([p], greedy(4))[0].matched_tokens == 0
    assert_pools_whole(eng)


def test_a_steps_greedy_tokens_are_each_rows_first_maximum(tiny):
    from mmcache.engine.sampling import greedy_picks
    from mmcache.engine.inspect import record_logits

    eng = engine(tiny)
    rows = record_logits(eng)
    ps = prompts(5, seed=21)
    reqs = [Request(p, greedy(6), request_id=f"g{i}") for i, p in enumerate(ps[:3])]
    reqs.append(Request(ps[3], SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True),
                        request_id="s"))
    reqs.append(Request(ps[4], greedy(6), negative_prompt=ps[0][:10], guidance_scale=2.0, request_id="c"))
    outs = {o.request_id: o for o in eng.generate(reqs)}
    for i in range(3):  # greedy rows picked together with sampled and CFG rows in the same forwards
        assert outs[f"g{i}"].output_ids == [int(torch.argmax(r)) for r in rows[f"g{i}"]]
    alone = engine(tiny).generate([reqs[4]])[0].output_ids
    assert outs["c"].output_ids == alone  # a CFG request is guided, not picked from its main row

    logits = torch.tensor([[1.0, 3.0, 3.0], [5.0, 0.0, 5.0], [0.0, 0.0, 9.0], [2.0, 2.0, 1.0]])
    assert greedy_picks(logits, {"a": 0, "b": 3}) == {"a": 1, "b": 0}  # a subset of rows; ties: the first
    assert greedy_picks(logits, {"a": 1, "b": 0, "c": 2, "d": 3}) == {"a": 0, "b": 1, "c": 2, "d": 0}
    assert greedy_picks(logits, {}) == {}


def test_a_step_whose_batched_greedy_pick_raises_samples_each_row_instead(tiny, monkeypatch):
    # The step's greedy tokens are picked together; that call sat outside the per-request guard, so its failure
    # escaped step() after the commits and the next step failed both requests as unschedulable.
    ps = prompts(2, seed=21)
    want = [o.output_ids for o in engine(tiny).generate(ps, greedy(6))]
    eng = engine(tiny)
    calls = []

    def failing(*args):
        calls.append(1)
        raise RuntimeError("injected")

    import mmcache.engine.engine as engine_module

    monkeypatch.setattr(engine_module, "greedy_picks", failing)
    outs = eng.generate(ps, greedy(6))
    assert calls and [o.output_ids for o in outs] == want and all(o.finish_reason == "length" for o in outs)
    assert_pools_whole(eng)


@pytest.mark.parametrize("at_look", [1, 2, 3])
def test_a_stream_closed_on_another_thread_while_a_change_runs_is_never_left_live(tiny, at_look):
    # A stream's finaliser that finds the lock taken leaves its aborts in the inbox. Here it runs, on another
    # thread, right after the holder's at_look-th look at the empty inbox (the change's start, its end, after the
    # release): one left after the last look would stay live, holding its pages, until some later change.
    from collections import deque

    eng = engine(tiny)
    stream = eng.stream([prompts(1, seed=31)[0]], greedy(40))
    rid = next(stream).request_id
    looks = []

    class Queue(deque):
        def __bool__(self):
            empty = len(self) == 0
            if empty:
                looks.append(1)
                if len(looks) == at_look:
                    closing = threading.Thread(target=stream.close)
                    closing.start()
                    closing.join(30)
            return not empty

    eng._inbox = Queue()
    with eng._change():
        pass
    eng._inbox = deque(eng._inbox)
    assert len(looks) >= at_look and not eng.is_live(rid)
    assert_pools_whole(eng)


def test_an_abort_of_a_request_a_closed_stream_already_queued_finishes_it_once(tiny):
    # The change an abort runs first drains the aborts streams left in the inbox; when that ended the very
    # request, an abort that had looked it up before finished it a second time (two finished events).
    eng = engine(tiny)
    stream = eng.stream([prompts(1, seed=32)[0]], greedy(30))
    rid = next(stream).request_id
    live = eng._live[rid]
    eng._inbox.append(live)  # as a finaliser that found the lock taken leaves it
    assert not eng.abort(rid)  # the inbox, drained first, ended it: nothing live under rid is left to abort
    assert [e.finish_reason for e in live.sink if e.finished] == ["abort"]
    assert not eng.abort(rid)
    assert_pools_whole(eng)


def test_an_abort_from_a_release_callback_ends_its_request_in_the_same_step(tiny):
    # A release callback runs inside the change that ends its request: the abort it makes waits in the inbox
    # until that change ends, and its event comes out of the same step.
    from mmcache.engine import MultimodalInput

    ps = prompts(2, seed=41)
    eng = engine(tiny)
    answers = []
    mm = MultimodalInput(release=lambda: answers.append(eng.abort("b")))
    eng.add_request(Request(ps[0], greedy(2), request_id="a", mm=mm))
    eng.add_request(ps[1], greedy(20), request_id="b")
    ended = {}
    while "a" not in ended:
        ended.update({e.request_id: e.output for e in eng.step() if e.finished})
    assert answers == [True] and set(ended) == {"a", "b"}
    assert (ended["a"].finish_reason, ended["b"].finish_reason) == ("length", "abort")
    assert_pools_whole(eng)


def test_an_abort_from_another_thread_waits_for_the_running_step_and_returns_with_the_request_ended(tiny):
    eng = engine(tiny)
    eng.add_request(prompts(1, seed=42)[0], greedy(20), request_id="x")
    eng.step()
    inside, go = threading.Event(), threading.Event()

    def hold_the_forward(module, args, kwargs):
        if not inside.is_set():
            inside.set()
            go.wait(60)

    handle = tiny[0].register_forward_pre_hook(hold_the_forward, with_kwargs=True)
    events, answer = [], []
    stepping = threading.Thread(target=lambda: events.extend(eng.step()))
    aborting = threading.Thread(target=lambda: answer.append((eng.abort("x"), eng.is_live("x"))))
    try:
        stepping.start()
        assert inside.wait(60)
        aborting.start()
        aborting.join(0.3)
        assert aborting.is_alive() and not answer, "the abort did not wait for the step running elsewhere"
    finally:
        go.set()
        stepping.join(60)
        aborting.join(60)
        handle.remove()
    assert answer == [(True, False)]  # it returned with the request ended
    assert events and not any(e.finished for e in events)  # that step had ended before the abort took effect
    assert [e.finish_reason for e in eng.step() if e.finished] == ["abort"]
    assert_pools_whole(eng)
