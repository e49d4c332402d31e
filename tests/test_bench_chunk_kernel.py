"""The chunk-kernel benchmark (benchmarks/chunk_kernel.py) on small shapes."""

from __future__ import annotations

import json

import pytest
from benchmarks import chunk_kernel


def test_both_sides_are_timed_in_alternating_rounds_and_agree(tmp_path, native_kernel, monkeypatch):
    if not native_kernel.tiles:
        pytest.skip("the chunk kernel runs on the tile unit (AMX), which this CPU or kernel does not grant")
    monkeypatch.setattr(chunk_kernel, "CASES", {"hit": (64, 16), "cold": (0, 48)})
    out = tmp_path / "ck.json"
    assert chunk_kernel.main(["--group", "3", "--rounds", "3", "--calls", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for case, (cached, tokens) in (("hit", (64, 16)), ("cold", (0, 48))):
        r = result[case]
        assert r["shape"] == {"cached": cached, "tokens": tokens, "kv_heads": 2, "query_heads_per_kv_head": 3,
                              "head_dim": 64}
        assert len(r["per_round_s"]["kernel"]) == len(r["per_round_s"]["aten"]) == 3
        assert r["kernel_s"] > 0 and r["aten_s"] > 0 and r["aten_over_kernel"] > 0
        assert r["max_abs_difference"] < 0.05  # the same attention, rounded apart


def test_a_shape_the_kernel_does_not_take_is_reported_not_timed(tmp_path, capsys):
    out = tmp_path / "ck.json"
    assert chunk_kernel.main(["--dim", "48", "--cases", "hit", "--rounds", "1", "--json", str(out)]) == 0
    assert "does not run here" in json.loads(out.read_text())["hit"]["skipped"]
    assert "does not run here" in capsys.readouterr().out
