"""The engine's compiled CPU kernels (``csrc/``), built on first use into one library: paged decode attention
and the attention of a bfloat16 prefill chunk over its cached prefix and its own keys (``chunk_attention``, its
products on the AMX tile unit where the CPU grants it, else with AVX-512 BF16 dot products: ``chunk_way``), both
in ``decode_attention.c``; the Llama family's RMSNorm in one pass per row
(``rms_norm``, ``rms_norm.c``, installed as modules by ``norms``); and its rotary position embedding, with the
same bits as transformers' code (``rotary``, ``rotary.c``, installed by ``mmcache.engine.compute.rotary``); and the
linear products of a decode step's few rows with a weight laid out once for them in its own dtype: on AVX2
builds in float32 (``linear`` and ``RowWeight``, ``linear.c``, used by ``kernels.PackedWeight`` where
``row_products`` says so), and for bfloat16 weights on the AMX tile unit, else with AVX-512 BF16 dot products
(``TileWeight``, ``tile_linear.c``, the way ``product_way`` names). ``MMCACHE_TILE_UNIT=off`` keeps the tile unit
out of all of them (``ComputeSettings.tile_unit``; the environment is read in ``settings``).

ATen's flash attention has a fixed cost of tens of microseconds per call, and a decode calls it once per
sequence and layer with only ``G`` query rows (the query heads of one KV head); it also needs each sequence's
pages as one tensor. The kernel here attends every decoding sequence of a step in one call per layer, reading
keys and values where they lie in the page pool through each sequence's page table, in parallel over
(sequence, KV head).

It is C on vectors of the CPU's widest float32 lanes (``csrc/simd.h``: 16 with AVX-512, else 8 with AVX2 and FMA,
as on AMD Zen 2 and 3 or Intel Haswell to Comet Lake), plus AVX-512 BF16 and AMX tiles for bfloat16 where the CPU
has them; on an AVX-512 CPU the AVX2 path is not compiled. It is compiled at run
time with the machine's C compiler (``$CC``, else ``cc``; ``-O3 -march=native -fopenmp``) into a per-user
cache (``$MMCACHE_CACHE_DIR``, else ``$XDG_CACHE_HOME/mmcache``, else ``~/.cache/mmcache``) and loaded with
``ctypes``; nothing beyond torch is imported. An engine asks for it once, when it is built (``Engine``), and
names the choice in its attention backend. The library's name
carries a digest of the sources, the flags, the compiler's version and the CPU's model and flags, so a changed
source, compiler or machine builds anew, and a build is written under a temporary name and renamed into
place, so concurrent processes never load a half-written file.

Only this user's own files are loaded: the cache directory (a symbolic link is followed and the directory it
names checked) must belong to the user and be writable by no group and no one else, and so must the library
file (a regular file, not a link); ``load`` checks both on the opened directory and file and loads that very
file (through ``/proc/self/fd``), so nothing can be swapped in between. Where the cache directory fails the
check, the kernel is built into a private directory of this process (``mkdtemp``, mode 0700, removed at
exit) and a warning names the directory and why. A library that loads but lacks a function the engine calls
is unavailable like one that does not build (``NativeKernelUnavailable``).

``MMCACHE_NATIVE`` chooses: ``auto`` (default: use the kernel when it builds, else fall back to ATen and log
why once), ``off`` (always ATen), ``require`` (raise ``NativeKernelUnavailable`` when it cannot be built).

For a head size of 64, ATen's flash kernel spends most of a prefill chunk's attention moving scores through
memory, and a chunk over a cached prefix takes two of its calls (the prefix, then the chunk's own keys) merged
by their log-sum-exps. ``chunk_attention`` does both parts in one call: both products in blocks of 16 query
rows, each block's running maximum kept while its scores are still in L1, the causal mask applied only on the
key blocks that need it, and the probabilities handed to the second product already in its layout. The
products run on the tile unit (head sizes 32 and 64) where the CPU grants it, else on the vector unit with
AVX-512 BF16 dot products, one lane per query row (head sizes 32 to 128); each way has its own summation
order, so the backend names it.

Invariants: ``decode_attention`` returns, for every sequence and KV head, a result that depends only on that
sequence's queries, pages and bounds (so a decode gives the same bits alone or beside others, and with or
without shared pages), in float32 arithmetic; ``chunk_attention`` returns for every query row a result that
depends only on that row, its token and the keys and values; shapes they do not take (``supports``,
``supports_chunk``) never reach them.
"""

from __future__ import annotations

import atexit
import copy
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

from ...errors import MmcacheError
from .settings import ENV_CACHE, ENV_CHOICE, ComputeSettings, NativeConfigError
from .settings import ENV_TILES  # noqa: F401 (callers name the variables here, beside the library)

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "decode_attention.c", CSRC / "rms_norm.c", CSRC / "rotary.c", CSRC / "linear.c",
           CSRC / "tile_linear.c", CSRC / "activation.c")
HEADERS = (CSRC / "simd.h",)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
LIBS = ("-lm",)
MAX_GROUP, MAX_HEAD_DIM = 16, 512
#: What ``chunk_way`` returns: the chunk kernel's products on the tile unit (AMX), on the vector unit (AVX-512
#: BF16 dot products, for CPUs without tiles), or not at all (ATen's path).
CHUNK_TILES, CHUNK_VECTOR, CHUNK_NONE = "tiles", "vector", None
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_log = logging.getLogger("mmcache.native")


class NativeKernelUnavailable(MmcacheError, RuntimeError):
    """``MMCACHE_NATIVE=require`` and the kernel cannot be built or loaded here; the message says why."""


_state: dict = {}  # "lib": the loaded library or None, "why": the reason it is None; filled once per process
_state_lock = threading.Lock()  # threads wanting the library at once build and load it once
_private: dict = {}  # "dir": this process's private build directory, made when a cache directory is refused
_private_lock = threading.Lock()
_refusals: set = set()  # (directory, why) pairs already warned about


def cache_dir(settings: ComputeSettings | None = None) -> Path:
    """Where ``build`` keeps libraries (checked there before use: see the module's docstring)."""
    return (settings or ComputeSettings.from_env()).library_dir


def _not_ours(st: os.stat_result, what: str) -> str | None:
    """Why the file or directory with status ``st`` (from ``lstat`` or ``fstat``) is not this user's alone, or
    None: a symbolic link, another owner, or writable by its group or by others."""
    if stat.S_ISLNK(st.st_mode):
        return f"{what} is a symbolic link"
    if st.st_uid != os.geteuid():
        return f"{what} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} is writable by its group or by others ({stat.filemode(st.st_mode)})"
    return None


def _own_directory(directory: Path) -> tuple[Path, str | None]:
    """``directory`` made where missing (mode 0700) and resolved through symbolic links, and None; or, when it
    cannot be made or is not this user's alone, the reason."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        real = Path(os.path.realpath(directory))
        st = os.lstat(real)
    except OSError as exc:
        return directory, f"{directory} cannot be made or read ({exc})"
    if not stat.S_ISDIR(st.st_mode):
        return real, f"{directory} is not a directory"
    return real, _not_ours(st, f"directory {directory}")


def _private_directory() -> Path:
    """This process's own build directory (``mkdtemp``: mode 0700), made on first call, removed at exit."""
    with _private_lock:
        if "dir" not in _private:
            where = Path(tempfile.mkdtemp(prefix="mmcache-kernels-"))
            atexit.register(shutil.rmtree, where, ignore_errors=True)  # a loaded library outlives its file
            _private["dir"] = where
        return _private["dir"]


def _refuse(directory: Path, why: str) -> Path:
    """The private directory to build in instead of ``directory``, with a warning (once per reason)."""
    if (str(directory), why) not in _refusals:
        _refusals.add((str(directory), why))
        _log.warning("not loading compiled kernels from %s: %s; building them in a private temporary directory "
                     "(make the directory yours alone, e.g. chmod go-w, or set %s)", directory, why, ENV_CACHE)
    return _private_directory()


def _machine() -> str:
    """The CPU's model and feature flags (what ``-march=native`` compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(keep))


def build(compiler: str | None = None, directory: Path | None = None,
          sources: tuple[Path, ...] | None = None, settings: ComputeSettings | None = None) -> Path:
    """Compile the kernel (or find it already compiled) and return the library's path. ``compiler`` and
    ``directory`` default to ``settings``' (by default the environment's: ``ComputeSettings.from_env``).

    ``sources``: other copies of ``SOURCES`` (in that order, the headers of ``HEADERS`` beside them), such as
    an earlier revision's to measure against (``benchmarks/chunk_kernel.py --against``); by default this
    package's own.

    Raises ``NativeKernelUnavailable`` with the reason: not Linux on x86-64, no compiler, or the compiler's own
    message (for example the source's ``#error`` on a CPU with neither AVX-512 nor AVX2 and FMA).
    """
    sources = tuple(sources or SOURCES)
    headers = tuple(sources[0].with_name(h.name) for h in HEADERS)
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise NativeKernelUnavailable(f"the decode kernel is built for Linux on x86-64, not {sys.platform} "
                                      f"on {platform.machine()}")
    settings = settings or ComputeSettings.from_env()
    cc, version = _compiler(compiler or settings.compiler)
    name = f"decode_attention-{_build_digest(sources + headers, cc, version)}.so"
    target, built = _library_target(directory or settings.library_dir, name)
    if not built:
        _compile(cc, sources, target)
    return target


def _compiler(chosen: str | None) -> tuple[str, str]:
    """The C compiler to build with (``chosen``, else ``cc``, else ``gcc`` on the path) and its ``--version``
    text; ``NativeKernelUnavailable`` where there is none or it does not run."""
    cc = chosen or shutil.which("cc") or shutil.which("gcc")
    if not cc or not shutil.which(cc):
        raise NativeKernelUnavailable(f"no C compiler found ({cc or 'cc'}; set CC to one)")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeKernelUnavailable(f"C compiler {cc} did not run: {exc}") from exc
    return cc, version


def _build_digest(files: tuple[Path, ...], cc: str, version: str) -> str:
    """The library's name part: a digest of the sources and headers, the flags, the compiler and its version,
    and the CPU (so any of them changing builds anew)."""
    digest = hashlib.sha256()
    for part in (*(f.read_bytes() for f in files), " ".join(FLAGS + LIBS).encode(), cc.encode(),
                 version.encode(), _machine().encode()):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:20]


def _library_target(directory: Path, name: str) -> tuple[Path, bool]:
    """Where the library ``name`` lies or is to be built, and whether it is already built there: in
    ``directory`` where it and the file are this user's alone, else in this process's private directory."""
    directory, why = _own_directory(directory)
    if why is not None:
        directory = _refuse(directory, why)
    target = directory / name
    try:
        why = _not_ours(os.lstat(target), f"library {target}")
    except FileNotFoundError:
        return target, False
    if why is None:
        return target, True
    target = _refuse(directory, why) / name
    return target, target.exists()


def _compile(cc: str, sources: tuple[Path, ...], target: Path) -> None:
    """Builds ``sources`` into ``target`` with ``cc``; ``NativeKernelUnavailable`` with the compiler's message."""
    # one file per builder (processes, and threads of one process), moved into place whole
    partial = target.with_name(f"{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        done = subprocess.run([cc, *FLAGS, "-o", str(partial), *map(str, sources), *LIBS], capture_output=True,
                              text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeKernelUnavailable(f"{cc} failed to run: {exc}") from exc
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        message = (done.stderr or done.stdout).strip().splitlines()
        names = ", ".join(f.name for f in sources)
        raise NativeKernelUnavailable(f"{cc} could not build {names}: " + " | ".join(message[:6]))
    os.chmod(partial, 0o755)  # writable by no one else whatever the umask: ``load`` refuses such a file
    os.replace(partial, target)


def _open_own(path: Path) -> tuple[int, int]:
    """File descriptors of ``path``'s directory and of ``path`` itself, after checking (on the opened
    descriptors, so nothing can be swapped in between) that both are this user's alone and the file a regular
    file; ``NativeKernelUnavailable`` with the reason otherwise."""
    parent = Path(os.path.realpath(path.parent))
    dfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    fd = -1
    try:
        why = _not_ours(os.fstat(dfd), f"directory {parent}")
        if why is None:
            try:
                fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            except OSError as exc:  # O_NOFOLLOW on a link: ELOOP
                why = f"library {path} cannot be opened as a plain file ({exc.strerror})"
            else:
                st = os.fstat(fd)
                why = (f"library {path} is not a regular file" if not stat.S_ISREG(st.st_mode)
                       else _not_ours(st, f"library {path}"))
        if why is not None:
            raise NativeKernelUnavailable(f"refused to load {path.name}: {why}")
        return dfd, fd
    except BaseException:
        for f in (fd, dfd):
            if f >= 0:
                os.close(f)
        raise


def _dlopen(path: Path) -> ctypes.CDLL:
    """``path`` loaded, once ``_open_own`` accepted it: the very file it checked where ``/proc`` shows it.

    The file's descriptor stays open as long as the process (as the library stays loaded: ctypes never
    unloads one): the dynamic loader knows a library by the name it was opened under, so a later library
    opened through the same descriptor number would be taken for this one."""
    dfd, fd = _open_own(path)
    os.close(dfd)
    opened = f"/proc/self/fd/{fd}"
    if not os.path.exists(opened):  # no /proc: the checked path itself
        os.close(fd)
        return ctypes.CDLL(str(path))
    try:
        lib = ctypes.CDLL(opened)
    except BaseException:
        os.close(fd)
        raise
    lib.descriptor = fd
    return lib


def load(path: Path, tile_unit: bool | None = None) -> ctypes.CDLL:
    """The library at ``path`` (from ``build``) with its functions' argument types declared, allowed the AMX
    tile unit where ``tile_unit`` (default: ``ComputeSettings.from_env().tile_unit``). ``NativeKernelUnavailable``
    where the file or its directory is not this user's alone (``_open_own``) or it lacks a function the engine
    calls."""
    lib = _dlopen(Path(path))
    lib.path = Path(path)  # where it was found (ctypes names it by the descriptor it was loaded through)
    try:
        return _declare(lib, ComputeSettings.from_env().tile_unit if tile_unit is None else tile_unit)
    except AttributeError as exc:  # ctypes: "...: undefined symbol: mmc_..."
        raise NativeKernelUnavailable(f"{Path(path).name} lacks a kernel function ({exc}); built from other "
                                      f"sources?") from exc


def _declare(lib: ctypes.CDLL, use_tiles: bool) -> ctypes.CDLL:
    """``lib`` with the argument and result types of its functions declared and its capabilities read; the tile
    unit used only where ``use_tiles``."""
    _declare_attention(lib)
    _declare_layers(lib)
    lib.mmc_init.argtypes = [ctypes.c_int]
    lib.mmc_init.restype = ctypes.c_int
    lib.tiles = bool(lib.mmc_init(int(use_tiles)))  # scores on the tile unit (AMX) where the CPU and the OS allow it
    _declare_tile_products(lib, use_tiles)
    _declare_vector_products(lib)
    fn = lib.mmc_silu_mul
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    fn.restype = ctypes.c_int
    lib.lanes = int(lib.mmc_lanes())  # float32 lanes per vector: 16 (AVX-512) or 8 (AVX2)
    return lib


def _declare_attention(lib: ctypes.CDLL) -> None:
    """Declares the attention kernels' types: paged decode, prefill chunk, and the chunk kernel's way."""
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn = lib.mmc_decode_attention
    fn.argtypes = [ctypes.c_int, ptr, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float,
                   ptr, ctypes.c_int]
    fn.restype = ctypes.c_int
    fn = lib.mmc_chunk_attention
    fn.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float,
                   ptr, ptr, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    lib.mmc_chunk_way.argtypes = [i64, ctypes.c_int]
    lib.mmc_chunk_way.restype = ctypes.c_int


def _declare_layers(lib: ctypes.CDLL) -> None:
    """Declares the types of the layer kernels every library has: RMSNorm, rotary, float32 row products."""
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn = lib.mmc_rms_norm
    fn.argtypes = [ctypes.c_int, ptr, i64, ptr, i64, i64, ctypes.c_float, ptr, ctypes.c_int]
    fn.restype = ctypes.c_int
    fn = lib.mmc_rotary
    fn.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr, ptr, i64, i64, i64, i64, i64, i64, ptr, i64, i64, i64,
                   ctypes.c_int]
    fn.restype = ctypes.c_int
    fn = lib.mmc_linear
    fn.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr, ptr, ctypes.c_int]
    fn.restype = ctypes.c_int
    fn = lib.mmc_pack_rows
    fn.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, ctypes.c_int]
    fn.restype = ctypes.c_int
    lib.mmc_row_panel.restype = ctypes.c_int


def _declare_tile_products(lib: ctypes.CDLL, use_tiles: bool) -> None:
    """Declares the tile unit's bfloat16 products and sets ``lib.tile_rows``: rows per tile, 0 where they cannot
    run (a CPU without the tile unit, or ``use_tiles`` false)."""
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.mmc_tile_elements.argtypes = [i64, i64]
    lib.mmc_tile_elements.restype = i64
    fn = lib.mmc_tile_pack
    fn.argtypes = [ptr, i64, i64, ptr, ctypes.c_int]
    fn.restype = ctypes.c_int
    fn = lib.mmc_tile_linear
    fn.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, ctypes.c_int]
    fn.restype = ctypes.c_int
    lib.mmc_tile_rows.restype = ctypes.c_int
    lib.tile_rows = int(lib.mmc_tile_rows()) if use_tiles else 0


def _declare_vector_products(lib: ctypes.CDLL) -> None:
    """Declares the AVX-512 BF16 products and sets ``lib.vector_rows``: rows per group, 0 where they cannot run."""
    fn = lib.mmc_vector_linear
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    fn.restype = ctypes.c_int
    lib.mmc_vector_rows.restype = ctypes.c_int
    lib.vector_rows = int(lib.mmc_vector_rows())


def library(settings: ComputeSettings | None = None) -> ctypes.CDLL | None:
    """The loaded kernel, or None when ``settings.native`` (by default ``MMCACHE_NATIVE``) is off or (under
    auto) it cannot be built here. Built and loaded once per process (until ``reset``), with the settings of
    that first call."""
    settings = settings or ComputeSettings.from_env()
    mode = settings.native
    if mode == "off":
        return None
    with _state_lock:
        if "lib" not in _state:
            try:
                lib, why = load(build(settings=settings), settings.tile_unit), None
            except (NativeKernelUnavailable, OSError) as exc:
                lib, why = None, str(exc)
                _log.info("decode kernel unavailable, using ATen: %s", exc)
            _state["why"] = why
            _state["lib"] = lib  # last: a reader that finds "lib" finds "why" too
        lib, why = _state["lib"], _state["why"]
    if lib is None and mode == "require":
        raise NativeKernelUnavailable(why)
    return lib


def status(settings: ComputeSettings | None = None) -> str:
    """What decode attention runs on in this process: ``native`` (with what the tile unit or AVX-512 BF16 adds:
    AMX scores and prefill chunks on the tile unit, or prefill chunks on the vector way; or that the kernel
    runs on AVX2's 8 lanes), or ``aten (why)``."""
    try:
        lib = library(settings)
        if lib is not None:
            if lib.tiles:
                return "native (AMX scores)"
            if chunk_way(lib, 64) is CHUNK_VECTOR:
                return "native (prefill chunks on AVX-512 BF16)"
            return "native" if lib.lanes == 16 else "native (AVX2)"
        return f"aten ({_state.get('why') or ENV_CHOICE + '=off'})"
    except (NativeKernelUnavailable, NativeConfigError) as exc:
        return f"aten ({exc})"


def reset() -> None:
    """Forget the loaded library and the reason for its absence (the next ``library()`` tries again)."""
    with _state_lock:
        _state.clear()


def supports(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """Whether ``decode_attention`` takes queries ``q`` (n, kv_heads, G, d) over pool ``kv`` on this device."""
    group, dim = q.shape[2], q.shape[3]
    return (q.device.type == "cpu" and kv.device.type == "cpu" and q.dtype in _DTYPES and kv.dtype == q.dtype
            and 1 <= group <= MAX_GROUP and 16 <= dim <= MAX_HEAD_DIM and dim % 16 == 0)


def chunk_way(lib: ctypes.CDLL | None, dim: int, vector_only: bool = False) -> str | None:
    """How ``chunk_attention`` runs a head size of ``dim`` in this process: ``CHUNK_TILES`` (d 32 or 64 where
    the tile unit is granted; other sizes there stay on ATen), ``CHUNK_VECTOR`` (d a multiple of 32 up to 128,
    on CPUs with AVX-512 BF16 and no granted tile unit), or ``CHUNK_NONE``. ``vector_only`` asks for the vector
    way whatever the CPU grants (what the tests compare the tile way with)."""
    if lib is None:
        return CHUNK_NONE
    return {2: CHUNK_TILES, 1: CHUNK_VECTOR}.get(lib.mmc_chunk_way(int(dim), int(vector_only)), CHUNK_NONE)


def supports_chunk(lib: ctypes.CDLL, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                   k_prefix: torch.Tensor | None = None, v_prefix: torch.Tensor | None = None,
                   vector_only: bool = False) -> bool:
    """Whether ``chunk_attention`` takes queries ``q`` (kv_heads, G * n, d) with the chunk's own keys and values
    ``k_new``/``v_new`` (kv_heads, n, d) and optionally cached ones ``k_prefix``/``v_prefix`` (kv_heads, S, d):
    bfloat16 on a CPU, a head size ``chunk_way`` takes, each key and value row contiguous (heads may lie apart,
    and the chunk's own rows too: views of the pool and of the step's keys)."""
    dim = q.shape[-1]
    if not (chunk_way(lib, dim, vector_only) is not CHUNK_NONE and q.device.type == "cpu"
            and q.dtype == torch.bfloat16 and q.dim() == 3):
        return False
    parts = [k_new, v_new] + ([] if k_prefix is None and v_prefix is None else [k_prefix, v_prefix])
    if any(t is None or t.dim() != 3 or t.dtype != q.dtype or t.device.type != "cpu" or t.shape[0] != q.shape[0]
           or t.shape[2] != dim or t.stride(2) != 1 or t.stride(1) < dim for t in parts):
        return False
    if k_prefix is not None and not k_prefix.stride(1) == v_prefix.stride(1) == dim:
        return False
    n = k_new.shape[1]
    prefix_ok = len(parts) == 2 or (k_prefix.shape == v_prefix.shape and k_prefix.shape[1] >= 1)
    return n >= 1 and v_new.shape == k_new.shape and q.shape[1] % n == 0 and q.shape[1] >= n and prefix_ok


def chunk_attention(lib: ctypes.CDLL, q: torch.Tensor, k_prefix: torch.Tensor | None, v_prefix: torch.Tensor | None,
                    k_new: torch.Tensor, v_new: torch.Tensor, scale: float, threads: int | None = None,
                    vector_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a prefill chunk of ``n`` tokens: ``q`` (kv_heads, G * n, d) holds each KV head's ``G`` query
    heads one after another (row ``r`` is token ``r % n``); every row sees all ``S`` cached keys ``k_prefix``
    (kv_heads, S, d; None when the chunk starts the sequence) and the chunk's own keys ``k_new`` (kv_heads, n, d)
    up to its own token. Returns the output (kv_heads, G * n, d) and each row's log-sum-exp of its scaled
    scores (kv_heads, G * n), both float32. The caller checked ``supports_chunk``. Each row's result depends
    only on its own query, its token and the keys and values (the same bits in any company and on any number of
    threads); the probabilities are rounded to bfloat16 for the second product, as ATen's flash kernel rounds
    them for bfloat16 inputs."""
    kv_heads, rows, dim = q.shape
    q = q.contiguous()
    out = torch.empty(kv_heads, rows, dim, dtype=torch.float32)
    lse = torch.empty(kv_heads, rows, dtype=torch.float32)
    cached = 0 if k_prefix is None else k_prefix.shape[1]
    rc = lib.mmc_chunk_attention(q.data_ptr(), 0 if k_prefix is None else k_prefix.data_ptr(),
                                 0 if v_prefix is None else v_prefix.data_ptr(), k_new.data_ptr(), v_new.data_ptr(),
                                 kv_heads, rows, cached, k_new.shape[1], dim,
                                 0 if k_prefix is None else k_prefix.stride(0),
                                 0 if v_prefix is None else v_prefix.stride(0), k_new.stride(0), v_new.stride(0),
                                 k_new.stride(1), v_new.stride(1), float(scale), out.data_ptr(), lse.data_ptr(),
                                 threads or torch.get_num_threads(), int(vector_only))
    if rc != 0:
        raise ValueError(f"chunk kernel refused its arguments (code {rc}): queries {tuple(q.shape)}, cached keys "
                         f"{cached}, own keys {tuple(k_new.shape)}")
    return out, lse


def decode_attention(lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,
                     lo: torch.Tensor, hi: torch.Tensor, scale: float, threads: int | None = None) -> torch.Tensor:
    """Attention of one query token per sequence over its own pages.

    ``q`` (n, kv_heads, G, d); ``k``/``v`` one layer's pool (kv_heads, pages, page_size, d); ``table`` (n, T)
    int64 page ids; sequence ``j`` attends to positions ``lo[j] .. hi[j] - 1``. Returns (n, kv_heads, G, d) in
    ``q``'s dtype. The caller checked ``supports``; the pools must be contiguous (they are views of the pool).
    """
    n, kv_heads, group, dim = q.shape
    if not (k.is_contiguous() and v.is_contiguous()) or k.shape != v.shape or k.shape[0] != kv_heads:
        raise ValueError(f"decode kernel: pools {tuple(k.shape)} / {tuple(v.shape)} do not match queries "
                         f"{tuple(q.shape)} or are not contiguous")
    q = q.contiguous()
    table = table.to(torch.int64).contiguous()
    lo = lo.to(torch.int64).contiguous()
    hi = hi.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    rc = lib.mmc_decode_attention(_DTYPES[q.dtype], q.data_ptr(), k.data_ptr(), v.data_ptr(), table.data_ptr(),
                                  table.shape[1], lo.data_ptr(), hi.data_ptr(), n, kv_heads, group, dim, k.shape[1],
                                  k.shape[2], float(scale), out.data_ptr(), threads or torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"decode kernel refused its arguments (code {rc}): queries {tuple(q.shape)}, bounds "
                         f"{lo.tolist()} .. {hi.tolist()}")
    return out


def rms_norm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float,
             threads: int | None = None) -> torch.Tensor:
    """``weight * dtype(h * rsqrt(mean(h * h, -1) + eps))`` with ``h = float32(x)``, over ``x``'s last dimension:
    the Llama family's RMSNorm in one pass per row. ``x`` and ``weight`` float32 or bfloat16 alike, on the CPU;
    returns a new tensor of ``x``'s shape and dtype. A row's result depends only on that row (any company, any
    number of threads); it may differ from the module's own forward in the last bit of a few elements (the sum
    of squares is taken in another order)."""
    cols = x.shape[-1]
    if (x.dtype not in _DTYPES or weight.dtype != x.dtype or x.device.type != "cpu" or weight.device.type != "cpu"
            or weight.shape != (cols,) or cols < 1):
        raise ValueError(f"rms_norm takes float32 or bfloat16 CPU tensors with a weight of the last dimension's "
                         f"size: got x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    rows = x.reshape(-1, cols)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    weight = weight.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    rc = lib.mmc_rms_norm(_DTYPES[x.dtype], rows.data_ptr(), rows.stride(0) if rows.shape[0] > 1 else cols,
                          weight.data_ptr(), rows.shape[0], cols, float(eps), out.data_ptr(),
                          threads or torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"rms_norm kernel refused its arguments (code {rc}): x {tuple(x.shape)}, eps {eps!r}")
    return out


def rotary(lib: ctypes.CDLL, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           threads: int | None = None) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` for ``x`` (B, H, T, D) and ``cos``/``sin`` (B, T, D), each operation
    rounded to the element type as torch rounds it, so the same bits as transformers' ``apply_rotary_pos_emb``
    (with ``unsqueeze_dim=1``) gives for one of its two tensors. float32 or bfloat16 alike, on the CPU, D even,
    each row contiguous (``x`` may be a view, such as the projections' transpose). Returns a tensor laid out
    as ``x`` is (``torch.empty_like``), which is how torch lays out its own result for the attention modules'
    inputs."""
    if not rotary_takes(x, cos, sin):
        raise ValueError(f"rotary takes x (B, H, T, D) and cos, sin (B, T, D) of one float32 or bfloat16 dtype on "
                         f"the CPU, D even, rows contiguous: got x {tuple(x.shape)} {x.dtype}, cos "
                         f"{tuple(cos.shape)} {cos.dtype}, sin {tuple(sin.shape)} {sin.dtype}")
    return rotary_taken(lib, x, cos, sin, threads)


def rotary_taken(lib: ctypes.CDLL, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 threads: int | None = None) -> torch.Tensor:
    """``rotary`` for tensors the caller already checked with ``rotary_takes`` (the per-layer path)."""
    out = torch.empty_like(x)
    xs, os_, cs = x.stride(), out.stride(), cos.stride()
    b, h, t, d = x.shape
    rc = lib.mmc_rotary(_DTYPES[x.dtype], x.data_ptr(), xs[0], xs[1], xs[2], cos.data_ptr(), sin.data_ptr(), cs[0],
                        cs[1], b, h, t, d, out.data_ptr(), os_[0], os_[1], os_[2], threads or torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"rotary kernel refused its arguments (code {rc}): x {tuple(x.shape)}")
    return out


def rotary_takes(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether ``rotary`` takes these tensors (see there)."""
    return (x.dim() == 4 and cos.dim() == 3 and x.dtype in _DTYPES and cos.dtype == sin.dtype == x.dtype
            and x.device.type == cos.device.type == sin.device.type == "cpu" and cos.shape == sin.shape
            and cos.shape == (x.shape[0], x.shape[2], x.shape[3]) and x.shape[3] % 2 == 0 and x.shape[3] >= 2
            and x.stride(3) == 1 and cos.stride(2) == 1 and cos.stride() == sin.stride())


ROW_PRODUCT_ROWS = 64  # products of at most this many rows go to ``linear`` where ``row_products`` says so


def row_products(lib: ctypes.CDLL | None) -> bool:
    """Whether the engine computes products of at most ``ROW_PRODUCT_ROWS`` rows with ``linear``: where the
    library is its AVX2 build (8 lanes). There oneDNN has no bfloat16 path (bfloat16 weights go through a
    float32 copy, twice the bytes per decode step) and its float32 product at these row counts reads the
    weight under the memory's speed and computes under the CPU's multiply-add rate (the kernel was ahead of it
    up to 64 rows on an AMD Zen 3, at par from 128: ``benchmarks/row_products.py``). On AVX-512 builds oneDNN
    keeps them: it has its own bfloat16 products there, and this kernel has not been measured against them."""
    return lib is not None and lib.lanes == 8


def _row_bias(bias: torch.Tensor | None, n: int) -> torch.Tensor | None:
    if bias is None:
        return None
    if bias.dtype != torch.float32 or bias.shape != (n,) or bias.device.type != "cpu":
        raise ValueError(f"linear takes a float32 bias (N) = ({n},) on the CPU or None: got {tuple(bias.shape)} "
                         f"{bias.dtype} on {bias.device}")
    return bias.detach().contiguous()


def _rows(x: torch.Tensor, dtype: torch.dtype, k: int, n: int, name: str) -> torch.Tensor:
    """``x`` (..., K) of ``dtype`` on the CPU as contiguous rows (M, K) (a copy only where not contiguous); a
    ValueError naming the kernel ``name`` otherwise."""
    if x.dtype is not dtype or x.dim() < 1 or x.shape[-1] != k or not x.is_cpu:
        raise ValueError(f"{name} takes x (..., K) {str(dtype).removeprefix('torch.')} on the CPU for a weight "
                         f"(N, K) = {(n, k)}: got x {tuple(x.shape)} {x.dtype} on {x.device}")
    rows = x.reshape(-1, k)
    return rows if rows.is_contiguous() else rows.contiguous()


class RowWeight:
    """A weight (N, K) float32 or bfloat16 laid out once for ``linear``, in its own dtype, and its bias (N)
    float32 or None: panels of ``lib.mmc_row_panel()`` output columns (16 on AVX2, 32 on AVX-512), k-major, so
    that a product streams each panel once and meets every input row with it in registers (``csrc/linear.c``).
    As many bytes as the weight, padded to whole panels; a copy made when built (a later in-place change of the
    weight is not seen). Called on ``x`` (..., K) float32, returns ``x @ weight^T + bias`` (..., N) float32;
    only ``x`` is checked per call (a decode step makes about five calls per layer)."""

    def __init__(self, lib: ctypes.CDLL, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 threads: int | None = None):
        if (weight.dtype not in _DTYPES or weight.dim() != 2 or weight.shape[0] < 1 or weight.shape[1] < 1
                or weight.device.type != "cpu"):
            raise ValueError(f"a row weight is a (N, K) float32 or bfloat16 tensor on the CPU: got "
                             f"{tuple(weight.shape)} {weight.dtype} on {weight.device}")
        weight = weight.detach().contiguous()
        self.n, self.k = weight.shape
        self.dtype = weight.dtype
        self.bias = _row_bias(bias, self.n)
        width = int(lib.mmc_row_panel())
        self.panels = torch.empty(-(-self.n // width), self.k, width, dtype=weight.dtype)
        rc = lib.mmc_pack_rows(_DTYPES[weight.dtype], weight.data_ptr(), self.n, self.k, self.panels.data_ptr(),
                               threads or torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"the row kernel could not lay out a weight {tuple(weight.shape)} (code {rc})")
        self._fn, self._code = lib.mmc_linear, _DTYPES[weight.dtype]

    @property
    def nbytes(self) -> int:
        return self.panels.numel() * self.panels.element_size()

    def with_bias(self, bias: torch.Tensor | None) -> RowWeight:
        """The same panels (shared, not copied) with another bias."""
        other = copy.copy(self)
        other.bias = _row_bias(bias, self.n)
        return other

    def __call__(self, x: torch.Tensor, threads: int | None = None) -> torch.Tensor:
        rows = _rows(x, torch.float32, self.k, self.n, "linear")
        m = rows.shape[0]
        out = torch.empty(m, self.n, dtype=torch.float32)
        rc = self._fn(self._code, rows.data_ptr(), m, self.k, self.panels.data_ptr(), self.n,
                      None if self.bias is None else self.bias.data_ptr(), out.data_ptr(),
                      threads or torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"linear kernel refused its arguments (code {rc}): x {tuple(x.shape)}, weight "
                             f"{(self.n, self.k)}")
        return out if x.dim() == 2 else out.view(x.shape[:-1] + (self.n,))


def linear(lib: ctypes.CDLL, x: torch.Tensor, weight: RowWeight | torch.Tensor, bias: torch.Tensor | None = None,
           threads: int | None = None) -> torch.Tensor:
    """``x @ weight^T + bias`` in float32 for ``x`` (..., K) float32, ``weight`` a ``RowWeight`` (or a (N, K)
    float32 or bfloat16 tensor, laid out for this call), ``bias`` (N) float32 or None (or the row weight's own);
    returns (..., N) float32. Element (m, n) depends only on row m of ``x``, row n of the weight and ``bias[n]``
    (the same bits in any company and on any number of threads): a float32 multiply-add per k, k ascending,
    then the bias (``csrc/linear.c``); bfloat16 weights are widened exactly."""
    if isinstance(weight, RowWeight):
        if bias is None:
            return weight(x, threads)
        if weight.bias is not None:
            raise ValueError("linear takes a bias or a row weight with one, not both")
        weight = weight.with_bias(bias)
    else:
        weight = RowWeight(lib, weight, bias, threads)
    return weight(x, threads)


TILE_PRODUCT_ROWS = 128  # bfloat16 products of at most this many rows go to ``tile_linear`` (``tile_products``)


#: The ways of ``TileWeight``'s products: on the AMX tile unit, or on the vector unit with AVX-512 BF16.
PRODUCTS_TILES, PRODUCTS_VECTOR = "tiles", "vector"


def tile_products(lib: ctypes.CDLL | None) -> bool:
    """Whether the engine computes bfloat16 products of at most ``TILE_PRODUCT_ROWS`` rows (a decode step's, or
    a page-sized prefill chunk's) with ``tile_linear``: where the library was built for a CPU with the AMX tile
    unit and Linux grants it (and ``ComputeSettings.tile_unit``). On the Intel AMX machine of
    RESULTS.md oneDNN's products of a few rows streamed the weights at 13-17 GB/s and this kernel's at 20-24 GB/s
    (``benchmarks/row_products.py``; RESULTS.md, "Decode products on the tile unit")."""
    return lib is not None and getattr(lib, "tile_rows", 0) > 0


def vector_products(lib: ctypes.CDLL | None) -> bool:
    """Whether the library computes those products on the vector way (``mmc_vector_linear``, AVX-512 BF16 dot
    products from the same laid-out weight): where it was built for a CPU with AVX-512 BF16."""
    return lib is not None and getattr(lib, "vector_rows", 0) > 0


def product_way(lib: ctypes.CDLL | None) -> str | None:
    """The way the engine computes bfloat16 products of at most ``TILE_PRODUCT_ROWS`` rows with a ``TileWeight``:
    ``PRODUCTS_TILES`` where ``tile_products``, else ``PRODUCTS_VECTOR`` where ``vector_products`` (AMD Zen 4,
    Intel Cooper Lake; or a tile CPU with ``MMCACHE_TILE_UNIT=off``), else None (oneDNN). The ways sum in
    different orders: an engine keeps one for its life, and names it in its backend."""
    if tile_products(lib):
        return PRODUCTS_TILES
    return PRODUCTS_VECTOR if vector_products(lib) else None


def silu_mul(lib: ctypes.CDLL, gate: torch.Tensor, up: torch.Tensor, threads: int | None = None) -> torch.Tensor:
    """``silu(gate) * up`` for bfloat16 CPU tensors of one shape, rounded as torch's ``act_fn(gate).mul_(up)``
    rounds it (``csrc/activation.c``): each element depends only on its own two inputs, never on how many rows
    were computed with it (torch's result can: its scalar exponential takes the elements past each thread's last
    whole vector). Returns a new tensor; may differ from torch's in the last bit of a few elements."""
    if (gate.dtype is not torch.bfloat16 or up.dtype is not torch.bfloat16 or gate.shape != up.shape
            or not gate.is_cpu or not up.is_cpu):
        raise ValueError(f"silu_mul takes two bfloat16 CPU tensors of one shape: got {tuple(gate.shape)} "
                         f"{gate.dtype} on {gate.device}, {tuple(up.shape)} {up.dtype} on {up.device}")
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    if gate.numel() and lib.mmc_silu_mul(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel(),
                        threads or torch.get_num_threads()) != 0:
        raise ValueError(f"the activation kernel refused its arguments: {tuple(gate.shape)}")
    return out


_HUGE_PAGE = 2 << 20
_ARENA_CHUNK = 64 << 20  # bytes mapped at a time for tile copies; a larger copy gets a mapping of its own


class _HugeArena:
    """Memory for the tile kernel's weight copies, mapped in chunks the kernel is asked to back with huge pages
    (``MADV_HUGEPAGE``; with transparent huge pages in their usual ``madvise`` mode). A decode step reads every
    weight once, and on 4 KB pages the address translations hold that stream back (on the Intel AMX machine
    of RESULTS.md a plain read of 716 MB ran at 20 GB/s on 4 KB pages, 30 GB/s on 2 MB ones; the tile products
    of a whole model's layers 3-6% faster from this memory than from torch's).

    Each copy is a view into a chunk and keeps it mapped (the tensor holds the mapping); the arena holds only
    its newest chunk for further copies, so a chunk is unmapped once its copies and the arena have let go of
    it. Where the OS has no ``madvise`` (or refuses), the chunks are ordinary memory."""

    def __init__(self):
        self._lock = threading.Lock()
        self._chunk: torch.Tensor | None = None
        self._used = 0

    @staticmethod
    def _map(nbytes: int) -> torch.Tensor:
        import mmap

        area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)  # private: shared memory gets no huge pages
        advice = getattr(mmap, "MADV_HUGEPAGE", None)
        if advice is not None and hasattr(area, "madvise"):
            try:
                area.madvise(advice)
            except OSError:
                pass  # no transparent huge pages here: 4 KB pages
        return torch.frombuffer(area, dtype=torch.uint8)  # keeps ``area`` mapped while any view lives

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised 1-D tensor of ``numel`` elements, its start 4 KB-aligned."""
        nbytes = max(1, numel * torch.empty(0, dtype=dtype).element_size())
        padded = -(-nbytes // 4096) * 4096
        if padded > _ARENA_CHUNK // 4:
            return self._map(-(-padded // _HUGE_PAGE) * _HUGE_PAGE)[:nbytes].view(dtype)
        with self._lock:
            if self._chunk is None or self._used + padded > self._chunk.numel():
                self._chunk, self._used = self._map(_ARENA_CHUNK), 0
            start, self._used = self._used, self._used + padded
            return self._chunk[start:start + nbytes].view(dtype)


_ARENA = _HugeArena()


class TileWeight:
    """A bfloat16 weight (N, K) laid out once for ``tile_linear`` (``csrc/tile_linear.c``: blocks of 64 output
    columns, the tile unit's pair layout, zero-padded to whole blocks and to whole steps of 32 k) in memory
    asked to be backed by huge pages (``_HugeArena``), and its bias (N) as float32 or None. A copy made when
    built: a later in-place change of the weight is not seen. Called on ``x`` (..., K) bfloat16 with at most
    ``TILE_PRODUCT_ROWS`` rows, returns ``x @ weight^T + bias`` (..., N) bfloat16, each element the float32 sum
    of its products rounded once, on the tile unit or on the vector way (``way``, by default ``product_way``;
    each way's bits depend only on the row, not the same bits as the other way's); only ``x`` is checked per
    call."""

    def __init__(self, lib: ctypes.CDLL, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 threads: int | None = None, way: str | None = None):
        way = way or product_way(lib)
        if way == PRODUCTS_TILES and not tile_products(lib):
            raise NativeKernelUnavailable("the tile products need a CPU with the AMX tile unit, granted by Linux")
        if way != PRODUCTS_TILES and not (way == PRODUCTS_VECTOR and vector_products(lib)):
            raise NativeKernelUnavailable(f"these products need a CPU with the AMX tile unit or AVX-512 BF16 "
                                          f"(the {way or 'vector'} way is not in this library)")
        #: ``PRODUCTS_TILES`` or ``PRODUCTS_VECTOR``.
        self.way = way
        if weight.dtype != torch.bfloat16 or weight.dim() != 2 or min(weight.shape) < 1 or weight.device.type != "cpu":
            raise ValueError(f"a tile weight is a (N, K) bfloat16 tensor on the CPU: got {tuple(weight.shape)} "
                             f"{weight.dtype} on {weight.device}")
        weight = weight.detach().contiguous()
        self.n, self.k = weight.shape
        if bias is not None:
            if bias.shape != (self.n,) or not bias.is_floating_point() or bias.device.type != "cpu":
                raise ValueError(f"a tile weight's bias is a ({self.n},) float tensor on the CPU or None: got "
                                 f"{tuple(bias.shape)} {bias.dtype} on {bias.device}")
            bias = bias.detach().float().contiguous()
        self.bias = bias
        self.blocks = _ARENA.empty(int(lib.mmc_tile_elements(self.n, self.k)), torch.bfloat16)
        rc = lib.mmc_tile_pack(weight.data_ptr(), self.n, self.k, self.blocks.data_ptr(),
                               threads or torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"the tile kernel could not lay out a weight {tuple(weight.shape)} (code {rc})")
        self._fn = lib.mmc_tile_linear if way == PRODUCTS_TILES else lib.mmc_vector_linear

    @property
    def nbytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size()

    def __call__(self, x: torch.Tensor, threads: int | None = None) -> torch.Tensor:
        rows = _rows(x, torch.bfloat16, self.k, self.n, "tile_linear")
        m = rows.shape[0]
        if m > TILE_PRODUCT_ROWS:
            raise ValueError(f"tile_linear takes at most {TILE_PRODUCT_ROWS} rows: got {m}")
        out = torch.empty(m, self.n, dtype=torch.bfloat16)
        if m:
            rc = self._fn(rows.data_ptr(), m, self.k, self.blocks.data_ptr(), self.n,
                          None if self.bias is None else self.bias.data_ptr(), out.data_ptr(),
                          threads or torch.get_num_threads())
            if rc != 0:
                raise NativeKernelUnavailable(f"the tile kernel ({self.way}) refused its arguments (code {rc}): x "
                                              f"{tuple(x.shape)}, weight {(self.n, self.k)}")
        return out if x.dim() == 2 else out.view(x.shape[:-1] + (self.n,))
