"""Store leases and pages of VLM requests over their whole life in the engine (mmcache/hosts/vlm.py).

After every step ``VLMEngine.check_invariants`` holds: the engine's page owner counts, the store's budget, and
exact hold counts (each store entry is held exactly as many times as live requests hold it, so an entry held
by a running request cannot have been evicted and nothing leaks). Once nothing runs, every page is free or
owned by the prefix index alone and no entry is held.

* Budget under churn: the store never exceeds its bytes, held entries stay, a full pinned store and an
  oversize entry bypass, and every request still gets the output it gets with an ample store.
* Different salts share neither pages nor store entries.
* Corrupt image bytes fail that request with ``MediaDecodeError``; the other requests of the batch complete
  with the outputs they have alone.
* Abort, an abandoned stream, a failed forward, refusal at intake, a duplicate id, and preemption (which keeps
  the leases) release each request's leases once.
* The engine takes a front end's earlier arrival time (so TTFT counts image encoding), refuses one in the
  future, and ``add_request`` reports a refusal through ``step``.
* Multimodal input that page names cannot tell apart (embeds with no media item at their start, 3-D positions
  that differ from a text request's where no media digest is in the names) is refused at intake, holding
  nothing; a false hit (another request's KV under the same names) would be a wrong answer with no error.
  What ``VLMEngine`` builds (images, text only, on LLaVA and Qwen2-VL, preempted and re-admitted) is accepted.
* ``add_request`` from another thread: a build failure reported while a step runs reaches a step, and two
  requests built at once never get the same automatic id (interleavings forced deterministically).
"""

import threading
import time

import numpy as np
import pytest
import torch

from mmcache.engine import Engine, EngineConfig, ForwardError, MultimodalInput, Request, SamplingParams
from mmcache.hosts.vlm import VLMEngine, VLMRequest
from mmcache.presets.vlm import build_vlm
from mmcache.errors import DuplicateRequest, InvalidRequest, MediaDecodeError
from mmcache.names import MediaItem, media_digest
from mmcache.store import EncoderOutputStore

P = 16
ENTRY = 16 * 64 * 4  # tiny-llava: 16 placeholders x 64 hidden x float32
SYSTEM = "A chat between a curious human and an artificial intelligence assistant about a photo."


def greedy(n=8) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest


@pytest.fixture(scope="module")
def llava():
    return build_vlm("tiny-llava")


@pytest.fixture(scope="module")
def qwen():
    return build_vlm("tiny-qwen2-vl")


@pytest.fixture(scope="module")
def crops(photo_crops) -> list[bytes]:
    """Eight distinct real images: two crops of each of the four photos, as PNG."""
    return photo_crops(("coffee.png", "chelsea.png", "astronaut.png", "extreme_ironing.jpg"))


def front(preset, store_bytes=1 << 24, **config) -> VLMEngine:
    config.setdefault("num_pages", 256)
    engine = Engine(preset.model, None, EngineConfig(page_size=P, **config))
    return VLMEngine(engine, preset.prompt_builder(EncoderOutputStore(store_bytes)))


def ask(image, question="What is in this image?", n=8, rid=None, salt=b"", system=SYSTEM) -> VLMRequest:
    content = [{"type": "image", "image": image}, {"type": "text", "text": question}]
    messages = [{"role": "system", "content": system}, {"role": "user", "content": content}]
    return VLMRequest(messages, sampling=greedy(n), request_id=rid, salt=salt)


def drive(vlm: VLMEngine, waves, steps_per_wave=2) -> dict:
    """Add each wave, run a few steps, then run to completion; invariants after every step. Outputs by id."""
    outs = {}

    def step():
        for ev in vlm.step():
            if ev.finished:
                outs[ev.request_id] = ev.output
        vlm.check_invariants()

    for wave in waves:
        for request in wave:
            vlm.add_request(request)
        vlm.check_invariants()
        for _ in range(steps_per_wave):
            step()
    while vlm.has_unfinished():
        step()
    return outs


def assert_whole(vlm: VLMEngine, keys=()):
    vlm.check_invariants()
    assert not vlm.has_unfinished() and vlm.metrics()["encoder"]["requests_holding"] == 0
    for m in vlm.engine.managers.values():
        assert m.num_requests == 0
        np.testing.assert_array_equal(m.pool.refcount, m.index.in_index.astype(np.int32))
    assert all(vlm.store.held(k) == 0 for k in keys)


def test_store_budget_under_churn_keeps_held_entries_and_outputs(llava, crops):
    budget = 3 * ENTRY
    order = [[0, 1, 2, 3], [0, 4, 5, 1], [6, 7, 6, 0], [2, 3, 4, 5], [1, 7, 0, 2]]
    waves = lambda: [[ask(crops[i], rid=f"{w}-{j}") for j, i in enumerate(wave)] for w, wave in enumerate(order)]
    small = front(llava, store_bytes=budget, max_num_seqs=3)
    ample = front(llava, max_num_seqs=3)
    got, want = drive(small, waves(), 10), drive(ample, waves(), 10)
    assert {k: o.output_ids for k, o in got.items()} == {k: o.output_ids for k, o in want.items()}
    assert all(o.finish_reason == "length" for o in got.values()) and len(got) == 20
    m = small.store.metrics
    assert m.peak_bytes <= budget and m.bytes <= budget
    assert m.evictions > 0 and m.hits > 0
    assert m.bypasses > 0  # wave 0: four new images, three entries fit, all held: the fourth bypassed
    assert ample.store.metrics.computes == 8 and ample.store.metrics.bypasses == 0
    assert_whole(small, [small.builder.adapter.key(c) for c in crops])


def test_the_keys_kept_for_the_hold_check_stay_bounded_by_the_store(llava):
    # One key per distinct image ever served was kept for check_invariants, growing without bound while the
    # store stayed within its budget.
    import io

    from PIL import Image

    def png(i):
        buf = io.BytesIO()
        Image.new("RGB", (8, 8), (i % 256, i // 256, 7)).save(buf, format="PNG")
        return buf.getvalue()

    vlm = front(llava, store_bytes=3 * ENTRY)
    for wave in range(12):
        outs = vlm.generate([ask(png(8 * wave + i), n=1) for i in range(8)])
        assert all(o.finish_reason == "length" for o in outs)
        assert len(vlm._keys_seen) <= 2 * len(vlm.store) + 64 + 8
    assert vlm.store.metrics.computes == 96
    assert_whole(vlm)


def test_oversize_entries_bypass_and_requests_complete(llava, crops, tower_calls):
    requests = lambda: [ask(crops[i], rid=i) for i in (0, 1, 0)]
    ample = front(llava)
    want = [ample.generate([r])[0] for r in requests()]
    tiny = front(llava, store_bytes=ENTRY - 1)
    calls = tower_calls(tiny)
    got = [tiny.generate([r])[0] for r in requests()]
    assert [o.output_ids for o in got] == [o.output_ids for o in want]
    assert len(tiny.store) == 0 and tiny.store.metrics.bypasses == 3 and len(calls) == 3
    assert got[2].matched_tokens > 0  # pages still hit: the digest names them whether or not the store kept it
    assert_whole(tiny)


def test_different_salts_share_neither_pages_nor_store_entries(llava, crops, tower_calls):
    vlm = front(llava)
    calls = tower_calls(vlm)
    a1, b, a2, plain = (vlm.generate([ask(crops[0], salt=s)])[0] for s in ("tenant-a", "tenant-b", "tenant-a", b""))
    assert (a1.matched_tokens, b.matched_tokens, plain.matched_tokens) == (0, 0, 0)
    assert a2.matched_tokens == (a2.prompt_len - 1) // P * P
    assert len(calls) == 3 and len(vlm.store) == 3
    keys = {vlm.builder.adapter.key(crops[0], salt) for salt in ("tenant-a", "tenant-b", b"")}
    assert len(keys) == 3 and all(k in vlm.store for k in keys)
    assert a1.output_ids == b.output_ids == a2.output_ids == plain.output_ids
    assert_whole(vlm, keys)


def test_corrupt_image_fails_its_request_only_and_leaks_nothing(llava, crops):
    vlm = front(llava, max_num_seqs=4)
    truncated = crops[1][: len(crops[1]) // 2]
    two = ask(crops[2], rid="two")
    two.messages[1]["content"].insert(1, {"type": "image", "image": truncated})  # a good image, then a bad one
    batch = [ask(crops[0], rid="a"), two, ask(b"\x89PNG\r\n\x1a\nnot really", rid="garbage"), ask(crops[3], rid="d")]
    outs = {o.request_id: o for o in vlm.generate(batch)}
    for rid in ("two", "garbage"):
        assert outs[rid].finish_reason == "error" and isinstance(outs[rid].error, MediaDecodeError)
        assert outs[rid].output_ids == [] and outs[rid].first_token_time is None
    assert outs["two"].error.item.index == 1  # the second image of that request
    alone = front(llava)
    for rid, image in (("a", crops[0]), ("d", crops[3])):
        assert outs[rid].finish_reason == "length"
        assert outs[rid].output_ids == alone.generate([ask(image)])[0].output_ids
    assert_whole(vlm, [vlm.builder.adapter.key(c) for c in crops[:4]])
    assert vlm.builder.adapter.key(crops[2]) in vlm.store  # computed before the failure, kept unheld


def test_text_or_a_path_that_is_not_valid_unicode_fails_its_request_only(llava, crops, tmp_path):
    # Both used to escape generate as the tokenizer's TypeError or the file system's UnicodeEncodeError.
    vlm = front(llava)
    outs = vlm.generate([ask(crops[0], question="What \ud800 is this?", rid="text"),
                         ask(str(tmp_path / "\ud800.png"), rid="path"), ask(str(tmp_path / "a\x00b.png"), rid="nul"),
                         ask(crops[0], rid="good")])
    assert isinstance(outs[0].error, InvalidRequest) and "surrogate" in str(outs[0].error)
    assert all(isinstance(o.error, MediaDecodeError) for o in outs[1:3]), outs
    assert outs[3].finish_reason == "length"
    assert_whole(vlm)


def test_a_tower_forward_that_raises_fails_its_request_only(llava, crops, monkeypatch):
    vlm = front(llava)
    adapter = vlm.builder.adapter
    real = adapter._features
    calls = []

    def second_fails(batch):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected tower failure")
        return real(batch)

    monkeypatch.setattr(adapter, "_features", second_fails)
    outs = vlm.generate([ask(crops[0], rid="a"), ask(crops[1], rid="b"), ask(crops[2], rid="c")])
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert isinstance(outs[1].error, ForwardError) and isinstance(outs[1].error.__cause__, RuntimeError)
    # no frames kept (they held the engine and the request's images); the cause's traceback is kept as text
    assert outs[1].error.__traceback__ is None and outs[1].error.__cause__.__traceback__ is None
    assert "injected tower failure" in outs[1].error.cause_traceback
    assert adapter.key(crops[1]) not in vlm.store and len(vlm.store) == 2
    assert_whole(vlm)


def test_images_that_are_not_a_list_are_refused(llava, crops):
    # One bytes object read as a list of 200,000 images, a path as a list of characters; None raised TypeError.
    vlm = front(llava)
    image = vlm.builder.template.image_token_id
    for images in (crops[0], "a/path.png", None, 5):
        out = vlm.generate([VLMRequest(token_ids=[1, image, 2], images=images, sampling=greedy(2))])[0]
        assert isinstance(out.error, InvalidRequest) and "must be a list" in str(out.error), out
    assert_whole(vlm)


def test_an_image_the_models_processor_refuses_fails_its_request_only(crops):
    # Qwen2-VL's processor refuses an aspect ratio over 200 with a ValueError, which used to escape from
    # generate and lose the whole call.
    import io

    from PIL import Image

    from encoders.media import ImageLimits

    qwen = build_vlm("tiny-qwen2-vl")
    vlm = VLMEngine(Engine(qwen.model, None, EngineConfig(page_size=P, num_pages=256)),
                    qwen.prompt_builder(EncoderOutputStore(1 << 24), ImageLimits(max_aspect_ratio=10_000)))
    sliver = io.BytesIO()
    Image.new("RGB", (3000, 2), (10, 200, 30)).save(sliver, "PNG")
    outs = vlm.generate([ask(crops[0], rid="good"), ask(sliver.getvalue(), rid="sliver"), ask(crops[1], rid="too")])
    assert [o.request_id for o in outs] == ["good", "sliver", "too"]
    assert outs[0].finish_reason == outs[2].finish_reason == "length"
    assert isinstance(outs[1].error, MediaDecodeError) and "aspect ratio" in str(outs[1].error)
    assert len(vlm.store) == 2  # nothing stored for the refused image
    assert_whole(vlm)
    # under the default limits the same image is refused from its header, before the processor sees it
    outs = front(qwen).generate([ask(sliver.getvalue(), rid="sliver")])
    assert isinstance(outs[0].error, MediaDecodeError) and "max_aspect_ratio" in str(outs[0].error)


def test_abort_abandoned_stream_forward_error_and_refusals_release_leases_once(llava, crops):
    vlm = front(llava, max_num_seqs=2)
    keys = [vlm.builder.adapter.key(c) for c in crops[:3]]
    # Abort one running and one waiting request; the third, sharing an image with the first, finishes.
    for request in (ask(crops[0], n=12, rid="a"), ask(crops[1], n=12, rid="b"), ask(crops[0], n=12, rid="c")):
        vlm.add_request(request)
    assert vlm.store.held(keys[0]) == 2 and vlm.store.held(keys[1]) == 1
    finished = {}
    for _ in range(3):
        finished.update({e.request_id: e.output for e in vlm.step() if e.finished})
        vlm.check_invariants()
    assert vlm.abort("b") and vlm.abort("c")
    vlm.check_invariants()
    assert vlm.store.held(keys[1]) == 0 and vlm.store.held(keys[0]) == 1
    while vlm.has_unfinished():
        finished.update({e.request_id: e.output for e in vlm.step() if e.finished})
    assert [finished[r].finish_reason for r in "abc"] == ["length", "abort", "abort"]
    assert_whole(vlm, keys)

    # A stream abandoned mid-way, and one closed before the engine took its requests.
    stream = vlm.stream([ask(crops[0], n=12), ask(crops[2], n=12)])
    assert next(stream).token_id is not None
    vlm.check_invariants()
    assert vlm.store.held(keys[0]) == 1 and vlm.store.held(keys[2]) == 1
    stream.close()
    assert_whole(vlm, keys)
    stream = vlm.stream([ask(b"not an image"), ask(crops[0]), ask(crops[1])])
    first = next(stream)
    assert isinstance(first.output.error, MediaDecodeError) and vlm.store.held(keys[0]) == 1
    stream.close()
    assert_whole(vlm, keys)

    # A forward that raises fails its requests; their leases return; the engine goes on.
    run = vlm.engine.runner.run

    def broken(works):
        raise RuntimeError("injected")

    vlm.engine.runner.run = broken
    failed = vlm.generate([ask(crops[1]), ask(crops[2])])
    assert all(isinstance(o.error, ForwardError) for o in failed)
    assert_whole(vlm, keys)
    vlm.engine.runner.run = run

    # Refused at intake (bad sampling, duplicate id): built, then released by the engine.
    refused = vlm.generate([VLMRequest(ask(crops[0]).messages, sampling=SamplingParams(max_tokens=0)),
                            ask(crops[1], rid="dup"), ask(crops[2], rid="dup")])
    assert isinstance(refused[0].error, InvalidRequest) and isinstance(refused[2].error, DuplicateRequest)
    assert refused[1].finish_reason == "length"
    assert_whole(vlm, keys)


def test_preempted_requests_keep_their_leases_and_recompute_exactly(llava, crops):
    # Prompts of 6 pages growing by 3: three at once need 27 pages; 18 force preemption. Pages are stored at
    # teardown so requests 0 and 2 (the same image) cannot share their prompt pages while both run.
    vlm = front(llava, num_pages=18, max_num_seqs=3, store_at="teardown")
    images = {0: crops[0], 1: crops[1], 2: crops[0]}
    keys = {rid: vlm.builder.adapter.key(image) for rid, image in images.items()}
    for rid, image in images.items():
        vlm.add_request(ask(image, n=40, rid=rid))
    outs, waited_preempted = {}, 0
    while vlm.has_unfinished():
        outs.update({e.request_id: e.output for e in vlm.step() if e.finished})
        vlm.check_invariants()
        waited_preempted += sum(1 for live in vlm.engine.scheduler.waiting if live.setbacks.preemptions)
        live = [rid for rid in images if rid not in outs]
        for key in set(keys.values()):  # held by every request not finished, running or preempted
            assert vlm.store.held(key) == sum(keys[rid] == key for rid in live)
    assert vlm.engine.scheduler.preemptions > 0 and waited_preempted > 0
    assert sum(o.preemptions for o in outs.values()) == vlm.engine.scheduler.preemptions
    alone = front(llava)
    for rid, image in images.items():
        assert outs[rid].finish_reason == "length"
        assert outs[rid].output_ids == alone.generate([ask(image, n=40)])[0].output_ids
    assert_whole(vlm, set(keys.values()))


def test_engine_takes_a_front_ends_arrival_time_and_reports_refusals_from_step(llava):
    eng = Engine(llava.model, None, EngineConfig(page_size=P, num_pages=64))
    assert eng.add_request(Request([5, 6, 7], SamplingParams(max_tokens=0), request_id="bad")) == "bad"
    late = Request([5, 6, 7], greedy(), request_id="late", arrival_time=time.perf_counter() + 60)
    assert eng.add_request(late) == "late"
    errors = {e.request_id: e.output.error for e in eng.step() if e.finished}
    assert set(errors) == {"bad", "late"} and all(isinstance(e, InvalidRequest) for e in errors.values())
    assert "arrival_time" in str(errors["late"])
    earlier = time.perf_counter() - 1.0
    out = eng.generate([Request([5, 6, 7], greedy(2), arrival_time=earlier)])[0]
    assert out.arrival_time == earlier and out.ttft > 1.0


# ---- multimodal input the page names cannot tell apart ------------------------------------------------
def exact_engine(preset) -> Engine:
    return Engine(preset.model, None, EngineConfig(page_size=4, num_pages=64, schedule="serial",
                                                   prefill_chunk_tokens=4))


def assert_pools_whole(eng: Engine):
    eng.check_invariants()
    for m in eng.managers.values():
        assert m.num_requests == 0
        np.testing.assert_array_equal(m.pool.refcount, m.index.in_index.astype(np.int32))


def test_embeds_need_a_media_item_of_their_own_at_their_start(llava):
    # Names hash ids and media only: embeds no media item names would let a request with other rows (or
    # none) be seeded with this one's KV.
    eng = exact_engine(llava)
    hidden = eng.adapter.hidden_size
    rows_a, rows_b = torch.randn(2, 4, hidden, generator=torch.Generator().manual_seed(0))
    da, db = media_digest(b"image a"), media_digest(b"image b")
    ids = list(range(5, 17))  # three pages
    sp = greedy(6)
    unnamed = [MultimodalInput(embeds=[(0, rows_a)]),  # no media item at all
               MultimodalInput(media=[MediaItem(da, 4)], embeds=[(0, rows_a)]),  # the item after the span's start
               MultimodalInput(media=[MediaItem(da, 0)], embeds=[(0, rows_a), (0, rows_b)]),  # one item, two spans
               MultimodalInput(media=[MediaItem(da, 0)], embeds=[(0, rows_a), (8, rows_b)])]  # the second unnamed
    released = []
    for mm in unnamed:
        mm.release = lambda: released.append(1)
    outs = eng.generate([Request(ids, sp, f"bad{i}", mm=mm) for i, mm in enumerate(unnamed)])
    assert all(o.finish_reason == "error" and isinstance(o.error, InvalidRequest) for o in outs), outs
    assert all(o.output_ids == [] for o in outs) and released == [1] * len(unnamed)
    assert_pools_whole(eng)

    # Named spans: equal ids with other rows under another digest share no page holding them.
    def named(digest, rows, rid):
        return Request(ids, sp, rid, mm=MultimodalInput(media=[MediaItem(digest, 4)], embeds=[(4, rows)]))

    first, other = eng.generate([named(da, rows_a, "a")])[0], eng.generate([named(db, rows_b, "b")])[0]
    assert other.matched_tokens == 4  # page 0 only: it precedes the item
    assert first.output_ids == exact_engine(llava).generate([named(da, rows_a, "a")])[0].output_ids
    assert other.output_ids == exact_engine(llava).generate([named(db, rows_b, "b")])[0].output_ids
    again = eng.generate([named(da, rows_a, "a2")])[0]
    assert again.output_ids == first.output_ids and again.matched_tokens == 8  # capped: one prompt token left
    assert_pools_whole(eng)


def test_3d_positions_must_be_a_text_requests_where_no_media_item_names_them(qwen):
    # Positions are not hashed: before the first media item (or everywhere, with none) they must be the plain
    # ones a text request with the same ids has.
    eng = exact_engine(qwen)
    ids = list(range(5, 17))
    sp = greedy(6)
    plain = torch.arange(12).repeat(3, 1)
    d = media_digest(b"image")
    grid = plain.clone()
    grid[1, 4:8] = 4 + torch.arange(4) // 2  # a 2x2 image at 4..7
    grid[2, 4:8] = 4 + torch.arange(4) % 2
    grid[:, 8:] -= 2
    bad = [MultimodalInput(mrope_positions=plain * 7, mrope_delta=72),  # spread positions, no media item
           MultimodalInput(mrope_positions=plain, mrope_delta=3),  # plain prompt, shifted generated tokens
           MultimodalInput(media=[MediaItem(d, 8)], mrope_positions=grid, mrope_delta=-2)]  # grid before the item
    outs = eng.generate([Request(ids, sp, f"bad{i}", mm=mm) for i, mm in enumerate(bad)])
    assert all(o.finish_reason == "error" and isinstance(o.error, InvalidRequest) for o in outs), outs
    assert_pools_whole(eng)
    text = eng.generate([Request(ids, sp, "text")])[0]
    assert text.matched_tokens == 0
    assert text.output_ids == exact_engine(qwen).generate([Request(ids, sp, "text")])[0].output_ids

    # Accepted: plain positions without media (what VLMEngine builds for a text-only Qwen2-VL chat) share the
    # text request's pages; an image's positions from its item on are named by its digest.
    spelled = eng.generate([Request(ids, sp, "spelled", mm=MultimodalInput(mrope_positions=plain))])[0]
    assert spelled.output_ids == text.output_ids and spelled.matched_tokens == 8
    image = Request(ids, sp, "image", mm=MultimodalInput(media=[MediaItem(d, 4)], mrope_positions=grid,
                                                         mrope_delta=-2))
    got = eng.generate([image])[0]
    assert got.finish_reason == "length" and got.matched_tokens == 4  # page 0 precedes the item
    assert got.output_ids == exact_engine(qwen).generate([image])[0].output_ids != text.output_ids
    assert_pools_whole(eng)


def test_qwen2_vl_prompts_with_and_without_images_pass_intake_and_recompute_exactly_after_preemption(qwen, crops):
    # VLMEngine's prompts meet the intake rule, including after re-admission: a preempted request is renamed
    # over prompt + generated ids, whose positions past the prompt are p + mrope_delta (0 without an image).
    vlm = front(qwen, num_pages=18, max_num_seqs=3, store_at="teardown")
    requests = {0: ask(crops[0], n=40, rid=0), 1: ask(crops[1], n=40, rid=1),
                2: VLMRequest([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello there."}],
                              sampling=greedy(40), request_id=2)}
    outs = drive(vlm, [list(requests.values())])
    assert vlm.engine.scheduler.preemptions > 0
    alone = front(qwen)
    for rid, request in requests.items():
        assert outs[rid].finish_reason == "length", outs[rid]
        request.request_id = None
        assert outs[rid].output_ids == alone.generate([request])[0].output_ids
    assert_whole(vlm)


# ---- another thread ------------------------------------------------------------------------------
class _StepBeforeAppend(list):
    """The front end's list of build failures: the first append runs a whole ``step`` on another thread first
    (waiting briefly for it), the interleaving in which the adding thread had read the list before the
    stepping thread swapped it out. The step's events are kept in ``stepped``."""

    def __init__(self, vlm):
        super().__init__()
        self.vlm, self.thread, self.stepped = vlm, None, []

    def append(self, event):
        if self.thread is None:
            self.thread = threading.Thread(target=lambda: self.stepped.extend(self.vlm.step()))
            self.thread.start()
            self.thread.join(timeout=0.2)  # done at once unless the front end's lock holds the step back
        super().append(event)


def test_a_build_failure_added_from_another_thread_during_a_step_reaches_a_step(llava, crops):
    vlm = front(llava)
    vlm.add_request(ask(crops[0], n=4, rid="ok"))
    racing = vlm._events = _StepBeforeAppend(vlm)
    assert vlm.add_request(VLMRequest(request_id="bad")) == "bad"  # neither messages nor token ids
    racing.thread.join()
    events = list(racing.stepped)
    while vlm.has_unfinished():
        events += vlm.step()
    ended = {e.request_id: e.output for e in events if e.finished}
    assert set(ended) == {"ok", "bad"}, "the build failure was appended to a list a step had already taken"
    assert isinstance(ended["bad"].error, InvalidRequest) and ended["ok"].finish_reason == "length"
    assert_whole(vlm)


class _AddsWhileFormatted(int):
    """The front end's next automatic id: formatting it (reading it for an id) first adds another request
    from another thread (waiting briefly for it), the interleaving of two threads building at once."""

    def __new__(cls, value, vlm, request):
        self = super().__new__(cls, value)
        self.vlm, self.request, self.thread, self.ids = vlm, request, None, []
        return self

    def __format__(self, spec):
        if self.thread is None:
            self.thread = threading.Thread(target=lambda: self.ids.append(self.vlm.add_request(self.request)))
            self.thread.start()
            self.thread.join(timeout=0.2)  # done at once unless the front end's lock holds it back
        return super().__format__(spec)


def test_two_requests_built_at_once_get_different_automatic_ids(llava, crops):
    vlm = front(llava)
    racing = vlm._next_id = _AddsWhileFormatted(0, vlm, ask(crops[1], n=4))
    first = vlm.add_request(ask(crops[0], n=4))
    racing.thread.join()
    ids = [first, *racing.ids]
    assert len(set(ids)) == 2, f"both requests were named {ids[0]}"
    ended = {}
    while vlm.has_unfinished():
        ended.update((e.request_id, e.output) for e in vlm.step() if e.finished)
    assert set(ended) == set(ids) and all(o.finish_reason == "length" for o in ended.values())
    assert_whole(vlm)


def test_automatic_ids_skip_an_id_a_caller_chose(llava, crops):
    vlm = front(llava)
    assert vlm.add_request(ask(crops[0], n=4, rid="vlm-0")) == "vlm-0"
    out = vlm.generate([ask(crops[1], n=4)])[0]  # no id given: it was "vlm-0" too, refused as a duplicate
    assert out.error is None and out.request_id == "vlm-1"
    while vlm.has_unfinished():
        vlm.step()
    assert_whole(vlm)


def test_a_stream_collected_inside_a_step_keeps_its_leases_until_its_request_ends(llava, crops):
    # The engine defers the abort of a stream the garbage collector closes inside a forward to the step's end;
    # the VLM stream's own cleanup must leave the leases to the engine until then.
    vlm = front(llava)
    key = vlm.builder.adapter.key(crops[3])
    stream = vlm.stream([ask(crops[3], n=12)])
    assert next(stream).token_id is not None
    held_inside = []

    def hook(module, args):
        nonlocal stream
        if stream is not None:
            stream.close()  # what the collector does to an unreachable stream, here on the step's thread
            stream = None
            held_inside.append(vlm.store.held(key))

    handle = llava.model.register_forward_pre_hook(hook)
    try:
        vlm.generate([ask(crops[4], n=2)])
    finally:
        handle.remove()
    assert held_inside == [1]  # still held inside the step that aborts it
    assert_whole(vlm, [key])


def _in_thread(fn, timeout=30) -> bool:
    """Whether ``fn`` returned within ``timeout`` seconds on a daemon thread (a deadlock leaves it behind)."""
    worker = threading.Thread(target=fn, daemon=True)
    worker.start()
    worker.join(timeout)
    return not worker.is_alive()


def test_a_stream_finalised_under_the_store_lock_neither_deadlocks_nor_waits_for_another_threads_step(
        llava, crops):
    # The garbage collector may finalise an abandoned stream inside any allocation, such as one the store makes
    # under its lock: the stream's abort then released its leases through that same lock, on that thread (a
    # deadlock, found 38 times in 119 add_request calls by a fuzz). Closing the stream under the lock is that
    # moment, made deterministic.
    vlm = front(llava)
    keys = [vlm.builder.adapter.key(c) for c in crops[:2]]
    stream = vlm.stream([ask(crops[0], n=12, rid="abandoned")])
    assert next(stream).token_id is not None and vlm.store.held(keys[0]) == 1

    def close_under_the_store_lock():
        with vlm.store._lock:
            stream.close()

    assert _in_thread(close_under_the_store_lock), "closing the stream under the store's lock deadlocked"
    assert_whole(vlm, keys)

    # Across threads: one holds the engine's lock (a step), the finaliser runs on another that holds the store's
    # lock (which the step would take to release a lease). The finaliser must not wait: its abort is queued
    # and applied when that step ends.
    stream = vlm.stream([ask(crops[1], n=12, rid="abandoned-2")])
    assert next(stream).token_id is not None and vlm.store.held(keys[1]) == 1
    stepping, done = threading.Event(), threading.Event()

    def step_holding_the_engine_lock():
        with vlm.engine._change():
            stepping.set()
            done.wait(120)

    holder = threading.Thread(target=step_holding_the_engine_lock, daemon=True)
    holder.start()
    stepping.wait(60)
    assert _in_thread(close_under_the_store_lock), "the finaliser waited for another thread's step"
    assert list(vlm.engine._inbox) and vlm.store.held(keys[1]) == 1  # queued, not yet applied
    done.set()
    holder.join(60)
    assert not vlm.engine.is_live("abandoned-2")  # applied when that change ended
    assert_whole(vlm, keys)


def test_build_failures_queued_for_a_step_that_raises_reach_the_next_one(llava, crops):
    vlm = front(llava)
    vlm.add_request(ask(crops[0], n=4, rid="good"))
    vlm.add_request(ask(b"not an image", rid="corrupt"))  # its failure waits for the next step
    step = vlm.engine.step

    def raising_once():
        vlm.engine.step = step
        raise RuntimeError("injected")

    vlm.engine.step = raising_once
    with pytest.raises(RuntimeError, match="injected"):
        vlm.step()
    ended = {}
    while vlm.has_unfinished():
        ended.update({e.request_id: e.output for e in vlm.step() if e.finished})
    assert isinstance(ended["corrupt"].error, MediaDecodeError) and ended["good"].finish_reason == "length"
    assert_whole(vlm, [vlm.builder.adapter.key(crops[0])])
