"""The prefix benchmark's workload shapes, the round driver every engine shares, and the figures it computes."""

import json
import random
import statistics
from collections import Counter

import pytest

from benchmarks import prefix, prefix_figures, prefix_table
from benchmarks import text_workloads as tw
from benchmarks.peers import protocol
from benchmarks.peers.protocol import Record, Request, RoundResult, Workload, WorkloadFormatError
from benchmarks.runner import bench_parser

SPACE = tw.TokenSpace(3, 5000)


def test_probe_shape():
    w = tw.probe(SPACE, seed=7, prompt_len=256, shared_len=192)
    (cold,), (same,), (shared,), (cold2,) = w.rounds
    assert [len(r.tokens) for r in (cold, same, shared, cold2)] == [256] * 4
    assert same.tokens == cold.tokens
    assert shared.tokens[:192] == cold.tokens[:192] and shared.tokens[192:] != cold.tokens[192:]
    assert cold2.tokens[:16] != cold.tokens[:16]
    assert all(r.max_tokens == 1 for rnd in w.rounds for r in rnd)
    assert all(SPACE.low <= t < SPACE.high for rnd in w.rounds for r in rnd for t in r.tokens)
    assert tw.probe(SPACE, seed=7, prompt_len=256, shared_len=192) == w
    assert tw.probe(SPACE, seed=8, prompt_len=256, shared_len=192).rounds[0][0].tokens != cold.tokens
    with pytest.raises(tw.WorkloadShapeError):
        tw.probe(SPACE, 0, prompt_len=128, shared_len=128)


def test_vllm_prefix_caching_shape():
    w = tw.vllm_prefix_caching(SPACE, 1, prefix_len=100, input_range=(130, 160), num_prompts=5, repeat_count=3,
                               output_len=10)
    (rnd,) = w.rounds
    assert len(rnd) == 15
    prefix = rnd[0].tokens[:100]
    assert all(r.tokens[:100] == prefix and 130 <= len(r.tokens) <= 160 and r.max_tokens == 10 for r in rnd)
    counts = Counter(r.tokens for r in rnd)
    assert len(counts) == 5 and set(counts.values()) == {3}
    # shuffled: the three copies of a prompt are not all adjacent for every prompt
    groups = [r.tokens for r in rnd]
    assert any(groups[i] != groups[i + 1] and groups[i] in groups[i + 2:] for i in range(len(groups) - 2))
    for bad in [dict(prefix_len=130, input_range=(130, 160)), dict(prefix_len=10, input_range=(160, 130))]:
        with pytest.raises(tw.WorkloadShapeError):
            tw.vllm_prefix_caching(SPACE, 1, num_prompts=2, repeat_count=2, **bad)


def test_generated_shared_prefix_shape():
    w = tw.generated_shared_prefix(SPACE, 2, num_groups=3, prompts_per_group=4, system_prompt_len=64,
                                   question_len=16, output_len=5)
    (rnd,) = w.rounds
    assert len(rnd) == 12 and all(len(r.tokens) == 80 and r.max_tokens == 5 for r in rnd)
    systems = Counter(r.tokens[:64] for r in rnd)
    assert len(systems) == 3 and set(systems.values()) == {4}
    assert len({r.tokens[64:] for r in rnd}) == 12
    with pytest.raises(tw.WorkloadShapeError):
        tw.generated_shared_prefix(SPACE, 2, 0, 4, 64, 16, 5)


def test_multi_turn_configuration_is_read_from_the_dataset():
    shape = tw.MultiTurnShape.load()
    assert shape.num_conversations == 24
    assert (shape.num_messages.low, shape.num_messages.high) == (12, 18)
    assert shape.common_prefix == tw.Distribution("constant", value=500)
    assert (shape.conversation_prefix.kind, shape.conversation_prefix.average, shape.conversation_prefix.cap) == \
        ("lognormal", 1000.0, 5000)
    assert (shape.user_tokens.low, shape.user_tokens.high) == (120, 160)
    assert (shape.answer_tokens.low, shape.answer_tokens.high) == (80, 120)


def test_multi_turn_shape_and_sessions():
    shape = tw.MultiTurnShape.load()
    w = tw.multi_turn(shape, SPACE, seed=3)
    params = w.params
    assert params["num_conversations"] == 24 and all(6 <= t <= 9 for t in params["user_turns"])
    assert len(w.rounds) == max(params["user_turns"])
    first = {r.session: r for r in w.rounds[0]}
    assert len(first) == 24
    common = w.rounds[0][0].tokens[:500]
    for c, r in enumerate(w.rounds[0]):
        own = params["conversation_prefix_lens"][c]
        assert r.tokens[:500] == common
        assert 120 <= len(r.tokens) - 500 - own <= 160
    later = [r for rnd in w.rounds[1:] for r in rnd]
    assert all(120 <= len(r.tokens) <= 160 and r.session in first for r in later)
    assert all(80 <= r.max_tokens <= 120 for rnd in w.rounds for r in rnd)
    lens = params["conversation_prefix_lens"]
    assert max(lens) <= 5000
    if max(lens) < 5000:  # rescaled to the configured average, as vLLM's generator does
        assert abs(sum(lens) / len(lens) - 1000) < 1
    cut = tw.multi_turn(shape, SPACE, seed=3, num_conversations=3, max_user_turns=2, max_answer_tokens=16)
    assert len(cut.rounds) == 2 and len(cut.rounds[0]) == 3
    assert all(r.max_tokens == 16 for rnd in cut.rounds for r in rnd)


def test_multi_turn_configuration_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(tw.WorkloadShapeError):
        tw.MultiTurnShape.load(bad)
    spec = json.loads(tw.MULTI_TURN_SPEC.read_text())
    spec["prompt_input"]["num_tokens"] = {"distribution": "zipf", "alpha": 2}
    bad.write_text(json.dumps(spec))
    with pytest.raises(tw.WorkloadShapeError, match="unsupported distribution"):
        tw.MultiTurnShape.load(bad)
    spec["prompt_input"]["num_tokens"] = {"distribution": "uniform", "min": 10, "max": 5}
    bad.write_text(json.dumps(spec))
    with pytest.raises(tw.WorkloadShapeError):
        tw.MultiTurnShape.load(bad)
    d = tw.Distribution.from_json({"distribution": "lognormal", "mean": 3, "sigma": 0.5, "max": 30}, "x")
    assert all(0 <= v <= 30 for v in d.sample(random.Random(0), 200))


class EchoEngine:
    """A stand-in engine: output token i of a request is (prompt length + i) mod 97; times are fixed steps."""

    def __init__(self):
        self.prompts = []

    def run_round(self, ids, prompts, max_tokens):
        self.prompts.append([list(p) for p in prompts])
        out = []
        for rid, p, n in zip(ids, prompts, max_tokens):
            toks = [(len(p) + i) % 97 for i in range(n)]
            times = [1.0 + 0.5 + 0.1 * i for i in range(n)]
            out.append(Record(rid, len(p), toks, 1.0, times[0], times, len(p) // 2))
        return out


def test_play_builds_session_prompts_from_outputs():
    w = Workload("chat", (
        (Request("a0", (1, 2, 3), 2, "A"), Request("b0", (9,), 1, "B"), Request("x", (5, 5), 1)),
        (Request("a1", (4,), 3, "A"),),
        (Request("a2", (6, 7), 1, "A"), Request("b1", (8,), 1, "B")),
    ))
    eng = EchoEngine()
    results = protocol.play(w, eng.run_round)
    a0 = [1, 2, 3] + [3 % 97, 4 % 97]
    a1 = a0 + [4] + [6, 7, 8]
    assert eng.prompts[0] == [[1, 2, 3], [9], [5, 5]]
    assert eng.prompts[1] == [a0 + [4]]
    assert eng.prompts[2] == [a1 + [6, 7], [9, 1, 8]]
    assert [len(r.records) for r in results] == [3, 1, 2]


def test_play_rejects_wrong_answers_and_bad_workloads():
    w = Workload("w", ((Request("r", (1, 2), 2),),))

    def short(ids, prompts, max_tokens):
        return [Record(ids[0], 2, [1], 0.0, 0.1, [0.1], 0)]

    def other(ids, prompts, max_tokens):
        return [Record("zzz", 2, [1, 2], 0.0, 0.1, [0.1, 0.2], 0)]

    for run_round in (short, other):
        with pytest.raises(WorkloadFormatError):
            protocol.play(w, run_round)
    with pytest.raises(WorkloadFormatError):
        Request("e", (), 1)
    with pytest.raises(WorkloadFormatError):
        Request("e", (1,), 0)
    with pytest.raises(WorkloadFormatError):
        Workload("dup", ((Request("a", (1,), 1),), (Request("a", (2,), 1),)))
    twice = Workload("t", ((Request("a", (1,), 1, "S"), Request("b", (2,), 1, "S")),))
    with pytest.raises(WorkloadFormatError):
        protocol.play(twice, EchoEngine().run_round)


def test_json_round_trip():
    w = tw.vllm_prefix_caching(SPACE, 4, 8, (10, 12), 2, 2, 3)
    assert protocol.workload_from_json(json.loads(json.dumps(protocol.workload_to_json(w)))) == w
    rr = [RoundResult([Record("a", 3, [1, 2], 0.5, 0.75, [0.75, 1.0], 2)], 0.6)]
    back = protocol.results_from_json(json.loads(json.dumps(protocol.results_to_json(rr))))
    assert back == rr
    with pytest.raises(WorkloadFormatError):
        protocol.workload_from_json({"rounds": []})
    with pytest.raises(WorkloadFormatError):
        protocol.results_from_json([{"records": [{"id": "a"}], "wall_s": 1}])


def test_summaries():
    recs = [Record("a", 100, [1, 2, 3], 0.0, 0.5, [0.5, 0.6, 0.8], 50),
            Record("b", 300, [1, 2], 0.0, 1.5, [1.5, 1.6], 0)]
    s = prefix_figures.summarize([RoundResult(recs, 2.5)])
    assert s["ttft_p50_s"] == pytest.approx(1.0) and s["ttft_p90_s"] == pytest.approx(1.4)
    assert s["itl_p50_s"] == pytest.approx(0.1)
    assert s["throughput_tok_s"] == pytest.approx(5 / 2.5)
    assert s["matched_share"] == pytest.approx(50 / 400)
    assert prefix_figures.percentile([], 50) is None and prefix_figures.percentile([3.0], 90) == 3.0
    one = lambda wall, ttft, m: RoundResult([Record("p", 8, [1], 0.0, ttft, [ttft], m)], wall)
    probe = prefix_figures.summarize_probe([[one(4, 3.9, 0), one(1, 0.9, 6), one(1, 0.8, 6), one(4, 4, 0)],
                                    [one(6, 5.9, 0), one(2, 1.9, 6), one(1, 0.7, 6), one(5, 5, 0)],
                                    [one(5, 4.9, 0), one(3, 2.9, 6), one(1, 0.6, 6), one(3, 3, 0)]])
    assert (probe["cold_s"], probe["same_s"], probe["shared1920_s"], probe["cold2_s"]) == (5, 2, 1, 4)
    assert probe["repeats"][1]["same_matched"] == 6
    assert probe["figure"].endswith("median of 3")


def test_the_probe_figure_is_the_same_span_for_every_engine():
    """Every engine's probe figure is the round's wall time less the span between its request's first and last
    token stamps: a one-token request's wall time (mmcache, vLLM); a two-token request's (transformers) less its
    second token's step. Never an engine's own first-token stamp minus its arrival stamp, which leaves out what
    the wall time holds (building the request, handing it over, the record), so it would flatter that engine."""
    def rnd(wall, arrival, *stamps):
        return RoundResult([Record("p", 8, [1] * len(stamps), arrival, stamps[0], list(stamps), 0)], wall)

    one = [rnd(4.0, 10.0, 13.5), rnd(0.5, 20.0, 20.3), rnd(0.5, 30.0, 30.3), rnd(4.0, 40.0, 43.5)]
    two = [rnd(4.2, 10.0, 13.5, 13.7), rnd(0.7, 20.0, 20.3, 20.5), rnd(0.6, 30.0, 30.3, 30.4),
           rnd(4.0, 40.0, 43.5, 43.5)]
    a = prefix_figures.summarize_probe([one])
    b = prefix_figures.summarize_probe([two], prefix_figures.ProbeMethod(2))
    assert [a[k] for k in prefix_figures.PROBE_KEYS] == pytest.approx([4.0, 0.5, 0.5, 4.0])
    assert [b[k] for k in prefix_figures.PROBE_KEYS] == pytest.approx([4.0, 0.5, 0.5, 4.0])
    rep = b["repeats"][0]  # the round's wall time and the engine's own stamps stay on record beside the figure
    assert rep["same_wall_s"] == 0.7 and rep["same_ttft_s"] == pytest.approx(0.3)
    assert rep["same_s"] == pytest.approx(0.5)
    assert b["figure"].startswith("wall time of a round of one 2-token request") and "single value" in b["figure"]


def test_better_by_is_the_median_of_peer_over_mmcache():
    """With an even count of repeats the median is a mean, and the mean of ratios is not the inverse of the mean
    of their inverses: mmcache over peer 0.5 and 2.0 (median 1.25) is peer over mmcache 2.0 and 0.5 (median
    1.25), where the inverse of the first median would say 0.8."""
    def probe(colds):
        reps = [{"cold_s": c, "same_s": c / 10} for c in colds]
        return {"cold_s": statistics.median(colds), "same_s": statistics.median(colds) / 10, "shared1920_s": 0.1,
                "cold2_s": 1.0, "repeats": reps}

    def workload(ttfts):
        return {"ttft_p50_s": statistics.median(ttfts), "ttft_p90_s": 1.0, "itl_p50_s": 0.1,
                "throughput_tok_s": 10.0, "matched_share": 0.5,
                "by_repeat": [{"ttft_p50_s": t, "itl_p50_s": 0.1, "throughput_tok_s": 10.0} for t in ttfts]}

    engines = {"mmcache": {"probe": probe([1.0, 4.0]), "multi_turn": workload([1.0, 4.0])},
               "vllm_cpu": {"probe": probe([2.0, 2.0]), "multi_turn": workload([2.0, 2.0])}}
    over = prefix_figures.paired_probe(engines)["mmcache"]["over_vllm_cpu"]["cold"]
    assert over["runs"] == [0.5, 2.0] and over["statistic"] == "mean of 2"
    assert prefix_figures.better_by(over) == pytest.approx(1.25)
    rows = {(r.metric, r.versus): r for r in prefix_table.table_rows({"bit_exact": True, "engines": engines})}
    assert rows[("probe: cold TTFT (paired: mean of 2)", "vLLM CPU")].ratio == pytest.approx(1.25)
    assert rows[("multi_turn: TTFT p50 (paired: mean of 2)", "vLLM CPU")].ratio == pytest.approx(1.25)
    paired = prefix_figures.paired_workloads(engines)
    assert paired["over_vllm_cpu"]["multi_turn"]["ttft_p50"]["statistic"] == "mean of 2"
    # A repeat missing a figure on one side is no pair: the row says what its figure rests on, not how many
    # repeats mmcache played (it said "mean of 2" for one pair).
    engines["mmcache"]["multi_turn"]["by_repeat"][1]["itl_p50_s"] = None
    names = [r.metric for r in prefix_table.table_rows({"bit_exact": True, "engines": engines})]
    assert "multi_turn: ITL p50 (paired: the single value)" in names
    assert "multi_turn: TTFT p50 (paired: mean of 2)" in names


def test_quick_mode_takes_a_true_median_of_its_probe_repeats():
    """statistics.median of two repeats is their mean; quick mode's probe has an odd count."""
    assert prefix.QUICK.probe_repeats % 2 == 1 and prefix.FULL.probe_repeats % 2 == 1
    assert [prefix_figures.middle_of(n) for n in (1, 2, 3, 4)] == ["the single value", "mean of 2", "median of 3",
                                                          "median of 4"]


def test_token_space_avoids_special_tokens(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 1000}))
    tok = {"model": {"vocab": {f"t{i}": i for i in range(600)}},
           "added_tokens": [{"id": 0}, {"id": 1}, {"id": 2}, {"id": 600}, {"id": 601}]}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    assert prefix.token_space(str(tmp_path)) == tw.TokenSpace(3, 600)


def test_shape_and_engine_options():
    parser = bench_parser("prefix", prefix)
    args = parser.parse_args(["--quick", "--vpc-input-range", "10:20", "--gsp-num-groups", "5"])
    shape = prefix.shape_from_args(args)
    assert shape.vpc_input_range == (10, 20) and shape.gsp_num_groups == 5
    assert shape.vpc_prefix_len == prefix.QUICK.vpc_prefix_len
    assert prefix.engines_from_args(args) == ["mmcache", "mmcache_nocache"]
    full = parser.parse_args([])
    assert prefix.shape_from_args(full) == prefix.FULL
    assert prefix.engines_from_args(full) == ["mmcache", "mmcache_nocache", "transformers_cb"]
    assert prefix.engines_from_args(parser.parse_args(["--peers"]))[-1] == "vllm_cpu"
    with pytest.raises(tw.WorkloadShapeError):
        prefix.shape_from_args(parser.parse_args(["--vpc-input-range", "10-20"]))
    with pytest.raises(tw.WorkloadShapeError):
        prefix.engines_from_args(parser.parse_args(["--engines", "mmcache,sglang"]))
