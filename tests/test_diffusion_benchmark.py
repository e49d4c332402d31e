"""The diffusion benchmark's stream and a tiny end-to-end run of it (result shape, exact call counts)."""

from collections import Counter

import torch

from benchmarks import diffusion
from benchmarks.runner import bench_parser
from encoders.diffusion import CachedWanPipeline
from mmcache.presets.local_tokenizers import parti_prompts


def test_zipf_stream_is_seeded_and_skewed():
    prompts = parti_prompts()
    a = diffusion.zipf_stream(prompts, 400, 1.1, seed=3)
    assert a == diffusion.zipf_stream(prompts, 400, 1.1, seed=3)
    assert a != diffusion.zipf_stream(prompts, 400, 1.1, seed=4)
    counts = Counter(a).most_common()
    assert counts[0][1] >= 30 and len(counts) < 300  # the head repeats, the tail is long
    assert len(set(diffusion.zipf_stream(prompts, 400, 0.0, seed=3))) > len(counts)  # s = 0 is uniform


def test_a_tiny_run_reports_exact_calls_and_identical_outputs():
    before = torch.get_num_threads()
    args = bench_parser("diffusion", diffusion).parse_args(
        ["--requests", "5", "--runs", "1", "--steps", "1", "--no-estimate", "--zipf", "3"])
    result = diffusion.run(args)
    assert torch.get_num_threads() == before
    for mode, encoders in (("t2v", 1), ("t2i", 3)):
        r = result[mode]
        unique = r["stream"]["unique_prompts"]
        assert r["on"]["text_encoder_calls_per_encoder"] == [unique + 1] * encoders
        assert r["off"]["text_encoder_calls_per_encoder"] == [2 * 5] * encoders
        assert r["on"]["bit_identical"] and r["targets"]["calls_met"]
        assert r["targets"]["store_off_matches_pipeline_encode"]
        # every umT5 layer has a bias table, SD3's T5 one (layer 0's): each computed once, then served per forward
        owners = diffusion.BENCH_UMT5.num_layers if mode == "t2v" else 1
        assert r["on"]["position_biases"] == {"on": True, "served": (unique + 1) * owners, "computed": owners}
        kinds = r["on"]["store"]["kinds"]
        assert kinds["output"]["computes"] == (unique + 1) * encoders and kinds["position_bias"]["computes"] == owners
        assert r["on"]["tokenizations"] == (unique + 1) * encoders  # each text once per adapter
        assert r["on"]["tokenization_memo_hits"] == (2 * 5 - unique - 1) * encoders
        assert r["targets"]["text_encoder_time_cut_runs"] == [r["targets"]["text_encoder_time_cut"]]  # one run
        t = r["targets"]
        assert t["forward_cost_ratio"] > 0 and t["forward_cost_ratio_runs"] == [t["forward_cost_ratio"]]
        calls = r["on"]["text_encoder_calls"] / r["off"]["text_encoder_calls"]
        assert abs(t["text_encoder_paired_forward_time_cut"] - (1 - calls * t["forward_cost_ratio"])) < 1e-12
    assert {row.metric for row in diffusion.table_rows(result)} >= {
        "t2v text-encoder calls", "t2i latency p50", "t2i cost per forward, store on / off (paired by request)"}


def test_forward_cost_is_paired_by_request_and_skips_requests_without_forwards():
    # (forwards, seconds) per request: store off always encodes both prompts, store on only its misses
    off = [(2, 2.0), (2, 2.0), (2, 4.0), (2, 2.0)]
    on = [(2, 2.2), (0, 0.0), (1, 2.0), (1, 0.9)]
    # per-forward ratios of the requests that ran one: 1.1, 1.0, 0.9
    assert abs(diffusion.forward_cost_ratio(on, off) - 1.0) < 1e-12
    # one slow forward moves a sum, not the median
    assert abs(diffusion.forward_cost_ratio(on[:3] + [(1, 50.0)], off) - 1.1) < 1e-12
    assert diffusion.forward_cost_ratio([(0, 0.0)] * 4, off) is None


def test_the_text_encoder_size_is_chosen_and_recorded(monkeypatch):
    """``--text-encoder`` picks the umT5/T5 shape the pipelines are built with (here checked without building
    the large one: a stand-in shape of the same option) and the result records the choice."""
    parser = bench_parser("diffusion", diffusion)
    assert parser.parse_args([]).text_encoder == "bench"
    assert diffusion.TEXT_ENCODERS["large"].d_model > diffusion.TEXT_ENCODERS["bench"].d_model
    small = diffusion.UMT5Shape(d_model=48, num_layers=1, d_ff=64, num_heads=2, d_kv=24)
    monkeypatch.setitem(diffusion.TEXT_ENCODERS, "large", small)
    built = []
    real = diffusion.tiny_wan_pipeline
    monkeypatch.setattr(diffusion, "tiny_wan_pipeline", lambda preset: built.append(preset) or real(preset))
    args = parser.parse_args(["--requests", "2", "--runs", "1", "--steps", "1", "--no-estimate", "--modes", "t2v",
                              "--text-encoder", "large"])
    result = diffusion.run(args)
    assert built[0].text_encoder == small and result["t2v"]["shape"]["text_encoders"][0]["d_model"] == 48
    assert result["config"]["text_encoder"] == "large" and result["t2v"]["on"]["bit_identical"]


def test_both_sides_are_warmed_alike_by_throwaway_wrappers(monkeypatch):
    """Before the timed stream one request goes through a store-off and a store-on wrapper (so the store-on side
    does not pay its first call inside the stream); those wrappers and the warm-up's store are never timed, and
    every run times a fresh wrapper per side whose store starts empty: unique + 1 computes, as without warm-up."""
    events = []

    class Spy(CachedWanPipeline):
        def __call__(self, *args, **kwargs):
            events.append(("warm-up", self.store is None, self))  # held: no id is reused by a later wrapper
            return super().__call__(*args, **kwargs)

    serve = diffusion._Tally.serve

    def timed(tally, wrapper, *args):
        events.append(("timed", wrapper.store is None, wrapper))
        return serve(tally, wrapper, *args)

    monkeypatch.setattr(diffusion, "CachedWanPipeline", Spy)
    monkeypatch.setattr(diffusion._Tally, "serve", timed)
    args = bench_parser("diffusion", diffusion).parse_args(
        ["--requests", "3", "--runs", "2", "--steps", "1", "--no-estimate", "--zipf", "3", "--modes", "t2v"])
    r = diffusion.run(args)["t2v"]
    warm, rest = events[:2], events[2:]
    assert [off for _, off, _ in warm] == [True, False] and {kind for kind, _, _ in warm} == {"warm-up"}
    ids = lambda part: {id(w) for _, _, w in part}
    assert {kind for kind, _, _ in rest} == {"timed"} and not ids(warm) & ids(rest)
    per_run = [ids(rest[:6]), ids(rest[6:])]
    assert len(per_run[0]) == len(per_run[1]) == 2 and not per_run[0] & per_run[1]  # fresh wrappers per run
    assert r["on"]["store"]["kinds"]["output"]["computes"] == r["stream"]["unique_prompts"] + 1


def test_without_position_biases_the_store_keeps_prompt_outputs_only():
    args = bench_parser("diffusion", diffusion).parse_args(
        ["--requests", "3", "--runs", "1", "--steps", "1", "--no-estimate", "--zipf", "3", "--modes", "t2v",
         "--no-position-biases"])
    result = diffusion.run(args)
    r = result["t2v"]
    assert result["config"]["position_biases"] is False
    assert r["on"]["position_biases"] == {"on": False, "served": 0, "computed": 0}
    assert r["on"]["store"]["computes"] == r["stream"]["unique_prompts"] + 1 and r["on"]["bit_identical"]
    assert list(r["on"]["store"]["kinds"]) == ["output"]
