"""The CFG benchmark's exact-schedule check (benchmarks/cfg.py: exact_check) on the tiny preset."""

from __future__ import annotations

from argparse import Namespace

from benchmarks.cfg import exact_check, table_rows

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
              "on": {"ttft_p50_s": 0.05, "negative_matched_share": 0.95}, "off": {"ttft_p50_s": 0.3}}
    rows = table_rows(result)
    assert rows[0].value == 1.0 and "exact schedule" in rows[0].metric
    assert "default schedule" in rows[-1].target
