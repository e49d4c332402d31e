"""Streams and aborts against a running engine: aborts that re-enter a step (a stream collected by the garbage
collector inside a forward, a model hook), closed streams and reused ids, automatic ids, a tokenizer that fails
to decode, and arguments checked at call time.

After every scenario the pools are whole: ``check_invariants`` passes and, once nothing runs, every page is
either free or owned by the prefix index alone.
"""

import gc
import logging
import weakref

import pytest

from mmcache.errors import DuplicateRequest, InvalidRequest
from mmcache.engine import Engine, Request, SamplingParams
from mmcache.presets.text import build_model
from test_engine_lifecycle import assert_pools_whole, engine, greedy, prompts


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest


@pytest.fixture(scope="module")
def tiny():
    return build_model("tiny", "float32")


@pytest.fixture
def before_first_forward(tiny):
    """``before_first_forward(action)`` runs ``action`` once, inside the next forward of the tiny model (a
    forward pre-hook, so on the step's own thread, between scheduling and commit); the hook goes when the test
    ends (the model is shared by the module's tests)."""
    handles = []

    def install(action):
        fired = []

        def hook(module, args, kwargs):
            if not fired:
                fired.append(1)
                action()

        handles.append(tiny[0].register_forward_pre_hook(hook, with_kwargs=True))
        return fired

    yield install
    for handle in handles:
        handle.remove()


@pytest.fixture
def no_automatic_gc():
    """Only explicit ``gc.collect`` calls collect: an automatic one at another moment would finalise the
    abandoned stream outside the step and hide what the test is after."""
    was = gc.isenabled()
    gc.disable()
    yield
    if was:
        gc.enable()


def run_to_end(eng: Engine) -> dict:
    ended = {}
    while eng.has_unfinished():
        ended.update((e.request_id, e.output) for e in eng.step() if e.finished)
    return ended


class _Cycle:
    """An object graph that keeps itself alive: only the cyclic garbage collector frees what it holds."""

    def __init__(self, held):
        self.me, self.held = self, held


# ---- aborts that re-enter a step -------------------------------------------------------------------
def test_a_stream_collected_inside_a_forward_is_aborted_when_the_step_ends(tiny, before_first_forward,
                                                                          no_automatic_gc):
    # The abandoned stream's finally used to abort its request in the middle of the step whose forward held its
    # work: the commit raised UnknownRequest out of the other request's step, and that request, its logits
    # never sampled, later failed with "cannot be scheduled".
    ps = prompts(2, seed=3)
    want = engine(tiny).generate([ps[0]], greedy(8))[0].output_ids
    eng = engine(tiny)
    eng.add_request(ps[0], greedy(8), request_id="bg")
    eng.step()  # "bg" prefilled, its first token out
    stream = eng.stream([Request(ps[1], greedy(20), request_id="abandoned")])
    assert next(stream).token_id is not None  # admitted: it holds pages and has work in the next forward
    gone = weakref.ref(stream)
    cycle = _Cycle(stream)
    del stream, cycle  # now only the cycle keeps the stream alive
    collected = before_first_forward(gc.collect)
    ended = {e.request_id: e.output for e in eng.step() if e.finished}
    assert collected and gone() is None, "the stream was not collected inside the forward"
    assert not eng.abort("abandoned"), "the collected stream's request is still live after the step"
    eng.check_invariants()
    ended.update(run_to_end(eng))
    assert set(ended) == {"bg"}
    assert ended["bg"].finish_reason == "length" and ended["bg"].error is None
    assert ended["bg"].output_ids == want
    assert_pools_whole(eng)


def test_an_abort_from_inside_a_forward_ends_the_request_in_that_steps_events(tiny, before_first_forward):
    ps = prompts(2, seed=5)
    want = engine(tiny).generate([ps[1]], greedy(10))[0].output_ids
    eng = engine(tiny)
    for p, rid in zip(ps, "ab"):
        eng.add_request(p, greedy(10), request_id=rid)
    made = {"a": 0, "b": 0}
    for _ in range(3):
        for e in eng.step():
            made[e.request_id] += 1
    answers = []
    before_first_forward(lambda: answers.append(eng.abort("a")))
    events = eng.step()
    assert answers == [True]
    ended = {e.request_id: e.output for e in events if e.finished}
    assert set(ended) == {"a"}, "the deferred abort's event did not come out of the step it was called in"
    # "a" had work in that forward: its token of that step is kept, then it ends.
    assert ended["a"].finish_reason == "abort" and len(ended["a"].output_ids) == made["a"] + 1
    eng.check_invariants()
    ended.update(run_to_end(eng))
    assert ended["b"].finish_reason == "length" and ended["b"].output_ids == want
    assert not eng.abort("a")
    assert_pools_whole(eng)


# ---- closed streams and reused ids -----------------------------------------------------------------
def test_closing_a_stream_never_aborts_a_later_request_that_took_its_id(tiny):
    p1, p2 = prompts(2)
    eng = engine(tiny)
    first = eng.stream([Request(p1, greedy(1), request_id="x")])
    assert next(first).token_id is not None  # "x" ended; its finished event waits unread in the stream
    second = eng.stream([Request(p2, greedy(8), request_id="x")])  # "x" is free again: accepted
    assert next(second).token_id is not None
    first.close()  # used to abort "x" by id: the second stream's request
    ended = [e.output for e in second if e.finished]
    assert [(o.finish_reason, len(o.output_ids)) for o in ended] == [("length", 8)]
    assert ended[0].output_ids == engine(tiny).generate([p2], greedy(8))[0].output_ids
    assert_pools_whole(eng)


# ---- automatic ids ---------------------------------------------------------------------------------
def test_automatic_ids_skip_ids_callers_chose_for_live_requests(tiny):
    p, q = prompts(2, seed=4)
    eng = engine(tiny)
    eng.add_request(p, greedy(8), request_id="req-0")  # the caller's own id, still live
    out = eng.generate([q], greedy(4))[0]  # no id given: used to be "req-0" too, refused as a duplicate
    assert out.error is None and out.finish_reason == "length" and len(out.output_ids) == 4
    assert out.request_id == "req-1"
    assert eng.add_request(q, greedy(2)) == "req-2"
    ended = run_to_end(eng)
    assert {rid: o.finish_reason for rid, o in ended.items()} == {"req-0": "length", "req-2": "length"}
    assert_pools_whole(eng)


def test_an_automatic_id_is_held_while_its_request_is_being_added(tiny, monkeypatch):
    # A caller adds "req-0" by hand while the engine is still checking the unnamed request it gave "req-0":
    # the caller is refused as for a live id, and the two requests never share one.
    p, q = prompts(2, seed=5)
    eng = engine(tiny)
    real, events = eng.intake.live, []

    def live(req, rid, arrival):
        if req.request_id is None:  # the unnamed request, between naming and registration
            eng.add_request(q, greedy(2), request_id=rid)
            events.extend(eng.step())
        return real(req, rid, arrival)

    monkeypatch.setattr(eng.intake, "live", live)
    assert eng.add_request(p, greedy(3)) == "req-0"
    refused = [e.output for e in events if e.finished]
    assert len(refused) == 1 and isinstance(refused[0].error, DuplicateRequest)
    ended = run_to_end(eng)
    assert list(ended) == ["req-0"] and ended["req-0"].finish_reason == "length"
    assert_pools_whole(eng)


def test_metrics_while_another_thread_adds_the_first_cfg_request(tiny, monkeypatch):
    # The CFG label's manager appears when the first request with a negative prompt is added; metrics()
    # iterating the managers meanwhile raised "dictionary changed size during iteration".
    p, n = prompts(2, seed=6)
    eng = engine(tiny)
    main = eng.managers["main"]
    real = main.metrics.as_dict

    def as_dict():
        if "cfg" not in eng.managers:
            eng.add_request(Request(p, greedy(2), negative_prompt=n, guidance_scale=2.0))
        return real()

    monkeypatch.setattr(main.metrics, "as_dict", as_dict)
    m = eng.metrics()
    assert "main" in m and "cfg" in eng.managers
    run_to_end(eng)
    assert_pools_whole(eng)


# ---- a tokenizer that fails to decode --------------------------------------------------------------
class _FailingDecode:
    """A tokenizer that works but for ``decode``."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def __call__(self, *args, **kwargs):
        return self.tokenizer(*args, **kwargs)

    def decode(self, ids):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")


def test_a_tokenizer_whose_decode_raises_still_ends_every_request(tiny, caplog):
    ps = prompts(3, seed=2)
    want = [o.output_ids for o in engine(tiny).generate(ps, [greedy(4 + 4 * i) for i in range(3)])]
    eng = engine(tiny)
    eng.tokenizer = _FailingDecode(eng.tokenizer)
    for i, p in enumerate(ps):
        eng.add_request(p, greedy(4 + 4 * i), request_id=f"r{i}")
    with caplog.at_level(logging.WARNING, logger="mmcache.engine"):
        ended = run_to_end(eng)
    assert sorted(ended) == ["r0", "r1", "r2"]
    assert [ended[f"r{i}"].output_ids for i in range(3)] == want
    assert all(o.finish_reason == "length" and o.text is None for o in ended.values())
    warned = [r for r in caplog.records if "decoding the output" in r.getMessage()]
    assert len(warned) == 3 and all(r.exc_info and r.exc_info[0] is UnicodeDecodeError for r in warned)
    assert_pools_whole(eng)


# ---- arguments checked at call time ----------------------------------------------------------------
@pytest.mark.parametrize("prompts_, sampling, error", [
    ("not a list", None, TypeError),
    ([1, 2, 3], None, TypeError),  # one prompt of token ids, not a list of prompts
    ([[1, 2, 3]], "greedy", TypeError),
    ([[1, 2, 3], [4, 5]], [SamplingParams()], ValueError),
])
def test_stream_refuses_bad_arguments_when_called_as_generate_does(tiny, prompts_, sampling, error):
    eng = engine(tiny)
    with pytest.raises(error):
        eng.generate(prompts_, sampling)
    with pytest.raises(error):
        eng.stream(prompts_, sampling)  # not at the first next()
    assert_pools_whole(eng)


def test_a_stream_adds_its_requests_at_the_first_next(tiny):
    eng = engine(tiny)
    stream = eng.stream(prompts(1), greedy(3))
    assert not eng.has_unfinished()
    assert [e.finish_reason for e in stream if e.finished] == ["length"]
    assert list(eng.stream([])) == []
    assert_pools_whole(eng)


@pytest.mark.parametrize("extra", [{"sampling": SamplingParams(max_tokens=3)}, {"request_id": "mine"}])
def test_add_request_refuses_sampling_or_an_id_beside_a_request(tiny, extra):
    eng = engine(tiny)
    with pytest.raises(InvalidRequest, match="carries its own sampling and request_id"):
        eng.add_request(Request([5, 6, 7], greedy(3), request_id="own"), **extra)
    assert not eng.has_unfinished()  # refused before anything was queued
    assert eng.add_request(Request([5, 6, 7], greedy(3), request_id="own")) == "own"
    assert run_to_end(eng)["own"].finish_reason == "length"
    assert_pools_whole(eng)
