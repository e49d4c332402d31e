"""The position-bias layer benchmark (benchmarks/position_bias_layer.py) on a small shape."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import position_bias_layer

SMALL = dict(d_model=64, d_kv=16, d_ff=128, num_heads=4)


def test_both_sides_are_paired_and_bit_identical():
    before = torch.get_num_threads()
    r = position_bias_layer.measure(layers=2, length=64, real=9, repeats=3, dtype="float32", threads=1, shape=SMALL)
    assert torch.get_num_threads() == before
    assert r["bit_identical"] and r["repeats"] == 3
    assert len(r["per_forward_s"]["own"]) == len(r["per_forward_s"]["served"]) == 3
    assert r["biases_computed"] == 2 and r["biases_served"] == 2 * 4  # filled once, then 3 served forwards
    assert r["bias_bytes_per_forward"] == 2 * 4 * 64 * 64 * 4
    assert r["served_over_own"] > 0 and r["shape"]["num_layers"] == 2


def test_the_command_writes_its_figures(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(position_bias_layer, "REAL_UMT5_XXL_LAYER", SMALL)
    monkeypatch.setattr(position_bias_layer.measure, "__defaults__", (0, SMALL))
    out = tmp_path / "r.json"
    assert position_bias_layer.main(["--length", "32", "--real", "4", "--repeats", "2", "--dtype", "float32",
                                     "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["bit_identical"] and r["length"] == 32 and r["shape"]["d_model"] == 64
    assert "served / own" in capsys.readouterr().out


def test_more_real_tokens_than_the_length_are_refused():
    with pytest.raises(SystemExit):
        position_bias_layer.main(["--length", "16", "--real", "17"])
