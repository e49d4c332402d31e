"""The layer-kernels benchmark (benchmarks/layer_kernels.py) on a small preset."""

from __future__ import annotations

import json

from benchmarks import layer_kernels


def test_pairs_time_both_engines_on_every_figure(tmp_path, native_kernel, capsys):
    import transformers.models.qwen2.modeling_qwen2 as mq

    from mmcache.engine.compute import rotary

    out = tmp_path / "layers.json"
    assert layer_kernels.main(["--pairs", "2", "--preset", "tiny-qwen2", "--prompt-len", "256", "--batch", "2",
                               "--batch-prompt", "20", "--decode-tokens", "3", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["backends"]["kernels"] == r["backends"]["torch"] + "+native-norm"
    for side in layer_kernels.SIDES:
        assert all(len(r["per_pair_s"][side][kind]) == 2 for kind in layer_kernels.KINDS)
    assert all(r[kind]["torch_over_kernels"] > 0 for kind in layer_kernels.KINDS)
    assert r["same_vs_cold"]["kernels"] > 0
    for kind in ("cold", "hit"):  # both sides ran their norms and rotary embedding under the clocks
        assert all(r[kind][f"{part}_{side}_s"] > 0 for part in ("norms", "rotary") for side in layer_kernels.SIDES)
    assert rotary.replacement(mq) is not None  # the replacement is back in place (inside the wrapper, if any)
    assert "torch / kernels" in capsys.readouterr().out


def test_without_the_kernel_it_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MMCACHE_NATIVE", "off")
    out = tmp_path / "layers.json"
    assert layer_kernels.main(["--pairs", "1", "--preset", "tiny-qwen2", "--prompt-len", "64",
                               "--json", str(out)]) == 0
    assert "not run here" in json.loads(out.read_text())["skipped"]
    assert "not run here" in capsys.readouterr().out
