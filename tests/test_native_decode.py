"""The compiled decode kernel (``mmcache.engine.compute.native``): equal to plain attention, independent of its company,
refusing what it cannot take, built once and cached, and falling back to ATen when it cannot be built."""

import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mmcache.engine.compute import native


@pytest.fixture
def lib(native_kernel):
    return native_kernel


@pytest.fixture
def fresh_state(monkeypatch):
    """The module's memo of the loaded library, emptied for the test and restored after it."""
    saved = dict(native._state)
    native.reset()
    yield
    native.reset()
    native._state.update(saved)


def reference(q, k, v, table, lo, hi, scale):
    """Per sequence and KV head, float64 attention of its G query rows over positions lo .. hi - 1."""
    page_size = k.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for j in range(q.shape[0]):
        pos = torch.arange(int(lo[j]), int(hi[j]))
        pages, slots = table[j][pos // page_size], pos % page_size
        keys, values = k[:, pages, slots].double(), v[:, pages, slots].double()  # (kv_heads, L, d)
        out[j] = F.scaled_dot_product_attention(q[j].double(), keys, values, scale=scale)
    return out


def case(dtype, group, dim, page_size, n=5, kv_heads=2, pages=24, width=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    pages = max(pages, width + 4)
    k = (torch.randn(kv_heads, pages, page_size, dim, generator=g) * 2).to(dtype)
    v = torch.randn(kv_heads, pages, page_size, dim, generator=g).to(dtype)
    q = torch.randn(n, kv_heads, group, dim, generator=g).to(dtype)
    table = torch.stack([torch.randperm(pages, generator=g)[:width] for _ in range(n)])  # scattered pages
    hi = torch.randint(1, width * page_size + 1, (n,), generator=g)
    lo = (hi - torch.randint(1, width * page_size + 1, (n,), generator=g)).clamp(min=0)  # some windows
    hi[0], lo[0] = 1, 0  # a sequence of one token
    return q, k, v, table, lo, hi


@pytest.mark.parametrize("group,dim,page_size", [(7, 64, 16), (1, 16, 4), (2, 48, 5), (8, 32, 8), (9, 80, 16),
                                                 (16, 128, 3), (4, 64, 128)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1.6e-2)])
def test_kernel_equals_float64_attention_over_the_pages(lib, dtype, tol, group, dim, page_size):
    """Every shape the engine can send (any G up to 16, d a multiple of 16 up to 512, any page size, scattered
    tables, windows): within float32 rounding, or one bfloat16 rounding of the output (about 2^-8 of it)."""
    q, k, v, table, lo, hi = case(dtype, group, dim, page_size, width=max(2, 96 // page_size))
    got = native.decode_attention(lib, q, k, v, table, lo, hi, dim ** -0.5)
    assert got.shape == q.shape and got.dtype == dtype
    want = reference(q, k, v, table, lo, hi, dim ** -0.5)
    torch.testing.assert_close(got.double(), want, atol=tol * 4, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_sequence_gets_the_same_bits_alone_in_company_and_on_any_thread_count(lib, dtype):
    q, k, v, table, lo, hi = case(dtype, 7, 64, 16, n=6, seed=4)
    table[3, :3] = table[2, :3]  # two sequences share leading pages: each still reads them itself
    together = native.decode_attention(lib, q, k, v, table, lo, hi, 0.125)
    assert torch.equal(native.decode_attention(lib, q, k, v, table, lo, hi, 0.125, threads=1), together)
    for j in range(q.shape[0]):
        s = slice(j, j + 1)
        alone = native.decode_attention(lib, q[s], k, v, table[s], lo[s], hi[s], 0.125)
        assert torch.equal(alone[0], together[j])


def test_scores_far_apart_keep_the_largest_and_never_overflow(lib):
    """A key that outweighs the rest by far takes all the weight; the softmax subtracts the maximum first."""
    k = torch.zeros(1, 2, 4, 16)
    v = torch.arange(8.0).view(1, 2, 4, 1).expand(1, 2, 4, 16).contiguous()
    k[0, 1, 2] = 100.0  # position 6 (page 1, slot 2)
    q = torch.ones(1, 1, 1, 16)
    got = native.decode_attention(lib, q, k, v, torch.tensor([[0, 1]]), torch.tensor([0]), torch.tensor([8]), 1.0)
    assert torch.equal(got, torch.full((1, 1, 1, 16), 6.0))


def test_arguments_outside_the_pool_are_refused_not_read(lib):
    q, k, v, table, lo, hi = case(torch.float32, 7, 64, 16)
    bad = [("page id past the pool", table.clone().fill_(k.shape[1]), lo, hi),
           ("negative page id", table.clone().fill_(-1), lo, hi),
           ("positions past the table", table, lo, hi + table.shape[1] * 16),
           ("empty range", table, hi, hi)]
    for what, t, a, b in bad:
        with pytest.raises(ValueError, match="refused"):
            native.decode_attention(lib, q, k, v, t, a, b, 0.125)
    with pytest.raises(ValueError, match="contiguous"):
        native.decode_attention(lib, q, k.transpose(1, 2), v.transpose(1, 2), table, lo, hi, 0.125)


def test_supports_only_what_the_kernel_takes():
    pool = torch.zeros(2, 2, 4, 8, 64)
    assert native.supports(torch.zeros(3, 2, 7, 64), pool)
    assert not native.supports(torch.zeros(3, 2, 17, 64), pool)  # G > 16
    assert not native.supports(torch.zeros(3, 2, 7, 72), torch.zeros(2, 2, 4, 8, 72))  # d not a multiple of 16
    assert not native.supports(torch.zeros(3, 2, 7, 64, dtype=torch.float16), pool.half())
    assert not native.supports(torch.zeros(3, 2, 7, 64, dtype=torch.bfloat16), pool)  # pool of another dtype


def test_a_group_the_kernel_does_not_take_runs_on_aten(monkeypatch):
    """17 query heads per KV head: the engine's attention takes ATen's path and still equals plain attention."""
    from test_attention_split import decode, decode_reference

    called = []
    monkeypatch.setattr(native, "decode_attention", lambda *a: called.append(1))
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(2, 1, 6, 8, 16, generator=g)
    table, ctx = torch.tensor([[0, 1, 2], [3, 4, 5]]), torch.tensor([20, 9])
    q = torch.randn(2, 17, 16, generator=g)
    got, _ = decode(cache, table, ctx, q)
    assert not called
    torch.testing.assert_close(got.double(), decode_reference(q, cache, table, ctx, 0.25), atol=1e-5, rtol=0)


def test_the_kernel_builds_where_the_machine_can_run_it(monkeypatch, fresh_state):
    """Not a skip where it matters: on Linux x86-64 with AVX-512 or AVX2 and FMA, and a C compiler (the
    development and CI machines) the kernel must build and load, on the CPU's widest vectors, so a source that
    stops compiling fails here instead of quietly sending every other kernel test to a skip."""
    import platform
    import sys

    try:
        flags = set(next(ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")).split())
    except (OSError, StopIteration):
        flags = set()
    wide = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if (sys.platform != "linux" or platform.machine() != "x86_64" or not compiler
            or not (wide or {"avx2", "fma"} <= flags)):
        pytest.skip("not Linux x86-64 with AVX-512 or AVX2, and a C compiler: the kernel is not expected to build")
    monkeypatch.setenv(native.ENV_CHOICE, "auto")
    monkeypatch.setenv(native.ENV_TILES, "auto")  # a run with the tile unit switched off must still check it
    assert native.build().exists()
    lib = native.library()
    assert lib is not None and lib.lanes == (16 if wide else 8)
    vector = native.chunk_way(lib, 64) == native.CHUNK_VECTOR
    assert native.status() == ("native (AMX scores)" if lib.tiles
                               else "native (prefill chunks on AVX-512 BF16)" if vector
                               else "native" if wide else "native (AVX2)")
    assert not lib.tiles or {"amx_tile", "amx_bf16"} <= set(flags)  # tiles only where the CPU has them
    # ... and wherever it has them (Linux grants them on request since 5.16), so that the chunk kernel's tests,
    # which skip without tiles, cannot hide a kernel that stopped asking for them.
    release = platform.release().split("-")[0].split(".")
    recent = (len(release) >= 2 and all(x.isdigit() for x in release[:2])
              and (int(release[0]), int(release[1])) >= (5, 16))
    if {"amx_tile", "amx_bf16", "avx512_bf16"} <= set(flags) and recent:
        assert lib.tiles
    # The chunk kernel's vector way wherever the CPU has AVX-512 BF16, for the same reason.
    if "avx512_bf16" in flags:
        assert native.chunk_way(lib, 64, vector_only=True) == native.CHUNK_VECTOR


def test_the_build_is_cached_and_reused(lib):
    path = native.build()
    before = path.stat().st_mtime_ns
    assert native.build() == path and path.stat().st_mtime_ns == before
    assert path.parent == Path(os.path.realpath(native.cache_dir())) and not list(path.parent.glob("*.tmp"))


def test_a_changed_source_or_compiler_builds_a_new_library(lib, tmp_path):
    first = native.build(directory=tmp_path)
    wrapper = tmp_path / "cc-wrapper"
    wrapper.write_text(f"#!/bin/sh\nexec {shutil.which(os.environ.get('CC', 'cc')) or shutil.which('gcc')} \"$@\"\n")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    second = native.build(compiler=str(wrapper), directory=tmp_path)
    assert second != first and second.exists() and first.exists()


def test_off_and_bad_settings(monkeypatch, fresh_state):
    monkeypatch.setenv(native.ENV_CHOICE, "off")
    assert native.library() is None and native.status().startswith("aten")
    monkeypatch.setenv(native.ENV_CHOICE, "sometimes")
    with pytest.raises(native.NativeConfigError, match="auto, off, require"):
        native.library()


def test_without_a_compiler_auto_falls_back_and_require_says_why(monkeypatch, tmp_path, fresh_state):
    monkeypatch.setenv(native.ENV_CACHE, str(tmp_path))  # nothing built here yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv(native.ENV_CHOICE, "auto")
    assert native.library() is None
    assert "no C compiler" in native.status()
    monkeypatch.setenv(native.ENV_CHOICE, "require")
    with pytest.raises(native.NativeKernelUnavailable, match="no C compiler"):
        native.library()


def test_a_failing_compiler_is_reported_with_its_message(monkeypatch, tmp_path, fresh_state):
    cc = tmp_path / "broken-cc"
    cc.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo broken 1.0; exit 0; fi\n"
                  "echo 'error: this compiler refuses everything' >&2\nexit 1\n")
    cc.chmod(cc.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(native.NativeKernelUnavailable, match="refuses everything"):
        native.build(compiler=str(cc), directory=tmp_path)
    assert not [p for p in os.listdir(tmp_path) if p.endswith((".so", ".tmp"))]  # nothing half-written left


def test_the_engine_falls_back_to_aten_with_the_same_tokens(monkeypatch, lib):
    """Greedy tokens with the kernel and with ATen agree on the tiny model in float32 (both are float32
    attention; their last bits differ, which on these random-weight logits flips no greedy choice here)."""
    from mmcache.engine import Engine, EngineConfig, Request, SamplingParams
    from mmcache.presets.text import build_model

    prompts = [[5 + i for i in range(40)], [5 + i for i in range(33)] + [7, 7, 7]]
    outs = {}
    for mode in ("require", "off"):
        monkeypatch.setenv(native.ENV_CHOICE, mode)
        model, tok = build_model("tiny-qwen2", "float32")  # a model each: an engine replaces its modules
        eng = Engine(model, tok, EngineConfig(page_size=16, num_pages=64))
        reqs = [Request(p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)) for p in prompts]
        outs[mode] = [o.output_ids for o in eng.generate(reqs)]
        eng.check_invariants()
    assert outs["require"] == outs["off"]


def test_an_engine_chooses_its_decode_path_once_and_names_it(monkeypatch, lib):
    """The choice is made when the engine is built and is part of its attention backend's name, so pages
    computed on one path are never hits for an engine on the other; changing MMCACHE_NATIVE later changes
    nothing for that engine. A bad setting fails the construction with its typed error."""
    from mmcache.engine import Engine, EngineConfig, Request, SamplingParams
    from mmcache.presets.text import build_model

    model, tok = build_model("tiny-qwen2", "float32")
    monkeypatch.setenv(native.ENV_CHOICE, "off")
    aten = Engine(build_model("tiny-qwen2", "float32")[0], tok, EngineConfig(page_size=16, num_pages=32))
    monkeypatch.setenv(native.ENV_CHOICE, "require")
    compiled = Engine(model, tok, EngineConfig(page_size=16, num_pages=32))
    # float32 with heads 16 wide: no way of the chunk kernel takes it, so no chunk suffix; the row kernel where
    # the library is its AVX2 build
    rows = "+native-rows" if native.row_products(native.library()) else ""
    assert compiled.backend == aten.backend + rows + "+native-decode" + "+native-norm"
    assert compiled.fingerprint != aten.fingerprint and compiled.fingerprint.model_digest == aten.fingerprint.model_digest
    calls = []
    real = native.decode_attention
    monkeypatch.setattr(native, "decode_attention", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv(native.ENV_CHOICE, "off")
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    compiled.generate([Request(list(range(5, 30)), sp)])
    assert len(calls) == 3 * compiled.adapter.num_layers  # three decode steps, every layer, on the kernel
    calls.clear()
    aten.generate([Request(list(range(5, 30)), sp)])
    assert not calls
    monkeypatch.setenv(native.ENV_CHOICE, "sometimes")
    with pytest.raises(native.NativeConfigError):
        Engine(model, tok, EngineConfig(page_size=16, num_pages=32))
