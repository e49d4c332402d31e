"""The repeated-prompt anatomy benchmark (benchmarks/hit_anatomy.py) on the tiny preset."""

from __future__ import annotations

import json

import pytest
from benchmarks import hit_anatomy
from mmcache.engine import SamplingParams
from mmcache.presets import engine_from_preset


def test_the_clock_times_every_linear_product_of_a_forward_once():
    eng = engine_from_preset("tiny")
    modules = hit_anatomy.linear_modules(eng.adapter)
    # per layer: q, k, v, o and the fused gated MLP (its gate, up and down are not called apart); the LM head
    assert len(modules) == 5 * eng.adapter.num_layers + 1 and modules[-1] is eng.adapter.lm_head
    clock = hit_anatomy.LinearClock(modules)
    out = eng.generate([list(range(5, 45))], SamplingParams(max_tokens=1))[0]
    assert out.error is None and clock.calls == len(modules)  # one forward: each product once
    assert clock.seconds > 0
    clock.remove()
    clock.reset()
    eng.generate([list(range(5, 45))], SamplingParams(max_tokens=1))
    assert clock.calls == 0 and clock.seconds == 0  # removed: the engine runs unobserved again


def test_a_run_reports_each_repeat_and_the_medians_of_its_ratios(tmp_path):
    out = tmp_path / "anatomy.json"
    argv = ["--preset", "tiny", "--dtype", "float32", "--page-size", "16", "--prompt-len", "64", "--repeats", "3",
            "--json", str(out)]
    assert hit_anatomy.main(argv) == 0
    result = json.loads(out.read_text())
    assert len(result["repeats"]) == 3 and result["prompt_len"] == 64
    for r in result["repeats"]:
        assert 0 < r["linears_hit_s"] < r["hit_s"] and 0 < r["linears_cold_s"] < r["cold_s"]
    assert set(result["ratios"]) >= {"cold_over_hit", "linears_cold_over_hit", "rest_cold_over_hit"}


def test_ratios_are_taken_within_each_repeat_before_the_median():
    repeats = [{"cold_s": 10.0, "hit_s": 1.0, "linears_cold_s": 8.0, "linears_hit_s": 0.5},
               {"cold_s": 40.0, "hit_s": 2.0, "linears_cold_s": 30.0, "linears_hit_s": 1.5},
               {"cold_s": 6.0, "hit_s": 1.0, "linears_cold_s": 3.0, "linears_hit_s": 0.5}]
    s = hit_anatomy.summarize(repeats)
    assert s["ratios"]["cold_over_hit"] == 10.0  # of 10, 20, 6; the ratio of the medians would be 10 / 1
    assert s["ratios"]["linears_cold_over_hit"] == 16.0  # of 16, 20, 6
    assert s["ratios"]["rest_cold_over_hit"] == 6.0  # of (10-8)/(1-0.5)=4, (40-30)/(2-1.5)=20, 3/0.5=6
    assert s["medians"]["cold_s"] == 10.0


@pytest.mark.parametrize("prompt_len", ["60", "16"])  # not whole pages; a single page leaves no hit
def test_a_prompt_that_cannot_make_a_page_aligned_hit_is_refused(prompt_len):
    with pytest.raises(SystemExit, match="multiple of --page-size"):
        hit_anatomy.main(["--preset", "tiny", "--dtype", "float32", "--page-size", "16", "--prompt-len", prompt_len,
                          "--repeats", "1"])
