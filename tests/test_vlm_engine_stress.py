"""VLM requests under a random mix of everything at once, in a pool small enough to preempt and a store small
enough to evict: images shared between requests and turns, corrupt image bytes, two salts, second turns with
another image, aborts, forwards that raise and cache clears, all between steps of one engine.

After every operation ``VLMEngine.check_invariants`` holds (page owner counts, the store's budget, exact hold
counts); every request ends exactly once; once nothing runs every page is free or owned by the index alone and
no store entry is held; and every token a request produced, however it ended, is the token the same request
produces alone on a roomy engine with an ample store (a request that ended early produced a prefix of it).
The same holds when another thread adds and aborts requests while this one steps.
"""

import threading
import time

import numpy as np
import pytest

from mmcache.engine import Engine, EngineConfig, ForwardError, SamplingParams
from mmcache.hosts.vlm import VLMEngine, VLMRequest
from mmcache.presets.vlm import build_vlm
from mmcache.errors import AllocationFailed, MediaDecodeError
from mmcache.store import EncoderOutputStore

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest

P = 16
QUESTIONS = ("What is in this image?", "Describe the colours.", "How many objects are there?")


@pytest.fixture(scope="module")
def crops(photo_crops) -> list[bytes]:
    """Six distinct real images: two crops of each of three photos, as PNG."""
    return photo_crops(("coffee.png", "chelsea.png", "astronaut.png"))


def draw_request(rng, n: int, crops: list[bytes]) -> VLMRequest:
    """One image (now and then corrupt bytes) and a question; sometimes a second turn with another image."""
    image = crops[rng.integers(len(crops))] if rng.random() > 0.05 else b"\x89PNG but not one"
    content = [{"type": "image", "image": image}, {"type": "text", "text": QUESTIONS[rng.integers(len(QUESTIONS))]}]
    messages = [{"role": "system", "content": "You look at photos."}, {"role": "user", "content": content}]
    if rng.random() < 0.3:
        messages += [{"role": "assistant", "content": "A photo."},
                     {"role": "user", "content": [{"type": "image", "image": crops[rng.integers(len(crops))]},
                                                  {"type": "text", "text": "And this one?"}]}]
    sampling = SamplingParams(max_tokens=int(rng.integers(1, 40)), temperature=0.0, ignore_eos=True)
    return VLMRequest(messages, sampling=sampling, request_id=f"r{n}", salt=(b"", b"tenant")[rng.integers(2)])


@pytest.mark.parametrize("name,seed", [("tiny-llava", 102), ("tiny-qwen2-vl", 103)])
def test_random_vlm_traffic_keeps_every_invariant_lease_and_token(name, seed, crops, traffic):
    preset = build_vlm(name)
    rng = np.random.default_rng(seed)
    engine = Engine(preset.model, None, EngineConfig(
        page_size=P, num_pages=int(rng.integers(8, 14)), max_num_seqs=int(rng.integers(2, 5)),
        max_tokens_per_step=4 * P, prefill_chunk_tokens=2 * P, store_at=("prefill", "teardown")[rng.integers(2)]))
    vlm = VLMEngine(engine, preset.prompt_builder(EncoderOutputStore(int(rng.integers(1, 4)) * 20_000)))
    t = traffic(engine)
    requests = {}

    for n in range(80):
        op = rng.random()
        if op < 0.35:
            request = draw_request(rng, n, crops)
            requests[request.request_id] = request
            vlm.add_request(request)
        elif op < 0.41 and engine._live:
            assert vlm.abort(sorted(engine._live)[rng.integers(len(engine._live))])
        elif op < 0.44:
            t.fail_next_forward()
        elif op < 0.46:
            engine.clear_cache()
        else:
            t.take(vlm.step())
        vlm.check_invariants()
    while vlm.has_unfinished():
        t.take(vlm.step())
        vlm.check_invariants()
    t.take(vlm.step())

    ends = check_outcome(vlm, preset, t, requests)
    # The mix reached the hard paths, not only the easy one.
    m = vlm.metrics()
    assert {"length", "abort", "ForwardError", "MediaDecodeError"} <= ends, ends
    assert m["engine"]["preemptions"] > 0 and m["main"]["hit_pages"] > 0 and m["encoder"]["hits"] > 0
    assert m["encoder"]["evictions"] + m["encoder"]["bypasses"] > 0


def test_requests_added_and_aborted_from_another_thread_while_this_one_steps(crops, traffic):
    preset = build_vlm("tiny-llava")
    rng = np.random.default_rng(104)
    engine = Engine(preset.model, None, EngineConfig(page_size=P, num_pages=12, max_num_seqs=3,
                                                     max_tokens_per_step=4 * P, prefill_chunk_tokens=2 * P))
    vlm = VLMEngine(engine, preset.prompt_builder(EncoderOutputStore(40_000)))
    t = traffic(engine)
    drawn = [draw_request(rng, n, crops) for n in range(24)]
    drawn[7].messages[1]["content"][0]["image"] = b"\x89PNG but not one"  # one build failure at least
    for request in drawn[::2]:
        request.request_id = None  # named by the front end, from either thread
    requests, failures = {}, []

    def adder():
        try:
            for n, request in enumerate(drawn):
                requests[vlm.add_request(request)] = request
                if n % 5 == 4:
                    vlm.abort(sorted(requests)[n % len(requests)])
        except BaseException as err:  # reported by the test, not lost with the thread
            failures.append(err)

    thread = threading.Thread(target=adder)
    thread.start()
    give_up = time.monotonic() + 300  # a deadlock fails the test instead of hanging it (not a speed check)
    while (thread.is_alive() or vlm.has_unfinished()) and time.monotonic() < give_up:
        t.take(vlm.step())
    thread.join(timeout=60)
    assert not thread.is_alive() and not vlm.has_unfinished(), "the adding thread or the engine is stuck"
    t.take(vlm.step())
    assert not failures, failures
    assert len(requests) == len(drawn), "two requests got the same id"
    vlm.check_invariants()
    ends = check_outcome(vlm, preset, t, requests)
    assert "length" in ends and "MediaDecodeError" in ends, ends


def check_outcome(vlm: VLMEngine, preset, t, requests: dict) -> set:
    """Every request ended once, the pools are whole, no store entry is held, and every token is the one the
    request produces alone; returns the set of ways requests ended."""
    engine = vlm.engine
    finished, tokens = t.finished, t.tokens
    assert set(finished) == set(requests)
    assert vlm.metrics()["encoder"]["requests_holding"] == 0
    for label, m in engine.managers.items():
        assert m.num_requests == 0, label
        np.testing.assert_array_equal(m.pool.refcount, m.index.in_index.astype(np.int32))

    # Every token is the one the request produces alone.
    reference = VLMEngine(Engine(preset.model, None, EngineConfig(page_size=P, num_pages=512,
                                                                  prefill_chunk_tokens=2 * P)),
                          preset.prompt_builder(EncoderOutputStore(1 << 30)))
    ends = set()
    for rid, out in finished.items():
        ends.add(out.finish_reason if out.error is None else type(out.error).__name__)
        assert out.output_ids == tokens.get(rid, []), rid  # the streamed tokens are the output
        if isinstance(out.error, MediaDecodeError):
            assert out.output_ids == [], rid
            continue
        request = requests[rid]
        want = reference.generate([VLMRequest(request.messages, sampling=request.sampling, salt=request.salt)])[0]
        if out.finish_reason == "length":
            assert out.output_ids == want.output_ids, rid
        else:
            assert out.output_ids == want.output_ids[:len(out.output_ids)], rid
            assert out.finish_reason == "abort" or isinstance(out.error, (ForwardError, AllocationFailed)), out
    return ends
