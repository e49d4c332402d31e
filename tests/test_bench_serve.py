"""``mmcache bench serve`` on the tiny LLaVA preset with few requests: the JSON the runner writes (HTTP beside the
in-process engine on the same requests, the open-loop part, a small soak with nothing held afterwards), the
table rows, the soak's plan and its check for held resources, and the options refused before anything is
built. Speed is never asserted."""

import json

import pytest

import benchmarks.serve as serve
import benchmarks.serve_open_loop as ol
import benchmarks.serve_soak as soak
from benchmarks.runner import bench_parser
from mmcache.cli import main as cli_main

pytestmark = pytest.mark.usefixtures("one_thread")

ARGS = ["--quick", "--images", "2", "--users", "2", "--turns", "2", "--max-tokens", "3", "--repeats", "2",
        "--sessions", "3", "--rates", "8", "--duration", "0.375", "--soak", "60", "--soak-concurrency", "8",
        "--text-sessions", "2", "--text-requests", "3"]
RATE_KEYS = {"rate", "attainment", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_p50_s", "throughput_tok_s",
             "matched_share"}


@pytest.fixture(scope="module")
def run_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve")
    path, png = folder / "serve.json", folder / "serve.png"
    assert cli_main(["bench", "serve", "--json", str(path), "--plot", str(png)] + ARGS) == 0
    return json.loads(path.read_text()), png


@pytest.fixture(scope="module")
def result(run_files):
    return run_files[0]


def test_http_and_the_in_process_engine_saw_the_same_requests(result):
    ll = result["low_load"]
    assert result["config"]["preset"] == "tiny-llava" and result["config"]["quick"] is True
    assert ll["requests"] == 2 * 2 * 2 * 2 and ll["repeats"] == 2  # repeats x chats x turns
    assert ll["server"] == "own process"  # the client shares no interpreter with the server
    # the same prompts, the same cache hits and the same greedy answers on both sides
    assert ll["prompt_tokens_equal"] and ll["cached_tokens_equal"] and ll["outputs_equal_share"] == 1.0
    assert ll["cached_tokens_share"] == ll["in_process_matched_share"]
    assert ll["cached_tokens_share_later_turns"] > 0.5  # turn 2 sends turn 1's prompt and answer again
    first, second = ll["per_turn"]
    assert second["cached_tokens_share"] > first["cached_tokens_share"]
    # the openai client, under its own salt, met the same cache state and gave the same answers
    assert ll["openai_client"]["cached_tokens_equal"] and ll["openai_client"]["outputs_equal_share"] == 1.0


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
    official = ll["openai_client"]
    assert official["http_ttft_p50_s"] > 0 and official["in_process_ttft_p50_s"] == ll["in_process_ttft_p50_s"]


def test_the_open_loop_json_has_issue_44s_shape(result):
    assert set(result["engines"]) == {"mmcache", "mmcache_nocache"}
    assert set(result["slo"]) == set(serve.sweep.WORKLOADS)
    for engine, per in result["engines"].items():
        assert set(per) == set(serve.sweep.WORKLOADS), engine
        for workload, figures in per.items():
            assert {"goodput_rps", "rates"} <= set(figures)
            (rate,) = figures["rates"]  # quick: one repeat, no foot, no rate near the line
            assert RATE_KEYS <= set(rate) and rate["rate"] == 8.0 and (rate["repeat"], rate["step"]) == (0, "ladder")
            assert rate["failed"] == 0 and rate["outcomes"]["ok"] == rate["requests"], (engine, workload)
            assert rate["check"]["invariants"] == "ok" and not any(rate["check"]["held_after"].values())
            assert 0 <= rate["attainment"] <= 1 and rate["ttft_p50_s"] > 0 and rate["throughput_tok_s"] > 0
            assert figures["goodput_rps"] == (8.0 if rate["attainment"] >= 0.9 else None)
    on, off = result["engines"]["mmcache"], result["engines"]["mmcache_nocache"]
    assert on["vlm_chat"]["rates"][0]["requests"] == 3 * 2  # rate x --duration sessions x turns
    assert on["multi_turn"]["rates"][0]["requests"] == 3 * 2  # rate x --duration sessions x --text-turns (quick: 2)
    assert on["shared_prefix"]["rates"][0]["requests"] == on["mooncake"]["rates"][0]["requests"] == 3
    assert on["vlm_chat"]["rates"][0]["matched_share"] > 0.3 and on["multi_turn"]["rates"][0]["matched_share"] > 0.3
    for figures in off.values():
        assert figures["rates"][0]["matched_share"] == 0.0
    from mmcache.server.config import serve_engine_config

    server = serve_engine_config()
    assert result["config"]["schedule"] == {"page_size": 16, "max_tokens_per_step": server.max_tokens_per_step,
                                            "prefill_chunk_tokens": server.prefill_chunk_tokens,
                                            "mixed_prefill_tokens": server.mixed_prefill_tokens,
                                            "max_num_seqs": server.max_num_seqs}


def test_slos_come_from_the_cache_off_engine_unloaded(result):
    for workload, slo in result["slo"].items():
        assert slo["engine"] == "mmcache_nocache"
        assert slo["ttft_s"] == pytest.approx(5 * slo["unloaded_ttft_p50_s"])
        tpot = slo["unloaded_tpot_p50_s"] or slo["unloaded_ttft_p50_s"]
        assert slo["tpot_s"] == pytest.approx(2 * tpot) and slo["unloaded_matched_share"] == 0.0
    assert result["workloads"]["mooncake"]["source"].endswith("conversation_trace.jsonl")
    assert result["mmcache_over"].keys() == set(serve.sweep.WORKLOADS)
    for w, over in result["mmcache_over"].items():
        assert set(over) == {"mmcache_nocache"} and over["mmcache_nocache"]["repeats"] == 1, w
    assert result["runs"] == [{"repeat": 0, "seed": 0, "order": ["mmcache_nocache", "mmcache"]}]


def test_the_plot_is_written(run_files):
    _, png = run_files
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


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
            "TTFT added by HTTP through the openai client",
            "cached_tokens share, multi-turn VLM chat", "vlm_chat at 8 sessions/s: SLO attainment",
            "soak: requests, pages and leases held after"} <= metrics
    for w in serve.sweep.WORKLOADS:  # the words after it say when the ratio rests on one ladder step
        assert any(m.startswith(f"goodput, {w} (90% within SLOs; 0: no rate)") for m in metrics), w
    attainment = next(r for r in rows if r.metric.startswith("vlm_chat at 8"))
    off = result["engines"]["mmcache_nocache"]["vlm_chat"]["rates"][0]["attainment"]
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
    from mmcache.hosts.vlm import VLMRequest
    from mmcache.presets import vlm_from_preset
    from mmcache.server.engine_host import EngineHost

    front = vlm_from_preset("tiny-llava", EngineConfig(page_size=16, num_pages=64))
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
                                                                 [0.0625, 0.125, 0.25, 0.5, 1.0, 2.0])
    assert (args.sessions, args.text_sessions, args.text_requests) == (16, 16, 16)
    assert (args.text_preset, args.text_dtype, args.workloads) == ("small", "bfloat16", list(serve.sweep.WORKLOADS))
    args = bench_parser("serve", serve).parse_args(["--quick", "--workloads", "mooncake,vlm_chat", "--duration", "2"])
    serve.settle(args)
    assert (args.text_preset, args.text_dtype, args.workloads) == ("tiny", "float32", ["mooncake", "vlm_chat"])
    assert ol.per_rate(args, 4.0, 99) == 8 and ol.per_rate(args, 0.1, 99) == 1  # rate x duration, >= 1
    args.duration = None
    assert ol.per_rate(args, 4.0, 99) == 99



def test_the_ladders_floor_is_a_quarter_of_the_lowest_rate_and_none_below_it_in_quick():
    args = bench_parser("serve", serve).parse_args([])
    serve.settle(args)
    assert args.min_rate == 0.0625 / 4
    args = bench_parser("serve", serve).parse_args(["--quick"])
    serve.settle(args)
    assert args.min_rate == min(args.rates)  # quick mode adds no rate
    args = bench_parser("serve", serve).parse_args(["--rates", "0.5,1", "--min-rate", "0.5"])
    serve.settle(args)
    assert args.min_rate == 0.5
    with pytest.raises(SystemExit):
        bench_parser("serve", serve).parse_args(["--min-rate", "0"])


def test_attainment_rows_pair_the_engines_by_rate():
    """Cache off's foot may hold rates cache on never swept: the table pairs each rate with the same rate."""
    def swept(rates):
        return {"unit": "sessions/s", "goodput_rps": None,
                "rates": [{"rate": r, "attainment": a} for r, a in rates]}

    engines = {"mmcache": {"w": swept([(0.5, 0.95), (1.0, 0.5)])},
               "mmcache_nocache": {"w": swept([(0.125, 0.92), (0.25, 0.8), (0.5, 0.6), (1.0, 0.1)])}}
    rows = serve.open_loop_rows({"engines": engines})
    att = [(r.metric, r.value, r.baseline) for r in rows if "SLO attainment" in r.metric]
    assert [(v, b) for _, v, b in att] == [(0.95, 0.6), (0.5, 0.1)]


def test_the_servers_run_with_mmcache_serves_schedule_unless_told():
    from mmcache.server.config import SERVE_MIXED_PREFILL_TOKENS, serve_engine_config

    args = bench_parser("serve", serve).parse_args(["--quick"])
    serve.settle(args)
    assert serve.engine_config(args, "off") == serve_engine_config(page_size=16, num_pages=args.num_pages,
                                                                  cache_mode="off")
    assert serve.engine_config(args).mixed_prefill_tokens == SERVE_MIXED_PREFILL_TOKENS
    args = bench_parser("serve", serve).parse_args(["--quick", "--prefill-chunk-tokens", "256",
                                                    "--mixed-prefill-tokens", "64"])
    serve.settle(args)
    config = serve.server_config(args, "off").engine_config
    assert (config.prefill_chunk_tokens, config.mixed_prefill_tokens, config.cache_mode) == (256, 64, "off")


def test_vlm_sessions_beyond_the_chats_repeat_them_under_their_own_salt():
    args = bench_parser("serve", serve).parse_args(["--quick", "--images", "2", "--users", "2", "--turns", "2"])
    serve.settle(args)
    plan = serve.chat_plan(args)
    work = ol.vlm_workload(args, plan)
    options = {"model": "m", "extra_body": {"cache_salt": "rate-0", "ignore_eos": True}}
    made = work.make(options, 2 * len(plan) + 1)
    salts = [s.options["extra_body"]["cache_salt"] for s in made]
    n = len(plan)
    assert salts == ["rate-0"] * n + ["rate-0-pass1"] * n + ["rate-0-pass2"]
    assert [s.turns for s in made[n:2 * n]] == [s.turns for s in made[:n]]  # the same chats, word for word
    assert all(s.options["extra_body"]["ignore_eos"] for s in made) and options["extra_body"]["cache_salt"] == "rate-0"


def test_peers_without_the_vllm_environment_are_refused(monkeypatch, capsys):
    monkeypatch.delenv("VLLM_PEER_PYTHON", raising=False)
    assert cli_main(["bench", "serve", "--quick", "--peers"]) == 2
    err = capsys.readouterr().err
    assert "VllmUnavailable" in err and "--peers needs VLLM_PEER_PYTHON" in err
    monkeypatch.setenv("VLLM_PEER_PYTHON", "/nonexistent/python")
    assert cli_main(["bench", "serve", "--quick", "--peers"]) == 2
    assert "is not an executable interpreter" in capsys.readouterr().err


@pytest.mark.parametrize("option, value, says", [("--rates", "0", "must lie in (0"), ("--rates", "1,x", "not a number"),
                                                 ("--soak", "-1", "at least 0"), ("--repeats", "0", "at least 1"),
                                                 ("--time-limit", "0.5", "at least 1"),
                                                 ("--workloads", "chat", "give distinct names"),
                                                 ("--workloads", "mooncake,mooncake", "give distinct names"),
                                                 ("--duration", "0", "must lie in (0"),
                                                 ("--duration", "nan", "finite"),
                                                 ("--text-sessions", "0", "at least 1"),
                                                 ("--text-preset", "tiny-llava", "invalid choice"),
                                                 ("--load-repeats", "0", "at least 1"),
                                                 ("--load-repeats", "x", "not"),
                                                 ("--tune-peer", "64", "must lie in [128"),
                                                 ("--tune-peer", "256,256", "distinct"),
                                                 ("--tune-peer", "256,big", "not a whole number"),
                                                 ("--tune-peer", "", "not a whole number"),
                                                 ("--peer-batched-tokens", "100000", "must lie in [128"),
                                                 ("--near-line", "1", "other than 1"),
                                                 ("--near-line", "0", "(0, 16]"),
                                                 ("--near-line", "0.75,0.75", "distinct"),
                                                 ("--near-line", "100", "(0, 16]"),
                                                 ("--near-line", "inf", "finite")])
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


# ---- the open-loop sweep's workloads, SLOs and goodput (no server) -------------------------------------------
SPACE = serve.sw.TokenSpace(2, 512)


def test_multi_turn_sessions_have_vllms_shape_scaled():
    plan = serve.sw.multi_turn(SPACE, seed=3, conversations=5, max_turns=3, scale=0.1, max_answer=6)
    again = serve.sw.multi_turn(SPACE, seed=3, conversations=5, max_turns=3, scale=0.1, max_answer=6)
    assert plan.turns == again.turns and plan.unit == "sessions" and len(plan.turns) == 5
    common = plan.params["common_prefix_len"]
    assert common == 50  # 500 tokens in the configuration, times 0.1
    firsts = [s[0] for s in plan.turns]
    assert all(f[:common] == firsts[0][:common] for f in firsts)  # the prefix every conversation shares
    assert len({tuple(f[common:common + 8]) for f in firsts}) == 5  # then each its own prefix
    for turns, answers in zip(plan.turns, plan.max_tokens):
        assert 2 <= len(turns) <= 3 and len(answers) == len(turns)  # 12-18 messages: 6-9 user turns, cut to 3
        assert all(12 <= len(t) <= 16 for t in turns[1:])  # user turns of 120-160 tokens, times 0.1
        assert all(1 <= a <= 6 for a in answers)
        assert all(SPACE.low <= x < SPACE.high for t in turns for x in t)
    s = plan.sessions({"model": "m"}, 7)  # more than the plan holds: the list again, in order
    assert len(s) == 7 and s[5].turns == plan.turns[0] and s[0].max_tokens == plan.max_tokens[0]
    with pytest.raises(serve.WorkloadShapeError, match="scale"):
        serve.sw.multi_turn(SPACE, 0, 2, 2, 1.5, 4)


def test_shared_prefix_requests_share_their_groups_system_prompt():
    plan = serve.sw.shared_prefix(SPACE, seed=1, groups=3, per_group=4, system_len=20, question_len=5,
                                  output_len=3)
    assert len(plan.turns) == 12 and all(len(t) == 1 and len(t[0]) == 25 for t in plan.turns)
    systems = [tuple(t[0][:20]) for t in plan.turns]
    assert sorted(systems.count(s) for s in set(systems)) == [4, 4, 4]
    assert len({tuple(t[0][20:]) for t in plan.turns}) == 12
    assert plan.max_tokens == [[3]] * 12 and plan.offsets(2.0, 12) is None  # Poisson arrivals


def test_mooncake_blocks_map_to_fixed_token_runs(tmp_path):
    trace = tmp_path / "t.jsonl"
    lines = [{"timestamp": 0, "input_length": 1000, "output_length": 50, "hash_ids": [7, 8]},
             {"timestamp": 2000, "input_length": 600, "output_length": 3, "hash_ids": [7, 9]},
             {"timestamp": 6000, "input_length": 1536, "output_length": 9, "hash_ids": [7, 8, 10]}]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    plan = serve.sw.mooncake(SPACE, start=0, count=3, block_tokens=4, max_answer=10, path=trace)
    again = serve.sw.mooncake(SPACE, start=0, count=3, block_tokens=4, max_answer=10, path=trace)
    assert plan.turns == again.turns
    (a,), (b,), (c,) = plan.turns
    assert (len(a), len(b), len(c)) == (8, 5, 12)  # ceil(input_length x 4 / 512), at most 4 per block
    assert a[:4] == b[:4] == c[:4]  # block 7 everywhere
    assert a[4:8] == c[4:8] and b[4:5] != a[4:5]  # block 8 in the first and the last, 9 elsewhere
    assert len({tuple(a[:4]), tuple(a[4:8]), tuple(c[8:12])}) == 3
    assert all(SPACE.low <= x < SPACE.high for t in (a, b, c) for x in t)
    assert plan.max_tokens == [[10], [3], [9]]
    assert plan.params["repeated_block_share"] == pytest.approx(3 / 7)
    # the trace's own times (0, 2, 6 s) scaled so that 3 arrivals come at 1 per second: 2 s from first to last
    assert plan.offsets(1.0, 3) == pytest.approx([0.0, 2 / 3, 2.0])
    assert plan.offsets(2.0, 2) == pytest.approx([0.0, 0.5])
    runs = serve.sw.block_runs(plan_keys(trace, 0), 4, SPACE)
    assert runs.tolist() == a
    with pytest.raises(serve.WorkloadShapeError, match="fewer than"):
        serve.sw.mooncake(SPACE, 1, 3, 4, 10, path=trace)
    cut = serve.sw.mooncake(SPACE, start=0, count=3, block_tokens=4, max_answer=10, max_prompt=6, path=trace)
    assert [t[0] for t in cut.turns] == [a[:6], b[:5], c[:6]]  # only tails go: the shared prefixes stay


def plan_keys(path, i):
    from mmcache.replay.mooncake import MooncakeTrace

    t = MooncakeTrace(path)
    return t.block_keys[t.offsets[i]:t.offsets[i + 1]]


def test_trace_offsets_with_equal_times_are_evenly_spaced():
    assert serve.sw.trace_offsets([5.0, 5.0, 5.0], 4.0) == pytest.approx([0.0, 0.25, 0.5])
    with pytest.raises(serve.WorkloadShapeError):
        serve.sw.trace_offsets([0.0, 1.0], 0.0)


def test_rate_rows():
    from benchmarks import loadgen
    from test_loadgen import rec

    records = [rec(0.0, first=0.1, step=0.02, tokens=4), rec(1.0, first=1.5, step=0.02, tokens=4),
               rec(2.0, outcome="timeout")]
    row = serve.sweep.rate_row(2.0, loadgen.summarise(records, 0.2, 0.05))
    assert row["rate"] == 2.0 and row["attainment"] == pytest.approx(1 / 3) and row["failed"] == 1
    for key in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_p50_s", "throughput_tok_s", "matched_share"):
        assert key in row


def test_slos_come_from_the_unloaded_p50s():
    """The unloaded run's SLOs: 5x its p50 TTFT and 2x its p50 TPOT, over a stub server."""
    import asyncio

    import httpx2
    import openai

    from test_loadgen import StubCompletions

    app = StubCompletions(per_chunk=False)
    plan = serve.sw.shared_prefix(SPACE, 0, 1, 3, 4, 2, 3)
    work = serve.sweep.Workload("shared_prefix", "requests/s", plan.sessions, lambda rate: 3, {"max_tokens": 3})
    target = serve.sweep.Target("stub", "http://stub/v1", "m")

    async def go(monkeyed):
        # each call gets its own client over the app (the sweep closes a client after each rate)
        monkeyed.setattr(serve.sweep, "client", lambda url: openai.AsyncOpenAI(
            base_url=url, api_key="k", max_retries=0,
            http_client=httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app))))
        slo = await serve.sweep.unloaded(target, work, 0, 30.0)
        swept = await serve.sweep.sweep(target, work, [50.0, 100.0], slo, 0, 30.0)
        return slo, swept

    with pytest.MonkeyPatch.context() as mp:
        slo, swept = asyncio.run(go(mp))
    assert slo["ttft_s"] == pytest.approx(5 * slo["unloaded_ttft_p50_s"])
    assert slo["tpot_s"] == pytest.approx(2 * slo["unloaded_tpot_p50_s"])
    assert slo["unloaded_requests"] == 3 and slo["engine"] == "stub"
    assert len(app.bodies) == 1 + 3 + 3 + 3  # warm-up, unloaded, two rates
    salts = [b["cache_salt"] for b in app.bodies]
    assert salts[4:7] == ["serve-shared_prefix-0-0"] * 3 and salts[7:] == ["serve-shared_prefix-0-1"] * 3
    assert [r["rate"] for r in swept["rates"]] == [50.0, 100.0] and swept["failed_requests"] == 0
    assert swept["goodput_rps"] == loadgen_goodput(swept["rates"])
    for row in swept["rates"]:
        seen = row["attainment_by_tpot_times"]
        assert seen["2"] == row["attainment"] and seen["2"] <= seen["3"] <= seen["5"]  # looser SLOs: no fewer met
    assert swept["goodput_by_tpot_times"]["2"] == swept["goodput_rps"]



def test_the_ladders_foot_moves_down_until_an_engine_meets_the_slos_or_the_floor():
    """An engine that meets the SLOs at none of the rates gets half the lowest rate next, with the next salt, down
    to the floor; one that meets them somewhere gets no extra rate."""
    import asyncio

    import httpx2
    import openai

    from test_loadgen import StubCompletions

    app = StubCompletions(per_chunk=False)
    plan = serve.sw.shared_prefix(SPACE, 0, 1, 3, 4, 2, 3)
    work = serve.sweep.Workload("shared_prefix", "requests/s", plan.sessions, lambda rate: 2, {"max_tokens": 3})
    target = serve.sweep.Target("stub", "http://stub/v1", "m")

    async def go(monkeyed, slo, floor):
        monkeyed.setattr(serve.sweep, "client", lambda url: openai.AsyncOpenAI(
            base_url=url, api_key="k", max_retries=0,
            http_client=httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app))))
        return await serve.sweep.sweep(target, work, [400.0, 800.0], slo, 0, 30.0, floor=floor)

    never = {"ttft_s": 0.0, "tpot_s": 0.0}  # no request answers in no time
    always = {"ttft_s": 60.0, "tpot_s": 60.0}
    with pytest.MonkeyPatch.context() as mp:
        missed = asyncio.run(go(mp, never, 100.0))
        salts_missed = [b["cache_salt"] for b in app.bodies]
        app.bodies.clear()
        met = asyncio.run(go(mp, always, 100.0))
    assert [r["rate"] for r in missed["rates"]] == [100.0, 200.0, 400.0, 800.0]  # 50 is below the floor
    assert missed["goodput_rps"] is None and all(r["attainment"] == 0.0 for r in missed["rates"])
    assert salts_missed == [f"serve-shared_prefix-0-{k}" for k in range(4) for _ in range(2)]
    assert [r["rate"] for r in met["rates"]] == [400.0, 800.0] and met["goodput_rps"] == 800.0


def loadgen_goodput(rows):
    from benchmarks import loadgen

    return loadgen.goodput(rows, 0.9)


def test_the_text_model_folder_has_its_vocabulary_cut_to_its_tokenizer(tmp_path, monkeypatch):
    """A preset whose vocabulary is wider than its tokenizer (as ``small``'s is) is written with the rows past the
    tokenizer dropped, the first rows unchanged; a folder that is not empty is refused."""
    import torch

    import mmcache.presets.text as text_presets
    from benchmarks.serve_model import export_text_model
    from mmcache.engine.models import load_model

    model, tokenizer = text_presets.build_model("tiny", "float32")
    rows = len(tokenizer)
    kept = model.get_input_embeddings().weight[:rows].detach().clone()
    model.resize_token_embeddings(rows + 88)  # wider than the tokenizer, as small's 151,936 rows over 4,811
    monkeypatch.setattr(text_presets, "build_model", lambda name, dtype: (model, tokenizer))
    out = export_text_model("tiny", tmp_path / "m", "float32")
    assert json.loads((out / "config.json").read_text())["vocab_size"] == rows
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    loaded, _ = load_model(out, "float32")
    assert torch.equal(loaded.get_input_embeddings().weight, kept)
    with pytest.raises(FileExistsError, match="not empty"):
        export_text_model("tiny", out, "float32")


def test_the_vllm_server_command_and_a_failed_start(tmp_path, monkeypatch):
    """The peer's command line (no vLLM needed), and a server process that exits at once: VllmUnavailable with
    its log's tail, and nothing left running."""
    from benchmarks.peers import vllm_server as vs

    assert [vs.block_size_for(p) for p in (1, 16, 32, 33, 128)] == [32, 32, 32, 64, 128]
    cmd = vs.command("py", "/m", "small", 8001, "bfloat16", 32, 4096, 64, 4096)
    assert cmd[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    for flag in ("--enable-prefix-caching", "--enable-prompt-tokens-details", "--enforce-eager"):
        assert flag in cmd
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--block-size") + 1] == "32"
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'no model here' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv("VLLM_PEER_PYTHON", str(fake))
    srv = vs.VllmOpenAIServer("/m", "small", str(tmp_path / "vllm.log"), "bfloat16", 32, 4096, 64, 4096,
                              start_timeout_s=30)
    with pytest.raises(vs.VllmUnavailable, match="exited with 3(.|\n)*no model here"):
        srv.start()
    assert srv.proc is None  # reaped
