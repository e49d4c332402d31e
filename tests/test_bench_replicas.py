"""``mmcache bench serve --replicas``: its options and refusals, the summary and ratio arithmetic on canned sweeps,
and the ``hot_prefix`` and image-chat workloads' shapes. No Ray here (the live tests are elsewhere)."""

from __future__ import annotations

import pytest

import benchmarks.serve as serve
import benchmarks.serve_replicas as rep
import benchmarks.serve_workloads as sw
from benchmarks.runner import bench_parser
from benchmarks.text_workloads import TokenSpace

SPACE = TokenSpace(10, 1000)


def settled(*argv: str):
    args = bench_parser("serve", serve).parse_args(list(argv))
    serve.settle(args)
    return args


def test_replicas_take_their_own_sizes_and_options_win():
    args = settled("--replicas", "2")
    assert args.routers == ["mmcache", "power-of-two", "prefix-text"]
    assert args.workloads == ["vlm_chat", "multi_turn", "hot_prefix"]
    assert (args.preset, args.text_preset, args.rates, args.load_repeats) == ("tiny-llava", "tiny", [1.0, 2.0, 4.0], 1)
    assert args.min_rate == 1.0 and args.near_line == () and args.soak == 0 and args.no_generation
    from mmcache.replicas.launch import ReplicaOptions

    assert args.route_depth_tokens == ReplicaOptions(1).route_depth_tokens and args.replica_slo == "power-of-two"
    args = settled("--replicas", "3", "--routers", "power-of-two,mmcache", "--workloads", "hot_prefix",
                   "--load-repeats", "3", "--rates", "4", "--route-depth-tokens", "64", "--replica-slo", "single")
    assert (args.replicas, args.routers, args.workloads, args.load_repeats, args.rates, args.route_depth_tokens,
            args.replica_slo) == (3, ["power-of-two", "mmcache"], ["hot_prefix"], 3, [4.0], 64, "single")
    assert settled("--replicas", "2", "--quick").rates == [1.0]
    assert settled("--replicas", "2").prefix_text_imbalance is None
    assert settled("--replicas", "2", "--prefix-text-imbalance", "10").prefix_text_imbalance == 10.0
    assert serve.run_config(settled("--quick"))["replicas"] is None


@pytest.mark.parametrize("argv", [["--replicas", "2", "--routers", "random"],
                                  ["--replicas", "2", "--routers", "mmcache,mmcache"],
                                  ["--replicas", "2", "--routers", ""],
                                  ["--replicas", "0"],
                                  ["--replicas", "2", "--replica-slo", "vllm"],
                                  ["--replicas", "2", "--prefix-text-imbalance", "-1"],
                                  ["--replicas", "2", "--prefix-text-imbalance", "inf"],
                                  ["--workloads", "hot_prefix,hot_prefix"]])
def test_bad_values_are_refused_by_the_parser(argv):
    with pytest.raises(SystemExit):
        bench_parser("serve", serve).parse_args(argv)


@pytest.mark.parametrize("argv, words", [
    (["--routers", "mmcache"], "--routers"),
    (["--route-depth-tokens", "64"], "--route-depth-tokens"),
    (["--ray-address", "auto"], "--ray-address"),
    (["--replica-slo", "single"], "--replica-slo"),
    (["--prefix-text-imbalance", "10"], "--prefix-text-imbalance"),
    (["--replicas", "2", "--routers", "mmcache", "--prefix-text-imbalance", "10"], "prefix-text"),
    (["--workloads", "hot_prefix"], "replicas only"),
    (["--replicas", "2", "--peers"], "--peers"),
    (["--replicas", "2", "--soak", "10"], "--soak"),
    (["--replicas", "2", "--plot", "x.png"], "--plot"),
    (["--replicas", "2", "--near-line", "0.75"], "--near-line"),
    (["--replicas", "2", "--min-rate", "0.1"], "--min-rate"),
    (["--replicas", "2", "--no-load"], "--no-load"),
])
def test_options_that_make_no_sense_together_are_refused(argv, words):
    args = bench_parser("serve", serve).parse_args(argv)
    with pytest.raises(serve.WorkloadShapeError, match=words):
        serve.settle(args)


def test_hot_prefix_puts_the_asked_share_of_sessions_on_one_system_prompt():
    plan = sw.hot_prefix(SPACE, 7, 20, 3, 64, 8, 4, hot_share=0.8)
    firsts = [tuple(s[0][:64]) for s in plan.turns]
    hot = max(set(firsts), key=firsts.count)
    assert firsts.count(hot) == 16 and len(set(firsts)) == 1 + 4  # the four others each have their own
    assert sorted(i for i, f in enumerate(firsts) if f == hot) == plan.params["hot_sessions"]
    assert all(len(s) == 3 and len(s[0]) == 64 + 8 and len(s[1]) == len(s[2]) == 8 for s in plan.turns)
    assert plan.max_tokens == [[4, 4, 4]] * 20 and plan.unit == "sessions"
    assert all(SPACE.low <= t < SPACE.high for s in plan.turns for turn in s for t in turn)
    again = sw.hot_prefix(SPACE, 7, 20, 3, 64, 8, 4, hot_share=0.8)
    other = sw.hot_prefix(SPACE, 8, 20, 3, 64, 8, 4, hot_share=0.8)
    assert again.turns == plan.turns and other.turns != plan.turns
    assert len({tuple(s[0][:64]) for s in sw.hot_prefix(SPACE, 7, 5, 1, 16, 4, 4, hot_share=0.0).turns}) == 5
    with pytest.raises(sw.WorkloadShapeError):
        sw.hot_prefix(SPACE, 7, 5, 1, 16, 4, 4, hot_share=1.5)


def test_image_chats_differ_only_in_their_images():
    args = settled("--replicas", "2", "--turns", "2")
    chats = rep.image_chats(args, 5, seed=0)
    assert len({c.new_images[0] for c in chats}) == 5
    assert all(c.system == "" and c.questions == chats[0].questions and list(c.new_images) == [0] for c in chats)
    work = rep.vlm_workload(args, seed=0)
    sessions = work.make({"model": "m"}, 3)
    assert [s.history for s in sessions] == [[], [], []]
    texts = [[p for p in s.turns[0]["content"] if p["type"] == "text"] for s in sessions]
    images = [[p for p in s.turns[0]["content"] if p["type"] == "image_url"] for s in sessions]
    assert texts[0] == texts[1] == texts[2] and len({im[0]["image_url"]["url"] for im in images}) == 3


def sweep(matched: list[tuple[int, int]], goodput, p50: float, p99: float) -> dict:
    """A canned sweep: one row per (cached, prompt) pair at rates 1, 2, ...; the TTFTs at the top rate."""
    rows = [{"rate": float(i + 1), "cached_tokens": c, "prompt_tokens": p, "ttft_p50_s": 9.0, "ttft_p99_s": 9.0}
            for i, (c, p) in enumerate(matched)]
    rows[-1].update(ttft_p50_s=p50, ttft_p99_s=p99)
    return {"rates": rows, "goodput_rps": goodput, "failed_requests": 0,
            "goodput_by_tpot_times": {"2": goodput, "5": 2 * goodput if goodput else 0.5}}


def test_figures_summary_and_ratios_on_canned_sweeps():
    per_repeat = [
        {"mmcache": {"w": sweep([(50, 100), (150, 200)], 2.0, 0.1, 0.4)},
         "power-of-two": {"w": sweep([(25, 100), (25, 200)], 1.0, 0.2, 0.5)},
         "prefix-text": {"w": sweep([(0, 100), (0, 200)], None, 0.1, 0.8)}},
        {"mmcache": {"w": sweep([(100, 300)], 1.0, 0.3, 0.6)},
         "power-of-two": {"w": sweep([(100, 300)], 2.0, 0.3, 0.3)},
         "prefix-text": {"w": sweep([(30, 300)], 1.0, 0.1, 0.6)}},
        {"mmcache": {"w": sweep([(90, 300)], 4.0, 0.2, 0.5)},
         "power-of-two": {"w": sweep([(30, 300)], 4.0, 0.1, 1.0)},
         "prefix-text": {"w": sweep([(60, 300)], 0.5, 0.2, 0.5)}},
    ]
    figures = [{r: {w: rep.figures_of(s) for w, s in run.items()} for r, run in one.items()} for one in per_repeat]
    assert figures[0]["mmcache"]["w"]["matched_share"] == pytest.approx(200 / 300)
    assert figures[0]["mmcache"]["w"]["top_rate"] == 2.0 and figures[0]["mmcache"]["w"]["ttft_p99_s"] == 0.4
    summary = rep.summarise(figures)
    mine = summary["mmcache"]["w"]
    assert mine["matched_share"] == pytest.approx(1 / 3)  # median of 2/3, 1/3, 0.3
    assert (mine["goodput_rps"], mine["ttft_p50_s"], mine["ttft_p99_s"]) == (2.0, 0.2, 0.5)
    assert summary["prefix-text"]["w"]["goodput_rps"] == 0.5  # None counts as 0: median of 0, 1, 0.5
    assert summary["prefix-text"]["w"]["goodput_tpot5_rps"] == 1.0  # median of 0.5, 2, 1
    over = rep.ratios(figures)
    share = over["power-of-two"]["w"]["matched_share"]
    assert share["runs"] == pytest.approx([(2 / 3) / (1 / 6), 1.0, 3.0])
    assert (share["median"], share["min"], share["max"]) == (pytest.approx(3.0), pytest.approx(1.0),
                                                            pytest.approx(4.0))
    assert over["power-of-two"]["w"]["ttft_p99_s"]["runs"] == pytest.approx([0.8, 2.0, 0.5])
    good = over["prefix-text"]["w"]["goodput_rps"]
    assert good["runs"] == [None, 1.0, 8.0] and good["median"] == 4.5  # no ratio over a baseline without goodput
    assert over["prefix-text"]["w"]["matched_share"]["runs"][0] is None  # the baseline matched nothing


def test_rows_compare_mmcache_with_each_baseline():
    figures = [{"mmcache": {"w": rep.figures_of(sweep([(60, 100)], 2.0, 0.1, 0.2))},
                "power-of-two": {"w": rep.figures_of(sweep([(20, 100)], 1.0, 0.2, 0.4))}}]
    result = {"replicas": {"summary": rep.summarise(figures), "ratios": rep.ratios(figures),
                           "workloads": {"w": {"unit": "sessions/s"}}}}
    rows = {(r.metric, r.versus): r for r in rep.rows(result)}
    share = next(r for (m, v), r in rows.items() if "matched share" in m and v == "power-of-two")
    assert (share.value, share.baseline, share.ratio) == (0.6, 0.2, pytest.approx(3.0))
    p99 = next(r for (m, v), r in rows.items() if "p99" in m and v == "power-of-two")
    assert (p99.value, p99.baseline, p99.ratio, p99.unit) == (0.2, 0.4, pytest.approx(2.0), "s")  # better by 2x
    assert not any(v == "prefix-text" for _, v in rows)
    assert not any("busiest" in r.metric for r in rows.values())  # canned sweeps carry no replica counts
    alone = rep.rows({"replicas": dict(result["replicas"], summary={"power-of-two": rep.summarise(figures)
                                                                    ["power-of-two"]}, ratios={})})
    assert len(alone) == len(rep.METRICS) and all("power-of-two" in r.metric for r in alone)


def test_the_busiest_replicas_share_counts_the_sweeps_own_requests():
    swept = sweep([(1, 2), (1, 2)], 1.0, 0.1, 0.2)
    swept["before"] = {"requests_by_replica": {"a": 10.0, "b": 4.0}}
    swept["rates"][-1]["check"] = {"requests_by_replica": {"a": 40.0, "b": 14.0, "c": 10.0}}
    assert rep.busiest_share(swept) == pytest.approx(30 / 50)  # a served 30, b 10, c (new) 10
    del swept["before"]
    assert rep.busiest_share(swept) is None


def test_affinity_bounds_from_the_prompts_arithmetic():
    """One chat of two turns, pages of 2: turn 2 sends turn 1's 4 ids, its 2-token answer and 2 more (8 ids), of
    which 6 (3 pages) were held after turn 1 on its replica, 4 without the answer's page."""
    chat = [[[1, 2, 3, 4], [5, 6]]]
    answers = [[2, 2]]
    b = rep.affinity_bounds(chat, answers, page_size=2, replicas=2, draws=400)
    assert b["prompt_tokens"] == 12 and b["requests"] == 2
    assert b["one_replica"] == b["chat_affinity"] == 6 / 12
    assert b["random_min"] == 0 and b["random_max"] == 6 / 12 and 0.2 < b["random"] < 0.3  # half the time
    assert rep.affinity_bounds(chat, answers, 2, 2, answers_cached=False)["one_replica"] == 4 / 12
    # two one-turn chats on one shared page: one replica computes it once, chats dealt to two replicas twice
    shared = [[[7, 8, 1]], [[7, 8, 2]]]
    b = rep.affinity_bounds(shared, [[1], [1]], page_size=2, replicas=2)
    assert b["one_replica"] == 2 / 6 and b["chat_affinity"] == 0
    with pytest.raises(serve.WorkloadShapeError):
        rep.affinity_bounds(chat, answers, page_size=0, replicas=2)


def test_workload_bounds_weigh_each_rates_cold_sessions_and_show_as_a_row():
    from benchmarks.serve_sweep import Workload

    plan = sw.hot_prefix(SPACE, 0, 8, 3, 64, 16, 4, 1.0)  # every session on one system prompt
    work = Workload("hot_prefix", "sessions/s", plan.sessions, lambda rate: int(rate * 4), {})
    b = rep.workload_bounds(work, [1.0, 2.0], page_size=16, replicas=2, seed=0)
    one = rep.affinity_bounds(plan.turns[:4], plan.max_tokens[:4], 16, 2)
    two = rep.affinity_bounds(plan.turns[:8], plan.max_tokens[:8], 16, 2)
    assert b["one_replica"] == pytest.approx((one["one_replica"] * one["prompt_tokens"] + two["one_replica"]
                                              * two["prompt_tokens"]) / (one["prompt_tokens"] + two["prompt_tokens"]))
    assert b["one_replica"] >= b["chat_affinity"] > b["random"] and b["max_ratio"] == pytest.approx(
        b["one_replica"] / b["random"])
    result = {"replicas": {"summary": {}, "ratios": {}, "workloads": {}, "bounds": {"hot_prefix": b}}}
    (row,) = rep.rows(result)
    assert row.value == b["max_ratio"] and "hot_prefix" in row.metric
