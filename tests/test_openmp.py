"""The command line's choice of OpenMP runtime (mmcache.launcher.openmp): the plan, the re-execution, its errors."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest
import torch

from mmcache.launcher import openmp
from mmcache.launcher.openmp import ENV_CHOICE, ENV_LIB, OpenMPConfigError, find_intel_openmp, loaded_runtime, plan

LIB = "/opt/x/lib/libiomp5.so"


def test_auto_preloads_the_found_library_ahead_of_existing_preloads():
    child = plan({"LD_PRELOAD": "/a/libfoo.so:/b/libbar.so", "PATH": "/bin"}, platform="linux", found=LIB)
    assert child["LD_PRELOAD"].split() == [LIB, "/a/libfoo.so", "/b/libbar.so"]
    assert child["PATH"] == "/bin" and child[openmp._MARKER] == LIB


@pytest.mark.parametrize("env", [
    {ENV_CHOICE: "system"},                         # asked to keep torch's runtime
    {openmp._MARKER: LIB},                          # already re-executed once: never loop
    {"LD_PRELOAD": "/venv/lib/libiomp5.so"},         # started on Intel's runtime already (vLLM's env.sh)
])
def test_runs_as_is(env):
    assert plan(env, platform="linux", found=LIB) is None


def test_auto_without_the_library_or_off_linux_runs_as_is():
    assert plan({}, platform="linux", found=None) is None
    assert plan({}, platform="darwin", found=LIB) is None


def test_intel_without_the_library_is_a_typed_error():
    with pytest.raises(OpenMPConfigError, match="intel-openmp"):
        plan({ENV_CHOICE: "intel"}, platform="linux", found=None)
    with pytest.raises(OpenMPConfigError, match="Linux"):
        plan({ENV_CHOICE: "Intel"}, platform="win32", found=LIB)


def test_bad_settings_are_typed_errors(tmp_path):
    with pytest.raises(OpenMPConfigError, match="expected one of"):
        plan({ENV_CHOICE: "llvm"}, platform="linux", found=LIB)
    with pytest.raises(OpenMPConfigError, match="not a file"):
        plan({ENV_LIB: str(tmp_path / "missing.so")}, platform="linux", found=LIB)


def test_a_named_library_wins_over_the_found_one(tmp_path):
    named = tmp_path / "libiomp5.so"
    named.write_bytes(b"")
    child = plan({ENV_CHOICE: "intel", ENV_LIB: str(named)}, platform="linux", found=None)
    assert child["LD_PRELOAD"] == str(named)


def test_find_looks_in_each_prefix_lib(tmp_path):
    (tmp_path / "b" / "lib").mkdir(parents=True)
    (tmp_path / "b" / "lib" / "libiomp5.so").write_bytes(b"")
    assert find_intel_openmp([str(tmp_path / "a"), str(tmp_path / "b")]) == str(tmp_path / "b/lib/libiomp5.so")
    assert find_intel_openmp([str(tmp_path / "a")]) is None


@pytest.mark.parametrize("maps, expected", [
    ("7f00 r-xp /venv/lib/libiomp5.so\n7f01 r-xp /torch/lib/libgomp-a34b3233.so.1\n", "intel"),
    ("7f01 r-xp /torch/lib/libgomp-a34b3233.so.1\n", "gnu"),
    ("7f02 r-xp /usr/lib/libc.so.6\n", "unknown"),
])
def test_loaded_runtime_reads_the_mapped_libraries(tmp_path, maps, expected):
    path = tmp_path / "maps"
    path.write_text(maps)
    assert loaded_runtime(str(path)) == expected
    assert loaded_runtime(str(tmp_path / "absent")) == "unknown"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD is the Linux loader's")
def test_reexec_starts_a_child_with_the_library_mapped():
    # torch's own GNU OpenMP library stands in for Intel's: a real shared library, harmless to preload. The
    # child never imports torch, so finding it mapped there proves the preload took.
    gomp = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*")))
    if not gomp:
        pytest.skip("this torch build ships no libgomp to stand in")
    probe = ("import os, sys; maps = open('/proc/self/maps').read(); "
             "print(os.path.basename(sys.argv[1]) in maps, os.environ['LD_PRELOAD'])")
    code = ("import sys; from mmcache.launcher import openmp; "
            f"openmp.maybe_reexec([{gomp[0]!r}], entry=('-c', {probe!r})); print('not re-executed')")
    env = {**os.environ, ENV_CHOICE: "intel", ENV_LIB: gomp[0]}
    env.pop(openmp._MARKER, None)
    env.pop("LD_PRELOAD", None)  # a shell started on Intel's runtime would make the plan run as is
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["True", gomp[0]]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD is the Linux loader's")
def test_the_reexecuted_command_line_imports_nothing_from_the_current_directory(tmp_path):
    # A folder of the user's own holding packages named like this project's: the child that the re-execution
    # starts must still import mmcache's, as the parent (the installed `mmcache` script) does.
    script = os.path.join(os.path.dirname(sys.executable), "mmcache")
    gomp = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*")))
    if not os.path.isfile(script) or not gomp:
        pytest.skip("needs the installed `mmcache` script and torch's libgomp to stand in for Intel's runtime")
    for name in ("benchmarks", "mmcache", "encoders"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"print('decoy {name} imported'); raise SystemExit(99)\n")
    env = {**os.environ, ENV_CHOICE: "intel", ENV_LIB: gomp[0]}
    env.pop(openmp._MARKER, None)
    env.pop("LD_PRELOAD", None)
    env.pop("PYTHONSAFEPATH", None)
    helped = subprocess.run([script, "bench", "--help"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert helped.returncode == 0 and "decoy" not in helped.stdout + helped.stderr
    assert helped.stdout.startswith("usage: mmcache bench")
    refused = subprocess.run([script, "replay"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert refused.returncode == 2 and "required: TRACE" in refused.stderr and "decoy" not in refused.stdout


@pytest.mark.parametrize("env, message", [
    ({ENV_CHOICE: "llvm"}, "expected one of"),
    ({ENV_CHOICE: "intel", ENV_LIB: "/nonexistent/libiomp5.so"}, "not a file"),
])
def test_the_command_line_reports_a_bad_setting_and_exits_2(env, message):
    full = {**os.environ, **env}
    full.pop(openmp._MARKER, None)
    out = subprocess.run([sys.executable, "-m", "mmcache.cli", "export-model", "--help"], capture_output=True,
                         text=True, env=full)
    assert out.returncode == 2 and message in out.stderr and out.stdout == ""


def test_the_runtime_benchmark_starts_each_child_on_the_runtime_it_names(monkeypatch):
    from benchmarks.openmp_runtimes import child_env

    monkeypatch.setenv("LD_PRELOAD", "/venv/lib/libiomp5.so")
    gnu, intel = child_env("gnu", LIB), child_env("intel", LIB)
    assert "LD_PRELOAD" not in gnu and intel["LD_PRELOAD"] == LIB
    assert gnu[ENV_CHOICE] == intel[ENV_CHOICE] == "system"  # a child never re-executes itself


def test_the_command_line_chooses_its_runtime_before_torch_is_loaded():
    # The re-execution would otherwise pay for a torch import it throws away (mmcache/__init__ is lazy).
    code = "import sys, mmcache.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_package_still_exports_its_names_lazily():
    import mmcache

    assert all(getattr(mmcache, n) is not None for n in mmcache.__all__)
    assert set(mmcache.__all__) <= set(dir(mmcache))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        mmcache.nope  # noqa: B018


def test_the_child_runs_the_parents_mmcache_ahead_of_another_copy_on_its_path(tmp_path):
    # A clone run as `python -m mmcache.cli` beside another mmcache on the path (installed, or on PYTHONPATH):
    # the parent ran the clone's, so the re-executed child must import the clone's too, and nothing from the
    # current directory.
    flag, code = openmp._child_entry()
    assert code.endswith("from mmcache.cli import main\nsys.exit(main())\n")
    probe = code.replace("from mmcache.cli import main\nsys.exit(main())\n",
                         "import mmcache\nprint(mmcache.__file__)\n")
    other = tmp_path / "other"
    for folder in (tmp_path, other):
        (folder / "mmcache").mkdir(parents=True)
        (folder / "mmcache" / "__init__.py").write_text("")
    env = {**os.environ, "PYTHONPATH": str(other)}
    env.pop("PYTHONSAFEPATH", None)
    out = subprocess.run([sys.executable, flag, probe], capture_output=True, text=True, env=env, cwd=tmp_path)
    package_init = os.path.join(os.path.dirname(os.path.dirname(openmp.__file__)), "__init__.py")
    assert out.returncode == 0 and out.stdout.strip() == package_init
