"""The norm-kernel benchmark (benchmarks/norm_kernel.py) on a small preset."""

from __future__ import annotations

import json

from benchmarks import norm_kernel


def test_pairs_time_both_engines_on_every_figure(tmp_path, native_kernel, capsys):
    out = tmp_path / "norms.json"
    assert norm_kernel.main(["--pairs", "2", "--preset", "tiny-qwen2", "--prompt-len", "256", "--batch", "2",
                             "--batch-prompt", "20", "--decode-tokens", "3", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["backends"]["kernel"] == r["backends"]["module"] + "+native-norm"
    for side in norm_kernel.SIDES:
        assert all(len(r["per_pair_s"][side][kind]) == 2 for kind in norm_kernel.KINDS)
    assert all(r[kind]["module_over_kernel"] > 0 for kind in norm_kernel.KINDS)
    assert r["same_vs_cold"]["kernel"] > 0
    assert "module / kernel" in capsys.readouterr().out


def test_without_the_kernel_it_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MMCACHE_NATIVE", "off")
    out = tmp_path / "norms.json"
    assert norm_kernel.main(["--pairs", "1", "--preset", "tiny-qwen2", "--prompt-len", "64",
                             "--json", str(out)]) == 0
    assert "does not run here" in json.loads(out.read_text())["skipped"]
    assert "does not run here" in capsys.readouterr().out
