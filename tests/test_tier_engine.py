"""The second tier under the reference engine (tiny preset, CPU).

* A page evicted to host memory or to disk and hit again gives logits equal bit for bit to recomputing it
  under the same (exact) schedule, and the hit really came from that tier.
* Eviction that a shortfall causes (a pool too small for two prompts) moves pages down; the next request with
  the first prompt reads them back in.
* A request aborted after its read-in holds nothing; a damaged disk file is refused, counted, and the request
  computes what it could not read.
* ``EngineConfig`` refuses bad tier settings; no tier is made unless asked for.
"""

from concurrent.futures import Future

import numpy as np
import pytest
import torch

from mmcache.engine import Engine, EngineConfig, EngineConfigError, Request, SamplingParams
from mmcache.engine.inspect import record_logits
from mmcache.presets.text import build_model

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest


@pytest.fixture(scope="module")
def tiny():
    return build_model("tiny", "float32")


def prompts(seed=0):
    rng = np.random.default_rng(seed)
    prefix = rng.integers(2, 512, size=70).tolist()
    return [prefix + rng.integers(2, 512, size=n).tolist() for n in (5, 11)]


@pytest.mark.parametrize("where", ["host", "disk"])
def test_a_tier_hit_gives_the_logits_of_recomputing_it(tiny, tmp_path, where):
    model, tok = tiny
    first, second = prompts()
    runs = {}
    for mode in ("tier", "off"):
        if mode == "tier":
            tiers = dict(host_tier_bytes=1 << 20) if where == "host" else \
                dict(disk_tier_bytes=1 << 20, disk_tier_dir=str(tmp_path))
            eng = Engine(model, tok, EngineConfig.exact(page_size=16, num_pages=64, **tiers))
        else:
            eng = Engine(model, tok, EngineConfig.exact(page_size=16, num_pages=64, cache_mode="off"))
        rec = record_logits(eng)
        outs = [eng.generate([Request(first, GREEDY, request_id=0)])[0]]
        if mode == "tier":
            assert eng.clear_cache(demote=True) == 5  # 80 tokens written (75 + 5 generated): 5 pages go down
            assert eng.metrics()["main"]["cached_pages"] == 0
        outs.append(eng.generate([Request(second, GREEDY, request_id=1)])[0])
        eng.check_invariants()
        runs[mode] = (rec, outs, eng)
    (rec_t, out_t, eng_t), (rec_off, out_off, _) = runs["tier"], runs["off"]
    assert out_t[1].matched_tokens == 64 and out_off[1].matched_tokens == 0
    level = eng_t.metrics()["main"]["tiers"][where]
    assert level["hits"] == 4 and level["read_in_bytes"] == 4 * eng_t.page_bytes and level["pages"] == 1
    for rid in (0, 1):
        assert len(rec_t[rid]) == len(rec_off[rid]) == GREEDY.max_tokens
        assert all(torch.equal(a, b) for a, b in zip(rec_t[rid], rec_off[rid])), rid
        assert out_t[rid].output_ids == out_off[rid].output_ids


def test_a_shortfall_moves_pages_down_and_a_later_request_reads_them_in(tiny):
    model, tok = tiny
    a, _ = prompts(1)
    b, _ = prompts(2)
    # 8 pages of 16 tokens: b's 5 pages need room that only a's cached pages can give.
    eng = Engine(model, tok, EngineConfig(page_size=16, num_pages=8, host_tier_bytes=1 << 20))
    eng.generate([Request(a, GREEDY, request_id="a1")])
    eng.generate([Request(b, GREEDY, request_id="b")])
    m = eng.metrics()["main"]
    assert m["evicted_pages"] > 0 and m["tiers"]["host"]["stored_pages"] == m["evicted_pages"]
    again = eng.generate([Request(a, GREEDY, request_id="a2")])[0]
    assert again.matched_tokens == 64
    assert eng.metrics()["main"]["tiers"]["host"]["hits"] > 0
    eng.check_invariants()


def _gated_engine(model, tok, first, start_read_in=None):
    """An exact-schedule engine whose cache held ``first`` and moved its 5 pages down to the host tier; the
    scheduler's read-ins start through ``start_read_in`` where given."""
    eng = Engine(model, tok, EngineConfig.exact(page_size=16, num_pages=64, host_tier_bytes=1 << 20))
    eng.generate([Request(first, GREEDY, request_id=0)])
    eng.clear_cache(demote=True)
    if start_read_in is not None:
        eng.scheduler.start_read_in = start_read_in
    return eng


def _run_now(manager, rid):
    manager.read_pending(rid)
    done = Future()
    done.set_result(None)
    return done


@pytest.mark.parametrize("copied", [False, True])
def test_abort_during_read_in_holds_nothing(tiny, copied):
    """Aborted while its read-in is pending: before the copy started (cancelled: the pages go back to the tier)
    or after it ended (the pages read stay cached in the pool), the request holds no page."""
    model, tok = tiny
    first, second = prompts(3)
    eng = _gated_engine(model, tok, first, _run_now if copied else (lambda manager, rid: Future()))
    mgr = eng.managers["main"]
    eng.add_request(Request(second, GREEDY, request_id=1))
    forwards = eng.counters["forwards"]
    eng.step()  # admission: four pages reserved for the read-in, nothing computed (the gate)
    assert eng.counters["forwards"] == forwards
    assert mgr.tiers.level("host").taken == 4  # slots held until the read-in is completed or cancelled
    assert eng.abort(1)
    eng.check_invariants()
    assert mgr.num_requests == 0 and mgr.tiers.level("host").taken == 0
    held = mgr.pool.refcount > 0
    assert np.array_equal(held, mgr.index.in_index) and (mgr.pool.refcount[held] == 1).all()
    assert (mgr.index.size, len(mgr.tiers)) == ((4, 1) if copied else (0, 5))
    assert mgr.tiers.metrics()["host"]["hits"] == (4 if copied else 0)


def test_the_gate_lets_other_requests_run_while_a_read_in_waits(tiny):
    model, tok = tiny
    first, second = prompts(6)
    other = prompts(7)[0]
    cfg = dict(page_size=16, num_pages=64)
    eng = Engine(model, tok, EngineConfig(host_tier_bytes=1 << 20, **cfg))
    eng.generate([Request(first, GREEDY, request_id=0)])
    eng.clear_cache(demote=True)
    held = []  # the gated request's read-in, run by hand below
    eng.scheduler.start_read_in = lambda manager, rid: held.append((manager, rid, Future())) or held[-1][2]
    eng.add_request(Request(second, GREEDY, request_id="gated"))
    eng.add_request(Request(other, GREEDY, request_id="other"))
    events = []
    for _ in range(4):
        events += eng.step()
    assert [ev.request_id for ev in events] == ["other"] * 4  # it ran; the gated request waited
    manager, rid, future = held[0]
    manager.read_pending(rid)
    future.set_result(None)
    while eng.has_unfinished():
        events += eng.step()
    outs = {ev.request_id: ev.output for ev in events if ev.finished}
    assert outs["gated"].matched_tokens == 64 and eng.metrics()["main"]["tiers"]["host"]["hits"] == 4
    ref = Engine(model, tok, EngineConfig(cache_mode="off", **cfg))
    expected = ref.generate([Request(second, GREEDY), Request(other, GREEDY)])
    assert [outs["gated"].output_ids, outs["other"].output_ids] == [o.output_ids for o in expected]
    eng.check_invariants()


def test_a_damaged_disk_file_is_refused_and_the_request_computes(tiny, tmp_path):
    model, tok = tiny
    first, second = prompts(4)
    cfg = dict(page_size=16, num_pages=64, disk_tier_bytes=1 << 20, disk_tier_dir=str(tmp_path))
    eng = Engine(model, tok, EngineConfig.exact(**cfg))
    ref = Engine(model, tok, EngineConfig.exact(page_size=16, num_pages=64, cache_mode="off"))
    eng.generate([Request(first, GREEDY, request_id=0)])
    eng.clear_cache(demote=True)
    disk = eng.managers["main"].tiers.level("disk")
    with open(disk.path, "r+b") as f:  # zero the whole file: every page fails its checks
        f.write(bytes(disk.slot_bytes * len(disk.entries)))
    out = eng.generate([Request(second, GREEDY, request_id=1)])[0]
    assert out.matched_tokens == 0 and eng.metrics()["main"]["tiers"]["disk"]["corrupt_pages"] == 1
    assert out.output_ids == ref.generate([Request(second, GREEDY, request_id=1)])[0].output_ids
    eng.check_invariants()


def test_tier_settings(tiny, tmp_path):
    model, tok = tiny
    with pytest.raises(EngineConfigError):
        EngineConfig(disk_tier_bytes=1 << 20)  # no directory
    with pytest.raises(EngineConfigError):
        EngineConfig(host_tier_bytes=-1)
    assert Engine(model, tok, EngineConfig(num_pages=8)).managers["main"].tiers is None
    # Only mode on keeps a tier.
    off = Engine(model, tok, EngineConfig(num_pages=8, cache_mode="off", host_tier_bytes=1 << 20))
    assert getattr(off.managers["main"], "tiers", None) is None


def test_serve_options_and_metrics(tiny, tmp_path):
    from types import SimpleNamespace

    from mmcache.cli import build_parser
    from mmcache.server.cli import config_from_args
    from mmcache.server.config import ServerConfigError
    from mmcache.server.metrics import ServerMetrics

    args = build_parser().parse_args(["serve", "--preset", "tiny", "--host-tier-bytes", "1048576",
                                      "--disk-tier-bytes", "2097152", "--disk-tier-dir", str(tmp_path),
                                      "--preempt-tier-bytes", "65536"])
    config = config_from_args(args).engine_config
    assert (config.host_tier_bytes, config.disk_tier_bytes, config.disk_tier_dir) == (1 << 20, 2 << 20, str(tmp_path))
    assert config.preempt_tier_bytes == 1 << 16
    assert config_from_args(build_parser().parse_args(["serve", "--preset", "tiny"])).engine_config.host_tier_bytes == 0
    with pytest.raises(ServerConfigError):  # a disk tier without a directory
        config_from_args(build_parser().parse_args(["serve", "--preset", "tiny", "--disk-tier-bytes", "1"]))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--preset", "tiny", "--host-tier-bytes", "-1"])

    model, tok = tiny
    eng = Engine(model, tok, EngineConfig.exact(page_size=16, num_pages=64, host_tier_bytes=1 << 20))
    first, second = prompts(5)
    eng.generate([Request(first, GREEDY, request_id=0)])
    eng.clear_cache(demote=True)
    eng.generate([Request(second, GREEDY, request_id=1)])
    host = SimpleNamespace(engine=eng, core=eng, running=0, waiting=0)
    text = ServerMetrics(host, "tiny").render().decode()
    assert 'mmcache:kv_tier_hits_total{model_name="tiny",tier="host"} 4.0' in text
    assert f'mmcache:kv_tier_read_in_bytes_total{{model_name="tiny",tier="host"}} {4.0 * eng.page_bytes}' in text
    assert 'mmcache:kv_tier_pages{model_name="tiny",tier="host"} 1.0' in text
    assert "tier=\"disk\"" not in text
    untiered = Engine(model, tok, EngineConfig(num_pages=8))
    assert "kv_tier" not in ServerMetrics(SimpleNamespace(engine=untiered, core=untiered, running=0, waiting=0),
                                          "tiny").render().decode()


def test_a_preempted_request_gets_its_pages_back_from_the_tier(tiny):
    """Preemption tears a request down (its full pages go to the index); when the other request's growth evicts
    them, they move down, and the re-admission reads them back in instead of recomputing them."""
    model, tok = tiny
    rng = np.random.default_rng(7)
    two = [rng.integers(2, 512, size=60).tolist() for _ in range(2)]
    sampling = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    runs = {}
    for host, share in ((0, 0), (1 << 20, 0), (1 << 20, 1 << 20)):
        eng = Engine(model, tok, EngineConfig(page_size=16, num_pages=9, max_num_seqs=2, host_tier_bytes=host,
                                              preempt_tier_bytes=share))
        outs = eng.generate([Request(p, sampling, request_id=i) for i, p in enumerate(two)])
        eng.check_invariants()
        runs[host, share] = (eng.metrics(), [o.output_ids for o in outs])
    (plain, plain_ids), (tiered, tiered_ids) = runs[0, 0], runs[1 << 20, 0]
    assert plain["engine"]["preemptions"] == 1 and tiered["engine"]["preemptions"] >= 1
    assert plain["main"]["readmission_hit_tokens"] == 0
    assert tiered["main"]["readmission_hit_tokens"] >= 64 and tiered["main"]["tiers"]["host"]["hits"] >= 4
    assert tiered_ids == plain_ids
    # With a share for preempted requests, their pages come back from it.
    shared, shared_ids = runs[1 << 20, 1 << 20]
    assert shared["main"]["tiers"]["preempted"]["hits"] >= 4 and shared_ids == plain_ids


def test_many_requests_through_small_tiers_give_the_tokens_of_cache_off(tiny, tmp_path):
    """Continuous batching over a pool too small for the working set, with a small host tier and a disk tier
    below it: pages move down and come back through the gate while others run; tokens equal cache off's."""
    model, tok = tiny
    rng = np.random.default_rng(11)
    stems = [rng.integers(2, 512, size=48).tolist() for _ in range(6)]
    prompts_ = [stems[i % 6] + rng.integers(2, 512, size=5 + i).tolist() for i in range(12)]
    sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    cfg = dict(page_size=16, num_pages=14, max_num_seqs=3, prefill_chunk_tokens=32, max_tokens_per_step=64)
    ref = Engine(model, tok, EngineConfig(cache_mode="off", **cfg))
    eng = Engine(model, tok, EngineConfig(host_tier_bytes=4 * 8192, disk_tier_bytes=16 * 8192,
                                          disk_tier_dir=str(tmp_path), **cfg))
    assert eng.page_bytes == 8192
    for round_ in range(2):
        batch = [Request(p, sampling, request_id=f"{round_}-{i}") for i, p in enumerate(prompts_)]
        got = eng.generate(batch)
        want = ref.generate([Request(p, sampling) for p in prompts_])
        assert [o.output_ids for o in got] == [o.output_ids for o in want]
        eng.check_invariants()
    tiers = eng.metrics()["main"]["tiers"]
    assert tiers["host"]["hits"] + tiers["disk"]["hits"] > 0 and tiers["disk"]["stored_pages"] > 0


def test_vlm_pages_through_an_image_come_back_from_the_tier_only_for_that_image(datasets_dir):
    """An image's page extras are in the chain digest: after the pages of a chat with one image moved down, the
    same chat is read in through the image, and a chat with another image of equal placeholder ids stops at the
    page of its first placeholder; outputs equal cache off's."""
    from mmcache.hosts.vlm import VLMEngine, VLMRequest
    from mmcache.presets.vlm import build_vlm
    from mmcache.store import EncoderOutputStore

    preset = build_vlm("tiny-llava")
    folder = datasets_dir / "images"
    coffee, chelsea = ((folder / f"{n}.png").read_bytes() for n in ("coffee", "chelsea"))

    def chat(image):
        return [{"role": "system", "content": "A chat about a photo."},
                {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What?"}]}]

    def front(**cfg):
        config = EngineConfig.exact(page_size=16, num_pages=256, **cfg)
        return VLMEngine(Engine(preset.model, None, config), preset.prompt_builder(EncoderOutputStore(1 << 24)))

    tiered, off = front(host_tier_bytes=1 << 22), front(cache_mode="off")
    first = tiered.generate([VLMRequest(chat(coffee), sampling=GREEDY)])[0]
    with tiered.builder.from_messages(chat(coffee)) as prompt:
        placeholder = prompt.embeds[0][0]
    tiered.engine.clear_cache(demote=True)
    other = tiered.generate([VLMRequest(chat(chelsea), sampling=GREEDY)])[0]
    assert other.matched_tokens == placeholder // 16 * 16
    tiered.engine.clear_cache(demote=True)
    again = tiered.generate([VLMRequest(chat(coffee), sampling=GREEDY)])[0]
    assert again.matched_tokens == (first.prompt_len - 1) // 16 * 16 > placeholder
    assert tiered.engine.metrics()["main"]["tiers"]["host"]["hits"] > 0
    want = [off.generate([VLMRequest(chat(img), sampling=GREEDY)])[0].output_ids for img in (coffee, chelsea, coffee)]
    assert [first.output_ids, other.output_ids, again.output_ids] == want
    tiered.check_invariants()
