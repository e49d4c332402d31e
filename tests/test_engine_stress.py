"""The engine under a random mix of everything at once, in a pool small enough to preempt: requests sharing
prefixes (some with a CFG branch, some with stop ids), bad requests, aborts, forwards that raise, cache
clears, all between steps of one engine, in each cache mode (``shadow`` and ``off`` never seed a page) and
with pages stored as prefill fills them or at teardown.

After every operation the pools' invariants hold; every request ends exactly once; once nothing runs every
page is free or owned by the index alone; and every token a request produced, however it ended, is the token
the same request produces alone on a roomy engine (a request that ended early produced a prefix of it).
"""

import numpy as np
import pytest

from mmcache.engine import Engine, EngineConfig, ForwardError, Request, SamplingParams
from mmcache.presets.text import build_model
from mmcache.errors import AllocationFailed, InvalidRequest

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest

PAGE, VOCAB, MAX_LEN = 16, 512, 1024


@pytest.fixture(scope="module")
def tiny():
    return build_model("tiny", "float32")


def draw_request(rng, n: int, prefixes: list, negatives: list) -> Request:
    """A good request: one of a few shared prefixes (or none) and a random tail; greedy, sometimes with stop
    ids, sometimes guided by one of a few negative prompts."""
    prefix = prefixes[rng.integers(len(prefixes) + 1) - 1] if rng.random() < 0.8 else []
    tail = rng.integers(2, VOCAB, size=int(rng.integers(1, 40))).tolist()
    stops = tuple(int(t) for t in rng.integers(2, VOCAB, size=8)) if rng.random() < 0.3 else ()
    sp = SamplingParams(max_tokens=int(rng.integers(1, 24)), temperature=0.0, ignore_eos=True, stop_token_ids=stops)
    if rng.random() < 0.25:
        return Request(prefix + tail, sp, request_id=f"r{n}", negative_prompt=negatives[rng.integers(len(negatives))],
                       guidance_scale=1.5)
    return Request(prefix + tail, sp, request_id=f"r{n}")


def draw_bad(rng, n: int) -> Request:
    good = SamplingParams(max_tokens=4, temperature=0.0)
    bad = [Request([], good), Request([3, VOCAB, 4], good), Request(list(range(2, 2 + MAX_LEN)), good),
           Request([5, 6, 7], SamplingParams(max_tokens=0)), Request([5, 6], SamplingParams(top_p=2.0)),
           Request([5, 6], good, negative_prompt=[])]
    req = bad[rng.integers(len(bad))]
    req.request_id = f"bad{n}"
    return req


@pytest.mark.parametrize("seed, mode, store_at", [(seed, "on", "prefill") for seed in range(6)] + [
    (0, "shadow", "prefill"), (1, "shadow", "teardown"), (2, "off", "prefill"), (3, "on", "teardown")])
def test_random_traffic_keeps_every_invariant_and_every_token(tiny, seed, mode, store_at, traffic):
    rng = np.random.default_rng(seed)
    model, tok = tiny
    prefixes = [rng.integers(2, VOCAB, size=int(rng.integers(PAGE, 4 * PAGE))).tolist() for _ in range(3)]
    negatives = [rng.integers(2, VOCAB, size=int(rng.integers(3, 2 * PAGE))).tolist() for _ in range(2)]
    eng = Engine(model, tok, EngineConfig(page_size=PAGE, num_pages=int(rng.integers(8, 13)), cfg_num_pages=10,
                                          max_num_seqs=int(rng.integers(2, 6)), max_tokens_per_step=4 * PAGE,
                                          prefill_chunk_tokens=2 * PAGE, cache_mode=mode, store_at=store_at))
    t = traffic(eng)
    requests = {}

    for n in range(90):
        op = rng.random()
        if op < 0.3:
            req = draw_request(rng, n, prefixes, negatives)
            requests[req.request_id] = req
            eng.add_request(req)
        elif op < 0.36:
            eng.add_request(draw_bad(rng, n))
        elif op < 0.42 and eng._live:
            victim = sorted(eng._live)[rng.integers(len(eng._live))]
            assert eng.abort(victim)
        elif op < 0.45:
            t.fail_next_forward()
        elif op < 0.47:
            eng.clear_cache()
        else:
            t.take(eng.step())
        eng.check_invariants()
    while eng.has_unfinished():
        t.take(eng.step())
        eng.check_invariants()
    t.take(eng.step())  # events of requests refused after the last step

    # Every request ended once; the pools are whole.
    finished, tokens = t.finished, t.tokens
    bad = {rid for rid in finished if str(rid).startswith("bad")}
    assert set(finished) == set(requests) | bad
    assert all(finished[rid].finish_reason == "error" and isinstance(finished[rid].error, InvalidRequest)
               for rid in bad)
    for label, m in eng.managers.items():
        assert m.num_requests == 0, label
        np.testing.assert_array_equal(m.pool.refcount, m.index.in_index.astype(np.int32))

    # Every token is the one the request produces alone.
    reference = Engine(build_model("tiny", "float32")[0], tok, EngineConfig(page_size=PAGE, num_pages=256,
                                                                           prefill_chunk_tokens=2 * PAGE))
    want = {o.request_id: o for o in reference.generate(list(requests.values()))}
    reasons = set()
    for rid, out in finished.items():
        if rid in bad:
            continue
        reasons.add(out.finish_reason)
        assert out.output_ids == tokens.get(rid, []), rid  # the streamed tokens are the output
        if out.finish_reason in ("length", "stop"):
            assert out.output_ids == want[rid].output_ids and out.finish_reason == want[rid].finish_reason, rid
        else:
            assert out.output_ids == want[rid].output_ids[:len(out.output_ids)], rid
            assert out.finish_reason == "abort" or isinstance(out.error, (ForwardError, AllocationFailed)), out
    # The mix did reach the hard paths, not only the easy one.
    m = eng.metrics()
    assert "length" in reasons and m["engine"]["preemptions"] > 0 and m["engine"]["failed_forwards"] > 0
    assert (m["main"]["hit_pages"] > 0) == (mode == "on") and "cfg" in eng.managers
