"""The method of ``mmcache bench serve``'s open-loop comparison, without servers: goodput as the median over
repeats, each ratio's median and range taken within repeats, the flag on a ratio that rests on one ladder step,
the rates added near the line, vLLM's configurations and the tuning sweep's choice, the quick configuration's
finite ratio on synthetic sweeps, and the options refused."""

import asyncio

import pytest

import benchmarks.serve as serve
import benchmarks.serve_open_loop as ol
import benchmarks.serve_summary as summary
import benchmarks.serve_sweep as sweep
import benchmarks.serve_vllm as vllm
from benchmarks.runner import bench_parser
from mmcache.cli import main as cli_main


def swept(points, unit="sessions/s"):
    """A sweep's dict from ``(rate, attainment)`` points, its goodput as the sweep computes it."""
    rows = [{"rate": r, "attainment": a, "attainment_by_tpot_times": {"2": a, "3": a}} for r, a in points]
    good = [r for r, a in points if a is not None and a >= sweep.THRESHOLD]
    goodput = max(good) if good else None
    return {"unit": unit, "goodput_rps": goodput, "rates": rows, "failed_requests": 0,
            "goodput_by_tpot_times": {"2": goodput, "3": goodput}}


def test_median_goodput_counts_a_repeat_without_goodput_as_zero():
    assert summary.median_goodput([1.0, None, 0.5]) == 0.5
    assert summary.median_goodput([None, None, 2.0]) is None  # the median is 0: no goodput
    assert summary.median_goodput([1.0, 2.0]) == 1.5  # an even count: the mean of the middle two
    assert summary.median_goodput([]) is None


def test_combine_takes_medians_and_keeps_every_repeats_rows():
    runs = [swept([(0.5, 1.0), (1.0, 0.95)]), swept([(0.5, 0.97), (1.0, 0.6)]), swept([(0.5, 0.2), (1.0, 0.1)])]
    runs[2]["failed_requests"] = 3
    out = summary.combine(runs)
    assert out["goodput_runs"] == [1.0, 0.5, None] and out["goodput_rps"] == 0.5
    assert out["goodput_by_tpot_times"] == {"2": 0.5, "3": 0.5} and out["failed_requests"] == 3
    assert [(r["repeat"], r["rate"]) for r in out["rates"]] == [(0, 0.5), (0, 1.0), (1, 0.5), (1, 1.0), (2, 0.5),
                                                                 (2, 1.0)]
    assert summary.attainment_by_rate(out) == {0.5: 0.97, 1.0: 0.6}


def test_near_line_finds_the_attainments_that_decide_a_goodput():
    rows = swept([(0.25, 1.0), (0.5, 0.93), (1.0, 0.89), (2.0, 0.2)])["rates"]
    assert summary.near_line(rows, 0.5) == [{"rate": 0.5, "attainment": 0.93}, {"rate": 1.0, "attainment": 0.89}]
    rows = swept([(0.25, 1.0), (0.5, 0.99), (1.0, 0.6)])["rates"]
    assert summary.near_line(rows, 0.5) == []  # met by a margin, missed by a margin
    rows = swept([(0.25, 0.86), (0.5, 0.3)])["rates"]
    assert summary.near_line(rows, None) == [{"rate": 0.25, "attainment": 0.86}]  # no goodput: the lowest rate


def test_ratios_are_taken_within_repeats_and_summarised_by_median_and_range():
    mine = [swept([(0.5, 1.0), (1.0, 0.99)]), swept([(0.5, 1.0), (1.0, 0.98)]), swept([(0.5, 1.0), (1.0, 0.97)])]
    theirs = [swept([(0.25, 1.0), (0.5, 0.99), (1.0, 0.2)]),   # 1 / 0.5 = 2, clear
              swept([(0.25, 0.99), (0.5, 0.7), (1.0, 0.1)]),   # 1 / 0.25 = 4, clear
              swept([(0.25, 1.0), (0.5, 1.0), (1.0, 0.88)])]   # 1 / 0.5 = 2, but 0.88 at 1: one step
    s = summary.ratio_summary(mine, theirs)
    assert [r["ratio"] for r in s["runs"]] == [2.0, 4.0, 2.0]
    assert (s["median"], s["min"], s["max"], s["repeats"], s["without_ratio"]) == (2.0, 2.0, 4.0, 3, 0)
    assert [r["one_step"] for r in s["runs"]] == [False, False, True] and s["one_step_repeats"] == 1
    assert s["runs"][2]["near_line"] == {"mmcache": [], "other": [{"rate": 1.0, "attainment": 0.88}]}
    # a repeat where the other engine met the SLOs nowhere has no ratio; it is counted, not taken as a value
    s = summary.ratio_summary(mine[:2], [theirs[0], swept([(0.25, 0.1)])])
    assert (s["median"], s["min"], s["max"], s["without_ratio"]) == (2.0, 2.0, 2.0, 1)
    with pytest.raises(ValueError, match="same repeats"):
        summary.ratio_summary(mine, theirs[:2])


def test_the_table_shows_the_median_ratio_its_range_and_the_step_it_rests_on():
    mine = [swept([(0.5, 1.0), (1.0, 0.99)]), swept([(0.5, 1.0), (1.0, 0.98)]), swept([(0.5, 1.0), (1.0, 0.97)])]
    off = [swept([(0.25, 1.0), (0.5, 0.5)]), swept([(0.25, 1.0), (0.5, 0.2)]), swept([(0.25, 0.99), (0.5, 0.3)])]
    peer = [swept([(0.5, 0.99), (1.0, 0.2)]), swept([(0.25, 0.99), (0.5, 0.7)]), swept([(0.5, 1.0), (1.0, 0.88)])]
    per_repeat = [{"mmcache_nocache": {"w": o}, "mmcache": {"w": m}, "vllm_cpu": {"w": p}}
                  for o, m, p in zip(off, mine, peer)]
    result = {"engines": {e: {"w": summary.combine([run[e]["w"] for run in per_repeat])} for e in per_repeat[0]},
              "mmcache_over": {"w": summary.ratios(per_repeat, "w")}}
    assert list(result["mmcache_over"]["w"]) == ["mmcache_nocache", "vllm_cpu"]
    rows = {r.metric: r for r in serve.open_loop_rows(result)}
    off_row = rows["goodput, w (90% within SLOs; 0: no rate) [median of 3 runs, ratio 4.00-4.00x]"]
    assert (off_row.value, off_row.baseline, off_row.paired, off_row.ratio) == (1.0, 0.25, 4.0, 4.0)
    peer_row = rows["goodput, w, against vLLM at its defaults [median of 3 runs, ratio 2.00-4.00x; rests on one "
                    "ladder step in 1 of 3]"]
    assert (peer_row.value, peer_row.baseline, peer_row.ratio, peer_row.versus) == (1.0, 0.5, 2.0, "vllm_cpu")
    assert rows["w at 1 sessions/s: SLO attainment"].value == 0.98  # medians over repeats, by rate


def test_one_repeat_prints_the_plain_ratio_and_the_step_without_counts():
    per_repeat = [{"mmcache_nocache": {"w": swept([(0.5, 0.9), (1.0, 0.1)])},
                   "mmcache": {"w": swept([(0.5, 1.0), (1.0, 1.0)])}}]
    result = {"engines": {e: {"w": summary.combine([per_repeat[0][e]["w"]])} for e in per_repeat[0]},
              "mmcache_over": {"w": summary.ratios(per_repeat, "w")}}
    (row,) = [r for r in serve.open_loop_rows(result) if r.metric.startswith("goodput")]
    assert row.metric == "goodput, w (90% within SLOs; 0: no rate) [rests on one ladder step]"
    assert row.paired is None and row.ratio == 2.0


def test_rates_near_the_line_are_factors_of_the_goodput_rate_not_yet_swept():
    rows = swept([(0.25, 1.0), (0.5, 0.95), (1.0, 0.5)])["rates"]
    assert sweep.near_line_rates(rows, (0.75, 1.5)) == [0.375, 0.75]
    assert sweep.near_line_rates(rows, (0.5, 2.0)) == []  # 0.25 and 1 are swept already
    assert sweep.near_line_rates(rows, (1.5, 1.5)) == [0.75]
    assert sweep.near_line_rates(swept([(0.5, 0.3)])["rates"], (0.75, 1.5)) == []  # no goodput: nothing to refine
    assert sweep.near_line_rates(rows, ()) == []


def test_the_sweep_adds_the_rates_near_the_line_with_the_next_salts():
    """Over a stub server that always meets the SLOs: the ladder, then 0.75x and 1.5x its top, salted after it."""
    import httpx2
    import openai

    from tests.test_loadgen import StubCompletions

    app = StubCompletions(per_chunk=False)
    plan = serve.sw.shared_prefix(serve.sw.TokenSpace(2, 512), 0, 1, 3, 4, 2, 3)
    work = sweep.Workload("shared_prefix", "requests/s", plan.sessions, lambda rate: 2, {"max_tokens": 3})
    target = sweep.Target("stub", "http://stub/v1", "m")

    async def go(monkeyed):
        monkeyed.setattr(sweep, "client", lambda url: openai.AsyncOpenAI(
            base_url=url, api_key="k", max_retries=0,
            http_client=httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app))))
        return await sweep.sweep(target, work, [200.0, 400.0], {"ttft_s": 60.0, "tpot_s": 60.0}, 7, 30.0,
                                 floor=100.0, between=(0.75, 1.5))

    with pytest.MonkeyPatch.context() as mp:
        out = asyncio.run(go(mp))
    assert [(r["rate"], r["step"]) for r in out["rates"]] == [(200.0, "ladder"), (300.0, "near line"),
                                                              (400.0, "ladder"), (600.0, "near line")]
    assert out["goodput_rps"] == 600.0
    salts = [b["cache_salt"] for b in app.bodies]
    assert salts == [f"serve-shared_prefix-7-{k}" for k in range(4) for _ in range(2)]


def test_the_peer_configurations_are_vllms_defaults_and_the_tuned_budget():
    args = bench_parser("serve", serve).parse_args(["--quick"])
    serve.settle(args)
    (defaults,) = vllm.peer_configs(args)
    assert (defaults.engine, defaults.max_num_batched_tokens, defaults.max_num_seqs) == ("vllm_cpu", 2048, 128)
    args.peer_batched_tokens = 256
    assert [(c.engine, c.max_num_batched_tokens) for c in vllm.peer_configs(args)] == [("vllm_cpu", 2048),
                                                                                       ("vllm_cpu_tuned", 256)]
    args.peers = True
    assert ol.engine_names(args) == ["mmcache_nocache", "mmcache", "vllm_cpu", "vllm_cpu_tuned"]
    log = "INFO ... Chunked prefill is enabled with max_num_batched_tokens=2048.\nmore"
    assert vllm.chunked_prefill_tokens(log) == 2048 and vllm.chunked_prefill_tokens("nothing") is None


def test_the_tuning_sweep_picks_the_best_budget():
    by = [{"max_num_batched_tokens": 2048, "goodput_rps": 0.5, "attainment": [0.95, 0.6]},
          {"max_num_batched_tokens": 256, "goodput_rps": 1.0, "attainment": [0.97, 0.91]},
          {"max_num_batched_tokens": 512, "goodput_rps": 1.0, "attainment": [0.99, 0.93]},
          {"max_num_batched_tokens": 128, "goodput_rps": None, "attainment": [0.5, None]}]
    assert vllm.best_batched_tokens(by) == 512  # equal goodput: the higher mean attainment
    by[2]["attainment"] = [0.97, 0.91]
    assert vllm.best_batched_tokens(by) == 256  # equal on both: the smaller budget
    assert vllm.best_batched_tokens(by[3:]) == 128


def test_the_quick_configuration_can_show_a_finite_ratio():
    """The quick ladder has a rate below the top, so an engine that meets the SLOs only there still has a goodput:
    with cache on meeting them at every quick rate and cache off only at the lowest, the table prints a finite
    ratio on vlm_chat and multi_turn."""
    args = bench_parser("serve", serve).parse_args(["--quick"])
    serve.settle(args)
    assert len(args.rates) >= 2 and args.load_repeats == 1 and args.near_line == ()
    low = min(args.rates)
    assert ol.per_rate(args, low, 99) == 1 < ol.per_rate(args, max(args.rates), 99)  # one session: no overlap
    per_repeat = [{"mmcache_nocache": {w: swept([(r, 1.0 if r == low else 0.5) for r in args.rates])
                                       for w in ("vlm_chat", "multi_turn")},
                   "mmcache": {w: swept([(r, 1.0) for r in args.rates]) for w in ("vlm_chat", "multi_turn")}}]
    result = {"engines": {e: {w: summary.combine([per_repeat[0][e][w]]) for w in per_repeat[0][e]}
                          for e in per_repeat[0]},
              "mmcache_over": {w: summary.ratios(per_repeat, w) for w in ("vlm_chat", "multi_turn")}}
    for w in ("vlm_chat", "multi_turn"):
        (row,) = [r for r in serve.open_loop_rows(result) if r.metric.startswith(f"goodput, {w} ")]
        assert row.ratio == max(args.rates) / low and row.ratio > 1


def test_the_plot_draws_one_line_per_repeat():
    from benchmarks.serve_plot import by_repeat

    rows = [{"rate": 1.0, "repeat": 1}, {"rate": 0.5, "repeat": 0}, {"rate": 2.0, "repeat": 1}, {"rate": 0.25}]
    assert by_repeat(rows) == [[{"rate": 0.25}, {"rate": 0.5, "repeat": 0}],
                               [{"rate": 1.0, "repeat": 1}, {"rate": 2.0, "repeat": 1}]]


def test_repeat_options_fill_from_quick_and_full():
    args = bench_parser("serve", serve).parse_args([])
    serve.settle(args)
    assert (args.load_repeats, args.near_line, args.peer_batched_tokens, args.tune_peer) == (3, (0.75, 1.5), None,
                                                                                             None)
    args = bench_parser("serve", serve).parse_args(["--quick", "--load-repeats", "2", "--near-line", "0.5,3"])
    serve.settle(args)
    assert (args.load_repeats, args.near_line) == (2, (0.5, 3.0))
    args = bench_parser("serve", serve).parse_args(["--near-line", "none"])
    serve.settle(args)
    assert args.near_line == ()


def test_tune_peer_takes_its_own_rates_and_needs_a_text_workload(monkeypatch):
    import sys

    monkeypatch.setenv("VLLM_PEER_PYTHON", sys.executable)  # settle only checks that it runs
    args = bench_parser("serve", serve).parse_args(["--tune-peer", "256,2048"])
    serve.settle(args)
    assert args.tune_peer == [256, 2048] and args.rates == serve.rates_list(vllm.TUNE_RATES)
    args = bench_parser("serve", serve).parse_args(["--tune-peer", "512", "--rates", "2"])
    serve.settle(args)
    assert args.rates == [2.0]
    args = bench_parser("serve", serve).parse_args(["--tune-peer", "512", "--workloads", "vlm_chat"])
    with pytest.raises(serve.WorkloadShapeError, match="names none of"):
        serve.settle(args)
    args = bench_parser("serve", serve).parse_args(["--peer-batched-tokens", "512"])
    with pytest.raises(serve.WorkloadShapeError, match="give --peers too"):
        serve.settle(args)
    for options in (["--vllm-client"], ["--vllm-client", "--peers", "--workloads", "vlm_chat"]):
        args = bench_parser("serve", serve).parse_args(options)
        with pytest.raises(serve.WorkloadShapeError, match="--vllm-client drives the text servers"):
            serve.settle(args)
    args = bench_parser("serve", serve).parse_args(["--vllm-client", "--peers", "--workloads", "multi_turn"])
    serve.settle(args)
    assert args.vllm_client


def test_tune_peer_without_the_vllm_environment_is_refused(monkeypatch, capsys):
    monkeypatch.delenv("VLLM_PEER_PYTHON", raising=False)
    assert cli_main(["bench", "serve", "--quick", "--tune-peer", "256"]) == 2
    assert "VllmUnavailable" in capsys.readouterr().err


def test_vllm_serves_vlm_chat_from_the_vlm_folder_and_the_text_workloads_from_the_text_folder(monkeypatch):
    from types import SimpleNamespace

    calls = []

    def fake_sweep_peer(args, config, folder, model_name, dtype, works, slo, per, seed, tmp, extra_rates=True,
                        images_per_prompt=1, after=None):
        calls.append((config.engine, folder, model_name, dtype, [w.name for w in works], images_per_prompt))
        if after is not None:
            after("http://127.0.0.1:1/v1", config.engine, model_name)
        return {"folder": folder}

    monkeypatch.setattr(vllm, "sweep_peer", fake_sweep_peer)
    args = SimpleNamespace(peer_batched_tokens=512, preset="bench-llava", dtype="bfloat16", text_preset="small",
                           text_dtype="bfloat16")
    works = {w: SimpleNamespace(name=w) for w in ("vlm_chat", "multi_turn")}
    plan = [SimpleNamespace(new_images={0: b"a", 2: b"b"}), SimpleNamespace(new_images={0: b"c"})]
    folders = {"text": "TEXT", "vlm": "VLM"}
    driven = []
    ran = ol._sweep_vllm("vllm_cpu_tuned", args, folders, works, ["multi_turn"], plan, {}, {}, 3, "tmp",
                         lambda *a: driven.append(a))
    assert driven == [("http://127.0.0.1:1/v1", "vllm_cpu_tuned", "small")]  # vLLM's client: the text server only
    assert calls == [("vllm_cpu_tuned", "TEXT", "small", "bfloat16", ["multi_turn"], 1),
                     ("vllm_cpu_tuned", "VLM", "bench-llava", "bfloat16", ["vlm_chat"], 2)]
    assert ran == {"text": {"folder": "TEXT"}, "vlm": {"folder": "VLM"}}
    calls.clear()
    ol._sweep_vllm("vllm_cpu", args, folders, {"multi_turn": works["multi_turn"]}, ["multi_turn"], None, {}, {}, 3,
                   "tmp")
    assert [c[1] for c in calls] == ["TEXT"]  # no vlm_chat: no VLM server



def test_vllm_clients_figures_are_kept_per_engine_and_summarised_by_median(monkeypatch, tmp_path):
    from types import SimpleNamespace

    import benchmarks.peers.vllm_bench_client as client

    seen = []

    def fake_run(base_url, model, folder, result_path, shape):
        seen.append((base_url, model, folder, shape.seed))
        return {"ttft_median_ms": 10.0 * (len(seen)), "ttft_p99_ms": 50.0, "tpot_median_ms": 5.0}

    monkeypatch.setattr(client, "run", fake_run)
    assert ol.vllm_client(SimpleNamespace(vllm_client=False), {}, "F", str(tmp_path), 0) is None
    clients: dict = {}
    for seed in (0, 1, 2):
        drive = ol.vllm_client(SimpleNamespace(vllm_client=True), clients, "F", str(tmp_path), seed)
        drive("http://127.0.0.1:1/v1", "mmcache", "small")
    assert [s[3] for s in seen] == [0, 1, 2] and {s[2] for s in seen} == {"F"}
    rows = {r.metric: r.value for r in serve.vllm_client_rows({"vllm_client": clients})}
    assert rows["vllm bench serve (prefix_repetition) on mmcache: ttft_median_ms"] == 20.0
    assert rows["vllm bench serve (prefix_repetition) on mmcache: ttft_p99_ms"] == 50.0
