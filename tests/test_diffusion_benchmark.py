"""The diffusion benchmark's stream and a tiny end-to-end run of it (result shape, exact call counts)."""

from collections import Counter

import torch

from benchmarks import diffusion
from benchmarks.runner import bench_parser
from encoders.local_tokenizers import parti_prompts


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
        assert r["on"]["store"]["computes"] == (unique + 1) * encoders
        assert r["on"]["tokenizations"] == (unique + 1) * encoders  # each text once per adapter
        assert r["on"]["tokenization_memo_hits"] == (2 * 5 - unique - 1) * encoders
        assert r["targets"]["text_encoder_time_cut_runs"] == [r["targets"]["text_encoder_time_cut"]]  # one run
    assert {row.metric for row in diffusion.table_rows(result)} >= {"t2v text-encoder calls", "t2i latency p50"}
