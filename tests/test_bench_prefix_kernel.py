"""The prefix-kernel benchmark (benchmarks/prefix_kernel.py) on a small shape."""

from __future__ import annotations

import json

import pytest
from benchmarks import prefix_kernel


def test_both_sides_are_timed_in_alternating_rounds(tmp_path, native_kernel):
    if not native_kernel.tiles:
        pytest.skip("the prefix kernel runs on the tile unit (AMX), which this CPU or kernel does not grant")
    out = tmp_path / "pk.json"
    assert prefix_kernel.main(["--rows", "40", "--keys", "100", "--rounds", "3", "--calls", "2",
                               "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["shape"] == {"kv_heads": 2, "rows_per_kv_head": 40, "keys": 100, "head_dim": 64}
    assert len(r["per_round_s"]["kernel"]) == len(r["per_round_s"]["aten"]) == 3
    assert r["kernel_s"] > 0 and r["aten_s"] > 0 and r["aten_over_kernel"] > 0


def test_a_shape_the_kernel_does_not_take_is_reported_not_timed(tmp_path, capsys):
    out = tmp_path / "pk.json"
    assert prefix_kernel.main(["--dim", "48", "--rounds", "1", "--json", str(out)]) == 0
    assert "does not run here" in json.loads(out.read_text())["skipped"]
    assert "does not run here" in capsys.readouterr().out
