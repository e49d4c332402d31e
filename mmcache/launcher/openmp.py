"""Which OpenMP runtime torch's CPU kernels run on, and starting the command line on Intel's.

PyPI's CPU torch ships GNU OpenMP (libgomp). Intel's runtime (libiomp5, the ``intel-openmp`` package) exports
the same ``GOMP_*`` entry points, so preloading it (``LD_PRELOAD``) makes every parallel region of torch and
oneDNN run on it; vLLM's CPU build and PyTorch's own CPU launcher (``torch.backends.xeon.run_cpu``) do this,
and the engine's prefill runs faster on it (``benchmarks/RESULTS.md``). A preload takes effect only when a
process starts, so the command line re-executes itself once with the preload set (``maybe_reexec``); code that
imports mmcache as a library keeps the runtime its process was started with (start Python with ``LD_PRELOAD``
naming ``libiomp5.so`` to run it on Intel's, as the README says).

``MMCACHE_OPENMP`` chooses: ``auto`` (default: Intel's when the ``intel-openmp`` package is installed beside
this interpreter, on Linux), ``intel`` (the same, and an error when it is missing), ``system`` (never
re-execute). ``MMCACHE_OPENMP_LIB`` names the library file to preload instead of searching for it.

Invariants: the re-execution happens at most once (the child carries ``_MARKER``); an environment that already
preloads an Intel OpenMP library is left alone; nothing here imports torch.
"""

from __future__ import annotations

import os
import site
import sys

from ..errors import MmcacheError

ENV_CHOICE = "MMCACHE_OPENMP"
ENV_LIB = "MMCACHE_OPENMP_LIB"
_MARKER = "MMCACHE_OPENMP_REEXEC"
_CHOICES = ("auto", "intel", "system")
_LIB_NAME = "libiomp5.so"


class OpenMPConfigError(MmcacheError, ValueError):
    """``MMCACHE_OPENMP`` or ``MMCACHE_OPENMP_LIB`` asks for something this machine cannot give."""


def find_intel_openmp(prefixes: list[str] | None = None) -> str | None:
    """The path of libiomp5 installed by the ``intel-openmp`` wheel (``<prefix>/lib/libiomp5.so``), or None."""
    if prefixes is None:
        prefixes = [sys.prefix, site.getuserbase()]
    for prefix in prefixes:
        path = os.path.join(prefix, "lib", _LIB_NAME)
        if os.path.isfile(path):
            return path
    return None


def plan(env: dict[str, str], platform: str = sys.platform, found: str | None = None) -> dict[str, str] | None:
    """The environment to re-execute the command line with, or None to run as is.

    ``found`` is the library ``find_intel_openmp`` located (None: not installed). Raises ``OpenMPConfigError``
    for an unknown choice, for ``intel`` without a library, and for a ``MMCACHE_OPENMP_LIB`` that is no file.
    """
    choice = env.get(ENV_CHOICE, "auto").strip().lower() or "auto"
    if choice not in _CHOICES:
        raise OpenMPConfigError(f"{ENV_CHOICE}={env[ENV_CHOICE]!r}: expected one of {', '.join(_CHOICES)}")
    if choice == "system" or env.get(_MARKER):
        return None
    lib = env.get(ENV_LIB) or found
    if env.get(ENV_LIB) and not os.path.isfile(env[ENV_LIB]):
        raise OpenMPConfigError(f"{ENV_LIB}={env[ENV_LIB]!r} is not a file")
    if not platform.startswith("linux") or lib is None:
        if choice == "intel":
            raise OpenMPConfigError(f"{ENV_CHOICE}=intel, but no Intel OpenMP library here (pip install "
                                    f"intel-openmp, or name it with {ENV_LIB}; Linux only)")
        return None
    preloads = [p for p in env.get("LD_PRELOAD", "").replace(":", " ").split() if p]
    if any(os.path.basename(p).startswith("libiomp5") for p in preloads):
        return None  # already started on Intel's runtime (for example by vLLM's env.sh)
    child = dict(env)
    child["LD_PRELOAD"] = " ".join([lib] + preloads)
    child[_MARKER] = lib
    return child


def _child_entry() -> tuple[str, str]:
    """``-c CODE`` that runs ``mmcache.cli.main`` on ``sys.argv[1:]``, importing nothing from the current
    directory: ``python -m`` and ``-c`` put that directory first on ``sys.path``, where a user's own
    ``benchmarks`` package would take the place of this project's. ``-P`` leaves it out only from Python 3.11
    (this project supports 3.10), so the code drops that first entry itself (``''``; absent under
    ``PYTHONSAFEPATH``) and, when the path lacks the folder holding this mmcache (a clone run as ``python -m
    mmcache.cli``, its folder known only as ``''``), puts it first, ahead of any installed copy, so the child
    runs the parent's mmcache."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds mmcache/launcher/
    return "-c", ("import sys\n"
                  "if sys.path and sys.path[0] == '':\n    del sys.path[0]\n"
                  f"if {root!r} not in sys.path:\n    sys.path.insert(0, {root!r})\n"
                  "from mmcache.cli import main\n"
                  "sys.exit(main())\n")


def maybe_reexec(argv: list[str], entry: tuple[str, str] | None = None) -> None:
    """Replace this process by ``python ENTRY ARGV`` on Intel's runtime when ``plan`` says so; else return.
    ``entry`` (None: ``_child_entry``, the command line) is for tests."""
    child = plan(dict(os.environ), found=find_intel_openmp())
    if child is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *(entry or _child_entry()), *argv], child)


def loaded_runtime(maps_path: str = "/proc/self/maps") -> str:
    """``intel``, ``gnu`` or ``unknown``: the OpenMP library mapped into this process (Linux; call after torch
    is imported, which maps its own). Intel's wins when both are mapped, since a preload takes the shared symbols."""
    try:
        with open(maps_path) as f:
            maps = f.read()
    except OSError:
        return "unknown"
    if "libiomp5" in maps:
        return "intel"
    if "libgomp" in maps:
        return "gnu"
    return "unknown"

