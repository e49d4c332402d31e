"""Where the compiled kernels are loaded from (``mmcache.engine.compute.native``): only this user's own files in a
directory no one else can write; anything else is refused before it is loaded (a planted library's constructor
never runs) and the kernel is built in a private directory instead; a library that loads but lacks a kernel
function is unavailable, and an engine falls back to ATen and says so."""

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from mmcache.engine import Engine, EngineConfig
from mmcache.engine.compute import native
from mmcache.presets.text import build_model

TINY = "int mmc_benign(void) { return 1; }\n"  # a library without any of the kernel's functions
PLANTED = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void mark(void) {
    const char *where = getenv("MMCACHE_TEST_MARKER");
    FILE *f = where ? fopen(where, "w") : NULL;
    if (f) { fputs("the planted library ran\n", f); fclose(f); }
}
int mmc_benign(void) { return 2; }
"""


def real_cc() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc or not shutil.which(cc) or not sys.platform.startswith("linux"):
        pytest.skip("no C compiler on Linux here: nothing is compiled or loaded")
    return shutil.which(cc)


def shared_object(cc: str, source: str, out: Path) -> Path:
    src = out.with_suffix(".c")
    src.write_text(source)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(out), str(src)], check=True, capture_output=True)
    return out


@pytest.fixture
def setup(tmp_path, monkeypatch):
    """A fake compiler that builds the tiny library whatever it is asked (fast; its own digest), a marker the
    planted library's constructor would write, and the planted library."""
    cc = real_cc()
    tools = tmp_path / "tools"
    tools.mkdir(mode=0o700)
    tiny = shared_object(cc, TINY, tools / "tiny.so")
    fake = tools / "fake-cc"
    fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo fake-cc 1.0; exit 0; fi\n"
                    "while [ $# -gt 0 ]; do if [ \"$1\" = -o ]; then out=\"$2\"; fi; shift; done\n"
                    f"cp '{tiny}' \"$out\"\n")
    fake.chmod(0o700)
    marker = tmp_path / "marker"
    monkeypatch.setenv("MMCACHE_TEST_MARKER", str(marker))
    planted = shared_object(cc, PLANTED, tools / "planted.so")
    return {"cc": str(fake), "marker": marker, "planted": planted, "tmp": tmp_path}


@pytest.fixture
def fresh_state():
    saved = dict(native._state)
    native.reset()
    yield
    native.reset()
    native._state.update(saved)


def directory(path: Path, mode: int) -> Path:
    path.mkdir()
    path.chmod(mode)  # chmod, not mkdir's mode: the umask does not apply
    return path


def expected_name(setup) -> str:
    own = directory(setup["tmp"] / "probe", 0o700)
    return native.build(compiler=setup["cc"], directory=own).name


def test_a_library_planted_where_others_can_write_is_not_loaded(setup, fresh_state, monkeypatch):
    shared = directory(setup["tmp"] / "shared", 0o777)
    planted = shutil.copy(setup["planted"], shared / expected_name(setup))
    built = native.build(compiler=setup["cc"], directory=shared)
    assert built.parent != shared and stat.S_IMODE(os.stat(built.parent).st_mode) == 0o700
    assert os.stat(built.parent).st_uid == os.geteuid()
    with pytest.raises(native.NativeKernelUnavailable, match="writable by its group or by others"):
        native.load(Path(planted))
    # and through the engine's own way in: the library from the private directory (tiny: it lacks the kernels)
    monkeypatch.setenv(native.ENV_CACHE, str(shared))
    monkeypatch.setenv("CC", setup["cc"])
    monkeypatch.setenv(native.ENV_CHOICE, "auto")
    assert native.library() is None and "lacks a kernel function" in native.status()
    assert not setup["marker"].exists()


def test_a_library_file_others_can_write_or_a_link_is_not_loaded(setup, fresh_state):
    own = directory(setup["tmp"] / "own", 0o700)
    name = expected_name(setup)
    planted = Path(shutil.copy(setup["planted"], own / name))
    planted.chmod(0o666)
    built = native.build(compiler=setup["cc"], directory=own)
    assert built.parent != own and built.name == name
    with pytest.raises(native.NativeKernelUnavailable, match="writable by its group or by others"):
        native.load(planted)
    planted.unlink()
    planted.symlink_to(setup["planted"])  # a link to a file of this user is refused too: it could point anywhere
    assert native.build(compiler=setup["cc"], directory=own).parent != own
    with pytest.raises(native.NativeKernelUnavailable, match="cannot be opened as a plain file"):
        native.load(planted)
    assert not setup["marker"].exists()


def test_a_linked_cache_directory_is_judged_by_where_it_points(setup):
    own = directory(setup["tmp"] / "own", 0o700)
    (setup["tmp"] / "to-own").symlink_to(own)
    built = native.build(compiler=setup["cc"], directory=setup["tmp"] / "to-own")
    assert built.parent == Path(os.path.realpath(own))
    shared = directory(setup["tmp"] / "shared", 0o777)
    (setup["tmp"] / "to-shared").symlink_to(shared)
    assert native.build(compiler=setup["cc"], directory=setup["tmp"] / "to-shared").parent != shared
    assert not list(shared.iterdir())  # nothing was built into it either


def test_a_missing_cache_directory_is_made_private(setup):
    made = setup["tmp"] / "new" / "mmcache"
    built = native.build(compiler=setup["cc"], directory=made)
    assert built.parent == made and stat.S_IMODE(made.stat().st_mode) == 0o700
    assert stat.S_IMODE(built.stat().st_mode) & 0o022 == 0


def test_a_library_lacking_a_function_falls_back_and_the_engine_says_so(setup, fresh_state, monkeypatch):
    monkeypatch.setenv(native.ENV_CACHE, str(directory(setup["tmp"] / "own", 0o700)))
    monkeypatch.setenv("CC", setup["cc"])
    monkeypatch.setenv(native.ENV_CHOICE, "auto")
    model, tok = build_model("tiny-llama", "float32")
    eng = Engine(model, tok, EngineConfig(page_size=16, num_pages=32))
    assert "native" not in eng.backend and native.status().startswith("aten (")
    assert "lacks a kernel function" in native.status() and "mmc_" in native.status()
    native.reset()
    monkeypatch.setenv(native.ENV_CHOICE, "require")
    with pytest.raises(native.NativeKernelUnavailable, match="lacks a kernel function"):
        native.library()


def test_libraries_loaded_one_after_another_are_each_their_own(setup):
    """Each library is loaded through its own descriptor, kept open: a later one opened under a reused
    descriptor number would have been taken by the dynamic loader for the earlier one."""
    own = directory(setup["tmp"] / "own", 0o700)
    first = Path(shutil.copy(setup["planted"], own / "first.so"))
    with pytest.raises(native.NativeKernelUnavailable, match="lacks a kernel function"):
        native.load(first)
    assert setup["marker"].exists()  # a library of this user's own, in a directory of its own: loaded
    second = native.build(compiler=setup["cc"], directory=own)
    assert native._dlopen(first).mmc_benign() == 2 and native._dlopen(second).mmc_benign() == 1
