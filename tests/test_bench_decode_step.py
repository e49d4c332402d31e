"""The decode-step benchmark (benchmarks/decode_step.py) on the tiny preset."""

from __future__ import annotations

import json

import pytest
from benchmarks import decode_step
from mmcache.engine.compute import native


pytestmark = pytest.mark.usefixtures("native_kernel")


def test_both_sides_time_decode_only_steps_and_the_clock_comes_off(tmp_path):
    out = tmp_path / "step.json"
    argv = ["--preset", "tiny", "--dtype", "float32", "--page-size", "16", "--rounds", "2", "--max-tokens", "6",
            "--scale", "0.03", "--json", str(out)]
    assert decode_step.main(argv) == 0
    result = json.loads(out.read_text())
    for shape in decode_step.SHAPES:
        r = result["shapes"][shape]
        # 6 tokens: the first comes with the prompt, the other 5 are decode-only steps, alternating sides
        assert r["steps"]["kernel"] + r["steps"]["aten"] == 2 * 5 and min(r["steps"].values()) >= 4
        for side in ("kernel", "aten"):
            assert 0 < r["medians"][side]["attention_s"] < r["medians"][side]["step_s"]
    from mmcache.engine import attention

    assert native.decode_attention.__name__ == "decode_attention"  # the clock's wrappers are gone
    assert attention._decodes_one_by_one.__name__ == "_decodes_one_by_one"


def test_an_unknown_shape_is_refused_before_anything_is_built(monkeypatch, capsys):
    monkeypatch.setattr(decode_step, "measure", lambda args: pytest.fail("measured"))
    with pytest.raises(SystemExit) as exc:
        decode_step.main(["--preset", "tiny", "--shapes", "shared,long"])
    assert exc.value.code == 2 and "argument --shapes: unknown shape 'long'" in capsys.readouterr().err


def test_each_side_is_summarized_apart_and_the_ratio_is_of_their_medians():
    steps = {"kernel": [{"step_s": 1.0, "attention_s": 0.2}, {"step_s": 3.0, "attention_s": 0.4},
                        {"step_s": 2.0, "attention_s": 0.3}],
             "aten": [{"step_s": 4.0, "attention_s": 1.2}]}
    s = decode_step.summarize(steps)
    assert s["medians"]["kernel"] == {"step_s": 2.0, "attention_s": 0.3} and s["steps"] == {"kernel": 3, "aten": 1}
    assert s["aten_over_kernel"] == {"step_s": 2.0, "attention_s": pytest.approx(4.0)}
