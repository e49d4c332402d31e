"""The skip guard (tests/skips.py and the conftest's hook): a run fails when it took a skip this machine should not
take, whether its reason names nothing known or names hardware the machine has."""

import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from skips import EXPECTED, Machine, unexpected

HERE = Path(__file__).resolve().parent
BARE = Machine(bf16=False, tiles=False, builds=False, onednn=False, linux=False, git=False, gomp=False,
               script=False)
FULL = Machine(bf16=True, tiles=True, builds=True, onednn=True, linux=True, git=True, gomp=True, script=True)


def test_a_skip_is_expected_only_where_the_machine_lacks_what_it_names():
    reason = "no AVX-512 BF16 here: the vector way does not run"
    assert unexpected(reason, BARE) is None
    assert "has what it waits for" in unexpected(reason, replace(BARE, bf16=True))
    either = "the chunk kernel needs AVX-512 BF16 or the tile unit (AMX), which this CPU does not have"
    assert unexpected(either, BARE) is None and unexpected(either, replace(BARE, tiles=True)) is not None
    assert unexpected("the decode kernel cannot be built here: no cc", replace(FULL, builds=False)) is None
    assert unexpected("the decode kernel cannot be built here: no cc", FULL) is not None


def test_a_skip_that_names_nothing_known_is_never_expected():
    for machine in (BARE, FULL):
        assert "names no hardware" in unexpected("flaky today", machine)
        assert "names no hardware" in unexpected("", machine)


def test_every_known_skip_is_expected_on_a_bare_machine_and_none_on_a_full_one():
    # Except the tile unit's way refusing a head size it does not take, which only a machine with it can do.
    structural = "is not on this way"
    for words, _ in EXPECTED:
        assert (unexpected(words, BARE) is None) == (words != structural), words
        assert (unexpected(words, FULL) is None) == (words == structural), words


def run_suite(tmp_path: Path, reason: str) -> subprocess.CompletedProcess:
    """pytest on one passing test and one skipped with ``reason``, under this folder's conftest and guard."""
    for name in ("conftest.py", "skips.py"):
        shutil.copy(HERE / name, tmp_path / name)
    (tmp_path / "test_probe.py").write_text(
        "import pytest\n\ndef test_runs():\n    pass\n\n"
        f"def test_skips():\n    pytest.skip({reason!r})\n")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True)


def test_a_run_with_an_unknown_skip_fails_and_names_it(tmp_path):
    done = run_suite(tmp_path, "not today")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "skip(s) this machine should not take" in done.stdout and "test_probe.py::test_skips" in done.stdout


def test_a_run_whose_skips_this_machine_expects_passes(tmp_path):
    machine = Machine.here()
    words = next(w for w, lacking in EXPECTED if lacking(machine))
    done = run_suite(tmp_path, words)
    assert done.returncode == 0, done.stdout + done.stderr
