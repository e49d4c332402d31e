"""``mmcache bench serve`` on the tiny LLaVA preset with few requests: the JSON the runner writes (HTTP beside the
in-process engine on the same requests, the open-loop part, a small soak with nothing held afterwards), the
table rows, the soak's plan and its check for held resources, and the options refused before anything is
built. Speed is never asserted."""

import json

import pytest

import benchmarks.serve as serve
import benchmarks.serve_soak as soak
from benchmarks.runner import bench_parser
from mmcache.cli import main as cli_main

pytestmark = pytest.mark.usefixtures("one_thread")

ARGS = ["--quick", "--images", "2", "--users", "2", "--turns", "2", "--max-tokens", "3", "--repeats", "2",
        "--sessions", "3", "--rates", "8", "--soak", "60", "--soak-concurrency", "8"]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve") / "serve.json"
    assert cli_main(["bench", "serve", "--json", str(path)] + ARGS) == 0
    return json.loads(path.read_text())


def test_http_and_the_in_process_engine_saw_the_same_requests(result):
    ll = result["low_load"]
    assert result["config"]["preset"] == "tiny-llava" and result["config"]["quick"] is True
    assert ll["requests"] == 2 * 2 * 2 * 2 and ll["repeats"] == 2  # repeats x chats x turns
    # the same prompts, the same cache hits and the same greedy answers on both sides
    assert ll["prompt_tokens_equal"] and ll["cached_tokens_equal"] and ll["outputs_equal_share"] == 1.0
    assert ll["cached_tokens_share"] == ll["in_process_matched_share"]
    assert ll["cached_tokens_share_later_turns"] > 0.5  # turn 2 sends turn 1's prompt and answer again
    first, second = ll["per_turn"]
    assert second["cached_tokens_share"] > first["cached_tokens_share"]


def test_the_ttft_figures_are_paired_medians(result):
    ll = result["low_load"]
    for key in ("http_ttft_p50_s", "in_process_ttft_p50_s", "http_e2e_p50_s", "in_process_e2e_p50_s"):
        assert ll[key] > 0, key
    assert ll["ttft_rule"] in ("first text", "first event")
    head = ll["time_to_first_text"] if ll["ttft_rule"] == "first text" else ll["time_to_first_event"]
    assert ll["added_ttft_p50_s"] == head["added_p50_s"]
    assert len(head["per_repeat"]) == 2
    assert ll["target_added_ttft_s"] == max(0.005, 0.05 * ll["in_process_ttft_p50_s"])
    assert ll["target_met"] == (ll["added_ttft_p50_s"] <= ll["target_added_ttft_s"])


def test_the_open_loop_part_with_the_cache_on_and_off(result):
    load = result["load"]
    ll = result["low_load"]
    assert load["slo"]["ttft_s"] == pytest.approx(5 * ll["http_ttft_p50_s"])
    assert load["slo"]["tpot_s"] == pytest.approx(2 * ll["in_process_tpot_p50_s"])
    assert set(load["engines"]) == {"mmcache", "mmcache_nocache"}
    for engine, figures in load["engines"].items():
        (rate,) = figures["vlm_chat"]["rates"]
        assert rate["rate"] == 8.0 and rate["requests"] == 3 * 2  # sessions x turns
        assert rate["outcomes"] == {"ok": 6, "cut": 0, "error": 0, "timeout": 0}
        assert 0 <= rate["attainment"] <= 1 and rate["ttft_p50_s"] > 0 and rate["throughput_tok_s"] > 0
        assert figures["vlm_chat"]["goodput_rps"] in (None, 8.0)
    assert load["engines"]["mmcache"]["vlm_chat"]["rates"][0]["matched_share"] > 0.3
    assert load["engines"]["mmcache_nocache"]["vlm_chat"]["rates"][0]["matched_share"] == 0.0


def test_the_soak_leaves_nothing_held(result):
    s = result["soak"]
    assert s["requests"] == 60 and sum(s["outcomes"].values()) == 60
    assert s["unexpected"] == 0, s["unexpected_examples"]
    assert s["held_after"] == {"requests": 0, "pages": 0, "store_leases": 0, "requests_holding_leases": 0}
    assert s["invariants"] == "ok" and s["idle_after"] is True
    assert set(s["by_kind"]) >= {"chat", "cut", "malformed"}
    assert set(s["by_kind"]["malformed"]) <= {"400", "401", "404", "503"}
    assert s["tenants"] == 3


def test_table_rows(result):
    rows = serve.table_rows(result)
    metrics = {r.metric for r in rows}
    assert {"TTFT p50 over HTTP, one request at a time", "TTFT added by HTTP (median of paired differences)",
            "cached_tokens share, multi-turn VLM chat", "open loop 8 sessions/s: SLO attainment",
            "goodput, VLM chat (90% within SLOs; 0: no rate)", "soak: requests, pages and leases held after"} <= metrics
    attainment = next(r for r in rows if r.metric.startswith("open loop 8"))
    off = result["load"]["engines"]["mmcache_nocache"]["vlm_chat"]["rates"][0]["attainment"]
    assert attainment.baseline == off and attainment.versus == "cache off"
    held = next(r for r in rows if r.metric.startswith("soak: requests, pages"))
    assert held.value == 0.0 and held.target == "0"


def test_the_soak_plan_is_seeded_and_mixed():
    a, b = soak.plan(200, "m", seed=5), soak.plan(200, "m", seed=5)
    assert [(p.kind, p.case, p.api_key) for p in a] == [(p.kind, p.case, p.api_key) for p in b]
    assert {p.kind for p in a} == set(soak.KINDS)
    assert {p.api_key for p in a if p.kind == "chat"} == set(soak.TENANTS)
    for p in a:
        if p.kind == "cut":
            assert p.cut_after is not None and p.cut_after < p.body["max_tokens"]
            assert p.body["extra_body"]["ignore_eos"] is True
        if p.kind == "abandon":
            assert 0 <= p.abandon_after <= soak.MAX_ABANDON_S and "abandoned" in p.expect
        if p.kind == "malformed":
            assert p.expect & {"400", "401", "404"}
        if p.kind == "oversized":
            assert "413" in p.expect
    images = soak.small_images(4, seed=1)
    assert len(set(images)) == 4 and all(len(x) < soak.IMAGE_LIMIT for x in images)
    assert len(soak.noise_png(160, seed=0)) > soak.IMAGE_LIMIT


def test_held_after_sees_a_live_request_and_its_leases():
    """The soak's check must see what a live request holds (pages, a store lease), and nothing once it ends."""
    from mmcache.engine import EngineConfig, SamplingParams
    from mmcache.engine.vlm import VLMEngine, VLMRequest
    from mmcache.server.runner import EngineHost

    front = VLMEngine.from_preset("tiny-llava", EngineConfig(page_size=16, num_pages=64))
    host = EngineHost(front)  # not started: this test steps the engine itself
    image = soak.small_images(1, seed=2)[0]
    msg = {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What?"}]}
    front.add_request(VLMRequest([msg], sampling=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                                 request_id="live"))
    front.step()
    held = soak.held_after(host)
    assert held["requests"] == 1 and held["pages"] > 0 and held["store_leases"] == 1
    assert held["requests_holding_leases"] == 1
    front.abort("live")
    front.step()
    assert soak.held_after(host) == {"requests": 0, "pages": 0, "store_leases": 0, "requests_holding_leases": 0}


def test_data_urls():
    png, jpeg = soak.small_images(1, seed=0)[0], b"\xff\xd8\xff\xe0rest"
    assert serve.data_url(png).startswith("data:image/png;base64,iVBOR")
    assert serve.data_url(jpeg).startswith("data:image/jpeg;base64,")
    with pytest.raises(serve.WorkloadShapeError):
        serve.data_url(b"GIF89a")


def test_sizes_follow_quick_and_options_win():
    args = bench_parser("serve", serve).parse_args(["--quick", "--repeats", "7"])
    serve.settle(args)
    assert (args.preset, args.dtype, args.repeats, args.soak) == ("tiny-llava", "float32", 7, serve.QUICK["soak"])
    args = bench_parser("serve", serve).parse_args(["--soak"])
    serve.settle(args)
    assert (args.preset, args.dtype, args.soak, args.rates) == ("bench-llava", "bfloat16", serve.SOAK_DEFAULT,
                                                                 [0.5, 1.0, 2.0])


@pytest.mark.parametrize("option, value, says", [("--rates", "0", "must lie in (0"), ("--rates", "1,x", "not a number"),
                                                 ("--soak", "-1", "at least 0"), ("--repeats", "0", "at least 1"),
                                                 ("--time-limit", "0.5", "at least 1")])
def test_bad_options_are_refused_before_anything_is_built(option, value, says, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["bench", "serve", "--quick", f"{option}={value}"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"mmcache bench serve: error: argument {option}: " in err and says in err, err


def pair(rep, http, local):
    return {"repeat": rep, "http": {"ttft": http}, "local": {"ttft": local}}


def test_paired_statistics_are_medians_of_per_repeat_medians():
    pairs = [pair(0, 0.012, 0.010), pair(0, 0.030, 0.020), pair(0, 0.015, 0.014),   # differences 2, 10, 1 ms
             pair(1, 0.110, 0.100), pair(1, 0.105, 0.100), pair(1, None, 0.100)]    # 10, 5 ms; one without text
    p = serve.paired(pairs, "ttft")
    assert p["pairs"] == 5 and [r["pairs"] for r in p["per_repeat"]] == [3, 2]
    assert [r["added_p50_s"] for r in p["per_repeat"]] == pytest.approx([0.002, 0.0075])
    assert p["added_p50_s"] == pytest.approx((0.002 + 0.0075) / 2)
    assert p["added_all_pairs_p50_s"] == pytest.approx(0.005)
    assert p["in_process_p50_s"] == pytest.approx(0.02) and p["target_added_s"] == pytest.approx(0.005)
    assert p["target_met"] is True  # 4.75 ms <= max(5 ms, 5% of 20 ms)
    assert p["per_repeat"][0]["ratio_p50"] == pytest.approx(1.2)
    assert serve.paired([pair(0, None, 0.1)], "ttft") is None


def test_a_pool_above_the_bound_is_a_typed_error():
    args = bench_parser("serve", serve).parse_args(["--quick", "--num-pages", str(1 << 24)])
    with pytest.raises(serve.WorkloadShapeError, match="pool"):
        serve.settle(args)
