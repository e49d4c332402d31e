"""The widened-linears benchmark (benchmarks/widened_linears.py) on a small preset."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import widened_linears
from mmcache.engine.compute import kernels

pytestmark = pytest.mark.skipif(not kernels.available(torch.device("cpu"), torch.float32),
                                reason="oneDNN is not available in this torch build")


def test_every_side_is_timed_per_shape_and_the_requests_in_pairs(tmp_path, capsys):
    out = tmp_path / "widened.json"
    assert widened_linears.main(["--preset", "tiny-qwen2", "--rows", "1,9", "--rounds", "3", "--calls", "1",
                                 "--pairs", "2", "--prompt-len", "40", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    prod = r["products"]
    sides = {"aten", "widened"} | ({"packed"} if prod["oneDNN_packs_bfloat16"] else set())
    assert prod["oneDNN_packs_bfloat16"] == (not kernels.widened(torch.bfloat16))
    assert set(prod["rows"]) == {"1", "9"}
    for summary in prod["rows"].values():
        assert set(summary) == {"qkv", "o", "gate", "down", "layer"}
        for figures in summary.values():
            assert {k[:-2] for k in figures if k.endswith("_s")} == sides
            assert all(figures[f"{s}_over_widened"] > 0 for s in sides - {"widened"})
        assert summary["layer"]["aten_s"] > summary["qkv"]["aten_s"]  # a sum over the layer's products
    req = r["requests"]
    assert len(req["per_request_s"]["plain"]) == len(req["per_request_s"]["packed"]) == 2
    assert req["plain_over_packed"] > 0 and req["packed_backend"] != req["plain_backend"]
    assert "plain / packed" in capsys.readouterr().out


def test_a_bad_row_count_is_refused():
    with pytest.raises(SystemExit):
        widened_linears.main(["--rows", "8,0", "--no-requests"])
