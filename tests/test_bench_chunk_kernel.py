"""The chunk-kernel benchmark (benchmarks/chunk_kernel.py) on small shapes."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from benchmarks import chunk_kernel

ROOT = Path(chunk_kernel.__file__).resolve().parents[1]


@pytest.fixture
def chunk_lib(native_kernel):
    """The compiled library, where the chunk kernel has a way to run on this CPU."""
    from mmcache.engine.compute import native

    if native.chunk_way(native_kernel, 64) is native.CHUNK_NONE:
        pytest.skip("the chunk kernel needs AVX-512 BF16 or the tile unit (AMX), which this CPU does not have")
    return native_kernel


@pytest.fixture
def git_checkout():
    """``--against`` reads sources from git: skip where the tests run outside a checkout (an unpacked sdist)."""
    if not (shutil.which("git") and subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"],
                                                   capture_output=True).returncode == 0):
        pytest.skip("not a git checkout")


def test_both_sides_are_timed_in_alternating_rounds_and_agree(tmp_path, chunk_lib, monkeypatch):
    from mmcache.engine.compute import native

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
        assert r["way"] == native.chunk_way(chunk_lib, 64)


def test_a_shape_the_kernel_does_not_take_is_reported_not_timed(tmp_path, capsys):
    out = tmp_path / "ck.json"
    assert chunk_kernel.main(["--dim", "48", "--cases", "hit", "--rounds", "1", "--json", str(out)]) == 0
    assert "does not run here" in json.loads(out.read_text())["hit"]["skipped"]
    assert "does not run here" in capsys.readouterr().out


def test_engine_pairs_time_cold_and_hit_on_both_sides(tmp_path, chunk_lib, monkeypatch):
    """The whole-request mode on the ``small`` preset (eight layers of the Qwen2.5-0.5B shape: the tiny presets'
    16-wide heads do not take the kernel): both sides serve every pair, and the measuring device comes off."""
    from mmcache.engine.compute import native

    real = native.supports_chunk
    out = tmp_path / "e2e.json"
    assert chunk_kernel.main(["--engine", "2", "--preset", "small", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert native.supports_chunk is real
    for side in ("kernel", "aten"):
        assert len(r["per_pair_s"][side]["cold"]) == len(r["per_pair_s"][side]["hit"]) == 2
    assert r["hit"]["aten_over_kernel"] > 0 and r["same_vs_cold"]["kernel"] > 1
    assert r["way"] == native.chunk_way(chunk_lib, 64)


def _sources_as_committed() -> bool:
    from mmcache.engine.compute import native

    return subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", "HEAD", "--", str(native.CSRC)],
                          capture_output=True).returncode == 0


def test_against_a_revision_times_both_builds_on_the_same_inputs(tmp_path, chunk_lib, git_checkout,
                                                                  monkeypatch):
    """``--against REV`` builds the kernel from the revision's sources and alternates it with this tree's."""
    monkeypatch.setattr(chunk_kernel, "CASES", {"hit": (64, 16)})
    out = tmp_path / "ab.json"
    assert chunk_kernel.main(["--against", "HEAD", "--group", "3", "--rounds", "2", "--calls", "1",
                              "--json", str(out)]) == 0
    r = json.loads(out.read_text())["hit"]
    assert r["against"] == "HEAD" and isinstance(r["same_bits"], bool)
    if _sources_as_committed():  # two builds of the same sources: the same bits
        assert r["same_bits"] and r["max_abs_difference"] == 0
    assert len(r["per_round_s"]["kernel"]) == len(r["per_round_s"]["against"]) == 2
    assert r["kernel_s"] > 0 and r["against_s"] > 0 and r["against_over_kernel"] > 0
    assert r["max_abs_difference"] < 0.05 and "aten_s" not in r


def test_against_a_revision_that_does_not_exist_says_so(native_kernel, git_checkout):
    with pytest.raises(SystemExit, match="--against no-such-revision: cannot read"):
        chunk_kernel.main(["--against", "no-such-revision", "--cases", "hit"])


def test_engine_pairs_against_a_revision_swap_the_attention_library_and_put_it_back(tmp_path, chunk_lib,
                                                                                    git_checkout, monkeypatch):
    """``--engine N --against REV``: each pair serves on this tree's library and on the revision's, the
    engine's own library is back afterwards, and ATen is not involved."""
    from mmcache.engine import Engine
    from mmcache.engine.compute import native

    engines, used = [], []
    real_init = Engine.__init__

    def keep(self, *a, **kw):
        real_init(self, *a, **kw)
        engines.append(self)

    monkeypatch.setattr(Engine, "__init__", keep)
    real_chunk = native.chunk_attention

    def spy(lib, *a, **kw):
        used.append(lib)
        return real_chunk(lib, *a, **kw)

    monkeypatch.setattr(native, "chunk_attention", spy)
    out = tmp_path / "e2e_ab.json"
    assert chunk_kernel.main(["--engine", "2", "--preset", "small", "--against", "HEAD", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["against"] == "HEAD" and set(r["per_pair_s"]) == {"kernel", "against"}
    for side in ("kernel", "against"):
        assert len(r["per_pair_s"][side]["cold"]) == len(r["per_pair_s"][side]["hit"]) == 2
    assert r["hit"]["against_over_kernel"] > 0 and "aten_s" not in r["hit"]
    (eng,) = engines
    assert eng.runner.decode_kernel is chunk_lib  # put back
    assert chunk_lib in used and any(lib is not chunk_lib for lib in used)  # both libraries served
