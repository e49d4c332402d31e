"""The grouped-projections benchmark (benchmarks/projections.py) on a small preset."""

from __future__ import annotations

import json

import pytest

from benchmarks import projections


def test_both_sides_are_timed_in_pairs_and_the_engine_keeps_its_groups(tmp_path, capsys):
    out = tmp_path / "projections.json"
    assert projections.main(["--preset", "tiny-qwen2", "--batch", "2", "--batch-prompt", "20",
                             "--decode-tokens", "6", "--hits", "2", "--prompt-len", "300",
                             "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["attention_modules"] == 2
    assert r["decode_step"]["pairs"] >= 2 and r["hit"]["pairs"] == 2
    for kind in ("decode_step", "hit"):
        assert r[kind]["separate_over_grouped"] > 0 and r[kind]["grouped_s"] > 0
    assert len(r["per_hit_s"]["grouped"]) == len(r["per_hit_s"]["separate"]) == 2
    assert "separate / grouped" in capsys.readouterr().out


def test_too_few_decode_tokens_are_refused():
    with pytest.raises(SystemExit):
        projections.main(["--decode-tokens", "2"])
