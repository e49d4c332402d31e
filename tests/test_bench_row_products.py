"""The row-products benchmark (benchmarks/row_products.py) on a small preset."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import row_products
from mmcache.engine.compute import kernels, native


@pytest.fixture
def lib(native_kernel):
    if not kernels.available(torch.device("cpu"), torch.float32):
        pytest.skip("oneDNN is not available in this torch build")
    return native_kernel


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_both_sides_are_timed_per_shape_and_the_decodes_in_pairs(lib, monkeypatch, tmp_path, capsys, dtype):
    if dtype == "bfloat16":  # the kernel reads bfloat16 only where oneDNN widens them (AVX2); so here too
        monkeypatch.setattr(kernels, "_PACKS", {torch.bfloat16: False})
    monkeypatch.setattr(native, "row_products", lambda library: library is not None)  # on any build
    out = tmp_path / "rows.json"
    assert row_products.main(["--preset", "tiny-qwen2", "--dtype", dtype, "--rows", "1,9", "--rounds", "2",
                              "--calls", "1", "--pairs", "2", "--batch", "3", "--tokens", "5", "--prompt-len", "20",
                              "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    prod = r["products"]
    assert prod["dtype"] == dtype and prod["layers"] > 1 and set(prod["rows"]) == {"1", "9"}
    for summary in prod["rows"].values():
        assert set(summary) == {"qkv", "o", "gate", "down", "head", "layer", "step"}
        for figures in summary.values():
            assert figures["onednn_s"] > 0 and figures["kernel_s"] > 0 and figures["onednn_over_kernel"] > 0
        assert summary["step"]["kernel_s"] > summary["layer"]["kernel_s"] > summary["qkv"]["kernel_s"]
    sweep = r["sweep"]
    assert sweep["kernel"] == "rows" and sweep["weight_bytes"] > 0 and set(sweep["rows"]) == {"1", "9"}
    for figures in sweep["rows"].values():
        assert figures["onednn_s"] > 0 and figures["kernel_s"] > 0 and figures["on_kernel"] is True
    dec = r["decode"]
    assert len(dec["itl_p50_s"]["on"]) == len(dec["itl_p50_s"]["off"]) == 2
    assert "+native-rows" in dec["on_backend"] and "+native-rows" not in dec["off_backend"]
    assert dec["off_over_on"] > 0
    assert "off / on" in capsys.readouterr().out


def test_a_bad_row_count_is_refused():
    with pytest.raises(SystemExit):
        row_products.main(["--rows", "8,0", "--no-decode"])


def test_the_decode_pairs_are_refused_where_the_engine_would_not_use_the_kernel(lib, monkeypatch):
    monkeypatch.setattr(native, "row_products", lambda library: False)  # as on an AVX-512 build
    with pytest.raises(SystemExit, match="uses no compiled kernel"):
        row_products.measure_decode("tiny-qwen2", torch.float32, pairs=1, batch=2, tokens=3, prompt_len=8)


def test_the_sweep_runs_on_the_tile_kernel_where_the_cpu_has_it(lib):
    if native.product_way(lib) is None or kernels.widened(torch.bfloat16):
        pytest.skip("neither the AMX tile unit nor AVX-512 BF16 here")
    limit = native.TILE_PRODUCT_ROWS
    sweep = row_products.measure_sweep("tiny-qwen2", torch.bfloat16, [1, limit, limit + 1], rounds=2)
    assert sweep["kernel"] == native.product_way(lib)
    assert [sweep["rows"][str(n)]["on_kernel"] for n in (1, limit, limit + 1)] == [True, True, False]
