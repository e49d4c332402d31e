""".ci/run fails as soon as one of its steps fails: a failed install stops it before any test runs.

The script runs in a copy of its folder layout whose ``python3`` (first on ``PATH``) makes a virtual environment of
stand-ins: ``pip`` fails or succeeds as the test says, ``python`` records each call and succeeds.
"""

import os
import shutil
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FAKE_PYTHON3 = """#!/usr/bin/env bash
# python3 -m venv .venv: a virtual environment of stand-ins
mkdir -p .venv/bin
printf '#!/usr/bin/env bash\\necho pip "$@" >> "$CALLS"\\nexit %s\\n' "$PIP_STATUS" > .venv/bin/pip
printf '#!/usr/bin/env bash\\necho python "$@" >> "$CALLS"\\n' > .venv/bin/python
chmod +x .venv/bin/pip .venv/bin/python
"""


def executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def run_ci(tmp_path: Path, pip_status: int) -> tuple[int, list[str]]:
    checkout = tmp_path / "checkout"
    (checkout / ".ci").mkdir(parents=True)
    shutil.copy(ROOT / ".ci" / "run", checkout / ".ci" / "run")
    (checkout / "tests").mkdir()
    for name in ("test_engine_a.py", "test_native_a.py", "test_bench_layer_kernels.py"):
        (checkout / "tests" / name).write_text("")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    executable(bin_dir / "python3", FAKE_PYTHON3)
    calls = tmp_path / "calls"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "CALLS": str(calls),
           "PIP_STATUS": str(pip_status)}
    done = subprocess.run(["bash", str(checkout / ".ci" / "run")], env=env, capture_output=True, text=True)
    return done.returncode, calls.read_text().splitlines() if calls.exists() else []


def test_a_failed_install_fails_the_run_and_runs_no_test(tmp_path):
    status, calls = run_ci(tmp_path, pip_status=1)
    assert status != 0
    assert [c.split()[0] for c in calls] == ["pip"], calls


def test_a_good_install_runs_the_tests_three_times(tmp_path):
    status, calls = run_ci(tmp_path, pip_status=0)
    assert status == 0
    assert [c.split()[:3] for c in calls] == [["pip", "install", "torch==2.13.0"]] + [["python", "-m", "pytest"]] * 3
