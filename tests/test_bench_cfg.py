"""The CFG benchmark's exact-schedule check (benchmarks/cfg.py: exact_check) on the tiny preset, and its runs
and paired TTFT ratio."""

from __future__ import annotations

import statistics
from argparse import Namespace

import pytest

from benchmarks import cfg
from benchmarks.cfg import exact_check, paired_ttft_ratio, table_rows
from benchmarks.runner import bench_parser

PROMPTS = ["a red fox in snow", "a lighthouse at dusk", "a bowl of ramen on a wooden table"]
NEGATIVE = "blurry, low quality, oversaturated, static, worst quality, jpeg artifacts, deformed hands " * 2


def args(page_size: int) -> Namespace:
    return Namespace(preset="tiny", dtype="float32", page_size=page_size, max_tokens=6, scale=3.0)


def test_exact_check_passes_when_the_negative_prompt_hits_and_every_row_is_equal():
    r = exact_check(args(16), PROMPTS, NEGATIVE)
    assert r["negative_matched_on"][0] == 0 and all(n >= 16 for n in r["negative_matched_on"][1:])
    assert r["logits_equal"] == r["tokens_equal"] == [True, True, True]
    assert r["bit_exact"] is True


def test_exact_check_fails_when_nothing_was_seeded():
    # Pages longer than the negative prompt: nothing to seed, so equality alone proves nothing about reuse.
    r = exact_check(args(256), PROMPTS, NEGATIVE)
    assert r["negative_matched_on"] == [0, 0, 0] and r["bit_exact"] is False


def test_the_table_reports_the_check_and_the_default_schedule_apart():
    result = {"exact_check": {"bit_exact": True}, "tokens_equal": False, "compute_bound_ttft_ratio": 0.06,
              "on": {"ttft_p50_s": 0.05, "negative_matched_share": 0.95}, "off": {"ttft_p50_s": 0.3},
              "ttft_ratio_paired": 5.5}
    rows = table_rows(result)
    assert rows[0].value == 1.0 and "exact schedule" in rows[0].metric
    assert rows[1].ratio == rows[1].paired == 5.5  # the paired figure, not 0.3 / 0.05
    assert "default schedule" in rows[-1].target


def test_the_ttft_ratio_is_paired_by_request():
    # The same three requests with the cache off and on: the p50s' ratio says 2.0, the requests' own ratios are
    # 1.11, 2.0 and 1.03.
    off = [{"ttft_s": t} for t in (1.0, 2.0, 4.0)]
    on = [{"ttft_s": t} for t in (0.9, 1.0, 3.9)]
    assert paired_ttft_ratio(off, on) == pytest.approx(1.0 / 0.9)
    with pytest.raises(ValueError):
        paired_ttft_ratio(off, on[:2])


def test_each_run_starts_cold_and_the_ratio_is_the_median_over_runs(monkeypatch):
    """Two runs of a two-request stream on the tiny preset: each run's first request finds the cache-on engine
    empty (its caches were cleared), the next seeds the negative prompt; the reported paired ratio is the median
    of the runs' ratios and the table's "better by"."""
    served = []
    serve = cfg._serve

    def spy(eng, rid, prompt, negative, args):
        out = serve(eng, rid, prompt, negative, args)
        served.append((str(rid), eng.config.cache_mode, out.negative_matched_tokens))
        return out

    monkeypatch.setattr(cfg, "_serve", spy)
    parser = bench_parser("cfg", cfg)
    args = parser.parse_args(["--preset", "tiny", "--dtype", "float32", "--requests", "2", "--runs", "2",
                              "--max-tokens", "2", "--negative-repeat", "1", "--page-size", "16"])
    r = cfg.run(args)
    on = {rid: matched for rid, mode, matched in served if mode == "on" and not rid.startswith("exact")}
    assert sorted(on) == ["0-0", "0-1", "0-2", "1-0", "1-1", "1-2"]
    assert on["0-0"] == on["1-0"] == 0 and all(on[f"{run}-{i}"] > 0 for run in (0, 1) for i in (1, 2))
    assert r["runs"] == 2 and len(r["ttft_ratio_paired_runs"]) == 2
    assert r["ttft_ratio_paired"] == statistics.median(r["ttft_ratio_paired_runs"])
    assert table_rows(r)[1].ratio == r["ttft_ratio_paired"]
    quick = parser.parse_args(["--quick"])
    cfg.fill_sizes(quick, cfg.FULL, cfg.QUICK)
    assert (quick.runs, parser.parse_args([]).runs) == (1, None) and cfg.FULL["runs"] == 3
