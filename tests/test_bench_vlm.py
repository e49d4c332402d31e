"""The ``vlm`` benchmark on the tiny LLaVA preset: exact tower-call counts per mode, match shares, the compute
bound, the overhead guard's shape, the JSON the runner writes and the table rows."""

import json

import pytest
import torch

import benchmarks.vlm as vlm
from benchmarks.runner import bench_parser
from mmcache.cli import main as cli_main

ARGS = ["--preset", "tiny-llava", "--dtype", "float32", "--images", "2", "--users", "3", "--turns", "3",
        "--max-tokens", "3", "--runs", "2", "--guard-requests", "2", "--guard-runs", "2"]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    path = tmp_path_factory.mktemp("vlm") / "vlm.json"
    threads = torch.get_num_threads()
    assert cli_main(["bench", "vlm", "--json", str(path)] + ARGS) == 0
    assert torch.get_num_threads() == threads  # the benchmark restores the thread count it changed
    return json.loads(path.read_text())


def test_tower_calls_per_mode_are_exact(result):
    modes = result["modes"]
    assert result["unique_images"] == 2
    # 2 photos x 3 users: every chat holds 1, 1 and 2 photos at turns 1-3, so 24 image occurrences per run.
    assert modes["off"]["encoder_calls_per_run"] == modes["kv"]["encoder_calls_per_run"] == [24, 24]
    assert modes["kv+encoder"]["encoder_calls_per_run"] == [2, 2]
    # The second photo of turn 3 is the other chats' first photo: already in the store.
    assert [t["encoder_calls"] for t in modes["kv+encoder"]["per_turn"]] == [2, 0, 0]
    assert [t["encoder_calls"] for t in modes["off"]["per_turn"]] == [6, 6, 12]
    assert result["targets"]["encoder_calls_equal_unique_images"] is True


def test_match_shares_and_compute_bound(result):
    modes = result["modes"]
    off = modes["off"]
    assert off["matched_share"] == 0 and off["computed_prompt_tokens"] == off["prompt_tokens"]
    assert modes["kv"]["matched_share"] == modes["kv+encoder"]["matched_share"] > 0.5
    first = modes["kv+encoder"]["per_turn"][0]
    assert 0 < first["matched_share"] < 0.5  # users 1 and 3 of a photo share a system prompt, so pages
    for turn in modes["kv+encoder"]["per_turn"][1:]:
        assert turn["matched_share"] > 0.6 and 0 < turn["compute_bound_ratio"] < 0.5
    assert all(t["noncached_flop_share_p50"] == 1.0 for t in modes["off"]["per_turn"])
    assert modes["kv+encoder"]["outputs_equal_to_off_share"] == 1.0
    assert result["model"]["placeholders_per_image"] == 16 and result["model"]["tower_gflops_per_image"] > 0


def test_overhead_guard_and_table(result):
    guard = result["overhead_guard"]
    assert len(guard["runs"]) == 2 and all(r["matched_tokens_on"] == 0 for r in guard["runs"])
    assert result["overhead_guard_ratio"] == guard["ratio"] == guard["paired_ratio_p50"] > 0
    assert guard["ratio_of_p50s"] > 0
    assert guard["bookkeeping"]["on_s"] > 0 and guard["bookkeeping"]["off_s"] > 0
    assert guard["output_tokens"] == 3 and guard["prompt_tokens"] > 16
    for mode in vlm.MODES:
        m = result["modes"][mode]
        assert m["ttft_p50_s"] > 0 and len(m["per_turn"]) == 3
    rows = vlm.table_rows(result)
    assert {r.metric for r in rows} >= {"vision-tower calls (KV + encoder store)",
                                        "overhead guard: latency on/off, all images new",
                                        "overhead guard: added cache bookkeeping / latency"}
    calls = next(r for r in rows if r.metric.startswith("vision-tower"))
    assert (calls.value, calls.baseline) == (2.0, 24.0)
    guard_row = next(r for r in rows if r.metric.startswith("overhead guard: latency"))
    assert guard["paired_ratio_p50_se"] >= 0 and guard_row.target.startswith("<= 1.02 (median of 4 pairs, +-")


def test_the_guards_uncertainty_is_the_standard_error_of_a_median():
    # sqrt(pi / 2) * s / sqrt(n): s = 0.1633 for these four, n = 4
    assert vlm.median_standard_error([1.0, 1.2, 0.8, 1.0]) == pytest.approx(0.10233, abs=1e-4)
    assert vlm.median_standard_error([1.0] * 16) == 0.0
    assert vlm.median_standard_error([1.1]) is None
    few, many = [1.0 + 0.15 * (-1) ** i for i in range(16)], [1.0 + 0.15 * (-1) ** i for i in range(64)]
    assert vlm.median_standard_error(few) == pytest.approx(0.047, abs=0.002)  # the quick guard's 16 pairs
    assert vlm.median_standard_error(many) == pytest.approx(vlm.median_standard_error(few) / 2, rel=0.05)


def test_guard_images_are_distinct_and_shapes_are_checked():
    images = vlm.guard_images(6, seed=3)
    assert len(set(images)) == 6 and images == vlm.guard_images(6, seed=3)
    with pytest.raises(SystemExit):
        vlm.shape_from_args(bench_parser("vlm", vlm).parse_args(["--images", "9"]))


@pytest.mark.parametrize("option, value, says", [("--images", "0", "at least 1"), ("--images", "5", "at most 4"),
                                                 ("--guard-runs", "-1", "at least 0"),
                                                 ("--guard-requests", "-2", "at least 0"),
                                                 ("--seed", str(10**30), "at most"), ("--seed", "-1", "at least 0"),
                                                 ("--runs", "0", "at least 1"), ("--turns", str(10**30), "at most")])
def test_a_bad_shape_or_seed_is_refused_before_anything_is_built(option, value, says, capsys):
    """A negative guard count used to crash after every chat run, a seed past 2**64 in torch.manual_seed, and
    --images 0 exited with code 1; now each is argparse's error, exit code 2, before the model is built."""
    with pytest.raises(SystemExit) as exc:
        cli_main(["bench", "vlm", "--quick", "--preset", "tiny-llava", f"{option}={value}"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"mmcache bench vlm: error: argument {option}: must be {says}" in err, err


def test_shapes_built_in_code_are_checked_with_the_typed_error():
    from benchmarks.text_workloads import WorkloadShapeError

    args = bench_parser("vlm", vlm).parse_args(["--quick"])
    assert vlm.shape_from_args(args) == vlm.QUICK
    args.guard_runs = -1
    with pytest.raises(WorkloadShapeError, match="guard_runs"):
        vlm.shape_from_args(args)
    args = bench_parser("vlm", vlm).parse_args(["--num-pages", str(1 << 24)])
    with pytest.raises(WorkloadShapeError, match="pool"):
        vlm.shape_from_args(args)
