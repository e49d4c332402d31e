"""The skips a run may take on this machine, so that a test that stops running cannot read as a skip.

Every skip names the hardware or environment it waits for, in words ``EXPECTED`` knows; a skip is expected only on
a machine that lacks what its words name (``Machine``). The conftest's hook fails a run that took any other skip:
one whose reason ``EXPECTED`` does not know, or one on a machine that has what it names (a kernel that stopped
building, a way that stopped being chosen). The first entry whose words a reason contains decides, so the more
specific words come first.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Machine:
    """What the machine running the tests has, as far as a skip can wait for it."""

    bf16: bool  # AVX-512 BF16 (the kernels' vector ways, exact whole hits)
    tiles: bool  # the AMX tile unit, granted by Linux and not switched off (MMCACHE_TILE_UNIT=off)
    builds: bool  # Linux x86-64 with AVX-512 or AVX2 and FMA, and a C compiler: the compiled kernels build
    onednn: bool  # torch was built with oneDNN
    linux: bool
    git: bool  # the tests run in a git checkout
    gomp: bool  # torch ships GNU OpenMP (a stand-in for Intel's runtime)
    script: bool  # the installed `mmcache` script sits beside this interpreter

    @classmethod
    def here(cls) -> "Machine":
        import torch

        flags = _cpu_flags()
        linux_x86 = sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")
        vectors = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags or {"avx2", "fma"} <= flags
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        torch_lib = Path(torch.__file__).parent / "lib"
        return cls(bf16="avx512_bf16" in flags,
                   tiles={"amx_tile", "amx_bf16"} <= flags and _linux_grants_tiles()
                   and os.environ.get("MMCACHE_TILE_UNIT", "auto") != "off",
                   builds=linux_x86 and vectors and bool(compiler),
                   onednn=torch.backends.mkldnn.is_available(),
                   linux=sys.platform.startswith("linux"),
                   git=_in_git_checkout(),
                   gomp=any(torch_lib.glob("libgomp*.so*")),
                   script=Path(sys.executable).with_name("mmcache").is_file())


# (words of a skip's reason, whether a machine lacks what they name), most specific first.
EXPECTED = (
    ("both the AMX tile unit and AVX-512 BF16", lambda m: not (m.tiles and m.bf16)),
    ("AVX-512 BF16 or the tile unit", lambda m: not (m.tiles or m.bf16)),
    ("is not on this way", lambda m: m.tiles),  # the tile unit's way takes head sizes 32 and 64 only
    ("no way of the kernel takes head size", lambda m: not m.bf16),
    ("oneDNN widens bfloat16", lambda m: not m.bf16),
    ("tile unit", lambda m: not m.tiles),
    ("AVX-512 BF16", lambda m: not m.bf16),
    ("kernel cannot be built here", lambda m: not m.builds),
    ("kernel is not expected to build", lambda m: not m.builds),
    ("no C compiler", lambda m: not m.builds),
    ("oneDNN is not available", lambda m: not m.onednn),
    ("not a git checkout", lambda m: not m.git),
    ("LD_PRELOAD is the Linux loader's", lambda m: not m.linux),
    ("no libgomp", lambda m: not m.gomp),
    ("needs the installed `mmcache` script", lambda m: not (m.script and m.gomp)),
)


def unexpected(reason: str, machine: Machine) -> str | None:
    """Why a skip with ``reason`` should not have happened on ``machine``, or None where it is expected."""
    for words, lacking in EXPECTED:
        if words in reason:
            return None if lacking(machine) else f"this machine has what it waits for ({words!r})"
    return "its reason names no hardware or environment that tests/skips.py knows"


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next(ln for ln in f if ln.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return set()


def _linux_grants_tiles() -> bool:
    """Linux hands out the tile registers on request from 5.16."""
    release = platform.release().split("-")[0].split(".")
    return len(release) >= 2 and all(x.isdigit() for x in release[:2]) and (int(release[0]), int(release[1])) >= (5, 16)


def _in_git_checkout() -> bool:
    try:
        done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--git-dir"], capture_output=True)
    except OSError:
        return False
    return done.returncode == 0
