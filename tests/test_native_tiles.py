"""The tile kernel (``native.TileWeight``, ``csrc/tile_linear.c``) and its use by packed linears: bfloat16
products of a few rows on the AMX tile unit from a copy of the weight laid out in blocks of 64 columns (the
layout checked on every CPU), each element the float32 sum of its products rounded once, a row's bits
independent of its company, its block and the thread count, typed refusals, products of few rows routed to it
and more rows to oneDNN, the memory it lives in, and an engine on it that names it and stays bit-exact with the
cache on and off. Everything but the layout needs a CPU with the tile unit (skipped elsewhere, with the reason)."""

import mmap

import numpy as np
import pytest
import torch
from torch import nn

from mmcache.engine import ComputeConfig, Engine, EngineConfig, SamplingParams
from mmcache.engine.compute import kernels, native
from mmcache.engine.inspect import exact_runs, rows_equal
from mmcache.presets.text import build_model

pytestmark = pytest.mark.skipif(not kernels.available(torch.device("cpu"), torch.bfloat16),
                                reason="oneDNN is not available in this torch build")

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture
def tile_kernel(native_kernel):
    if not native.tile_products(native_kernel):
        pytest.skip("no AMX tile unit here (or Linux does not grant it, or MMCACHE_TILE_UNIT=off): no tile products")
    if kernels.widened(torch.bfloat16):
        pytest.skip("oneDNN widens bfloat16 weights here")
    return native_kernel


@pytest.fixture(params=[native.PRODUCTS_TILES, native.PRODUCTS_VECTOR])
def tile_weight(request, native_kernel):
    """``native.TileWeight`` on each of its ways in turn (each skipped where this CPU lacks it)."""
    way = request.param
    if way == native.PRODUCTS_TILES and not native.tile_products(native_kernel):
        pytest.skip("no AMX tile unit here (or Linux does not grant it, or MMCACHE_TILE_UNIT=off): no tile products")
    if way == native.PRODUCTS_VECTOR and not native.vector_products(native_kernel):
        pytest.skip("no AVX-512 BF16 here: the vector way of the tile products does not run")

    def make(weight, bias=None, threads=None):
        return native.TileWeight(native_kernel, weight, bias, threads, way=way)
    return make


def unpack(blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The (N, K) weight back out of ``mmc_tile_pack``'s layout, read as the kernel's comment describes it."""
    steps = -(-k // 32)
    tiles = blocks.view(-1, steps, 4, 16, 16, 2)  # block j, step kb, tile t, row r, column c, pair element e
    w = tiles.permute(0, 2, 4, 1, 3, 5).reshape(-1, steps * 32)  # column 64 j + 16 t + c, k 32 kb + 2 r + e
    return w[:n, :k], w


@pytest.mark.parametrize("n,k", [(64, 32), (130, 96), (5, 7), (1, 1), (70, 33)])
def test_the_layout_is_the_tile_units_pair_layout_padded_with_zeros(native_kernel, n, k):
    w = torch.randn(n, k).bfloat16()
    elements = int(native_kernel.mmc_tile_elements(n, k))
    assert elements == -(-n // 64) * 64 * -(-k // 32) * 32
    blocks = torch.full((elements,), float("nan"), dtype=torch.bfloat16)
    assert native_kernel.mmc_tile_pack(w.data_ptr(), n, k, blocks.data_ptr(), 2) == 0
    got, whole = unpack(blocks, n, k)
    assert torch.equal(got, w)
    assert int(torch.count_nonzero(whole)) == int(torch.count_nonzero(w))  # the padding is zeros, nothing else
    assert native_kernel.mmc_tile_elements(0, k) == 0 and native_kernel.mmc_tile_pack(w.data_ptr(), 0, k,
                                                                                      blocks.data_ptr(), 1) == 1


@pytest.mark.parametrize("m,k,n", [(1, 896, 130), (3, 64, 8), (7, 37, 5), (16, 200, 64), (17, 33, 70),
                                   (32, 48, 129), (2, 5, 1)])
def test_each_element_is_its_exact_sum_rounded_once(tile_weight, m, k, n):
    # Small whole numbers: every product and partial sum is exact in float32, so the only rounding is the last.
    g = torch.Generator().manual_seed(m * 1000 + k)
    x = torch.randint(-3, 4, (m, k), generator=g).bfloat16()
    w = torch.randint(-3, 4, (n, k), generator=g).bfloat16()
    b = torch.randint(-50, 50, (n,), generator=g).float() + 0.25
    exact = x.double() @ w.double().T + b.double()
    tw = tile_weight(w, b)
    got = tw(x)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert torch.equal(got, exact.float().bfloat16())
    # Random values: within a bfloat16 rounding of the float64 product.
    x, w, b = torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16(), torch.randn(n)
    exact = x.double() @ w.double().T + b.double()
    got = tile_weight(w, b)(x).double()
    scale = x.double().abs() @ w.double().abs().T + b.double().abs()
    assert torch.all((got - exact).abs() <= exact.abs() * 2.0 ** -8 + scale * k * 2.0 ** -23 + 1e-30)


def test_a_rows_bits_do_not_depend_on_its_company_its_block_or_threads(tile_weight):
    g = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(32, 300, generator=g).bfloat16(), torch.randn(150, 300, generator=g).bfloat16(), None
    tw = tile_weight(w, b)
    whole = tw(x)
    # first, inside, last of the first tile's rows, first and last of the second (the vector way's groups of
    # six: 5 and 6 start them, 31 is its last group's only row)
    for i in (0, 5, 6, 15, 16, 31):
        assert torch.equal(tw(x[i:i + 1])[0], whole[i])
        assert torch.equal(tw(x[i:])[0], whole[i])
    assert torch.equal(tw(x, threads=1), whole)
    for j in (0, 63, 64, 149):  # a weight row alone sits at column 0 of its own first block
        assert torch.equal(tile_weight(w[j:j + 1])(x)[:, 0], whole[:, j])
    batched = tw(x.view(2, 16, 300))
    assert batched.shape == (2, 16, 150) and torch.equal(batched.view(32, 150), whole)
    strided = x.t().contiguous().t()  # the same values, not contiguous: taken through a copy
    assert torch.equal(tw(strided), whole)
    assert tw(x[:0]).shape == (0, 150)


def test_bad_arguments_are_refused_with_a_typed_error(tile_weight):
    w = torch.randn(8, 32).bfloat16()
    tw = tile_weight(w, torch.zeros(8))
    with pytest.raises(ValueError, match="bfloat16"):
        tw(torch.randn(2, 32))  # float32 rows
    with pytest.raises(ValueError, match="K"):
        tw(torch.randn(2, 31).bfloat16())
    with pytest.raises(ValueError, match=f"at most {native.TILE_PRODUCT_ROWS} rows"):
        tw(torch.randn(native.TILE_PRODUCT_ROWS + 1, 32).bfloat16())
    with pytest.raises(ValueError, match="tile weight is a"):
        tile_weight(w.float())
    with pytest.raises(ValueError, match="tile weight is a"):
        tile_weight(torch.randn(8).bfloat16())
    with pytest.raises(ValueError, match="bias"):
        tile_weight(w, torch.zeros(7))


def test_the_two_ways_sum_in_their_own_orders(native_kernel):
    if not (native.tile_products(native_kernel) and native.vector_products(native_kernel)):
        pytest.skip("needs both the AMX tile unit and AVX-512 BF16")
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(16, 896, generator=g).bfloat16(), torch.randn(256, 896, generator=g).bfloat16()
    tiles, vector = (native.TileWeight(native_kernel, w, way=way) for way in kernels.TILE_LAYOUT)
    assert tiles.way == native.PRODUCTS_TILES and vector.way == native.PRODUCTS_VECTOR
    a, b = tiles(x), vector(x)
    assert not torch.equal(a, b)  # not the same bits: an engine keeps one way (and names it)
    torch.testing.assert_close(a.float(), b.float(), rtol=0.02, atol=0.05)


def test_the_tile_unit_can_be_switched_off_for_the_vector_ways(native_kernel, monkeypatch):
    try:
        with monkeypatch.context() as env:  # undone on leaving: the suite may itself run with the tile unit off
            env.setenv(native.ENV_TILES, "sometimes")
            native.reset()
            with pytest.raises(native.NativeConfigError, match="MMCACHE_TILE_UNIT"):
                native.library()
            env.setenv(native.ENV_TILES, "off")
            native.reset()
            lib = native.library()
            assert not lib.tiles and not native.tile_products(lib)
            if native.vector_products(native_kernel):  # a CPU with AVX-512 BF16: its ways, as on one without tiles
                assert native.product_way(lib) == native.PRODUCTS_VECTOR
                assert native.chunk_way(lib, 64) == native.CHUNK_VECTOR
            else:
                assert native.product_way(lib) is None
    finally:
        native.reset()
    assert native.library().tiles == native_kernel.tiles  # the setting is read when the library is loaded


def test_a_library_without_the_tile_unit_refuses_a_tile_weight(native_kernel, monkeypatch):
    monkeypatch.setattr(native, "tile_products", lambda lib: False)
    if native.vector_products(native_kernel):  # the vector way instead
        assert native.TileWeight(native_kernel, torch.randn(8, 32).bfloat16()).way == native.PRODUCTS_VECTOR
        assert kernels.row_kernel(native_kernel, torch.bfloat16, False) == native.PRODUCTS_VECTOR
    with pytest.raises(native.NativeKernelUnavailable, match="AMX"):
        native.TileWeight(native_kernel, torch.randn(8, 32).bfloat16(), way=native.PRODUCTS_TILES)
    monkeypatch.setattr(native, "vector_products", lambda lib: False)
    with pytest.raises(native.NativeKernelUnavailable, match="AVX-512 BF16"):
        native.TileWeight(native_kernel, torch.randn(8, 32).bfloat16())
    with pytest.raises(native.NativeKernelUnavailable, match="AVX-512 BF16"):
        native.TileWeight(native_kernel, torch.randn(8, 32).bfloat16(), way=native.PRODUCTS_VECTOR)
    assert kernels.row_kernel(native_kernel, torch.bfloat16, False) is None
    assert kernels.row_kernel(native_kernel, torch.bfloat16, True) == "rows"
    assert kernels.row_kernel(native_kernel, torch.float32, False) == "rows"
    assert kernels.row_kernel(None, torch.bfloat16, False) is None


def test_few_rows_go_to_the_tile_kernel_and_more_to_onednn(tile_kernel):
    torch.manual_seed(0)
    linear = nn.Linear(96, 70).bfloat16()
    on_tiles = kernels.PackedWeight(linear.weight, linear.bias, rows=tile_kernel)
    onednn = kernels.PackedWeight(linear.weight, linear.bias)
    assert on_tiles.row_kernel == "tiles" and on_tiles.rows is tile_kernel and onednn.row_kernel is None
    assert on_tiles.row_limit == native.TILE_PRODUCT_ROWS
    assert kernels.row_copy_bytes(linear.weight, tile_kernel) == on_tiles.row_weight.nbytes == 128 * 96 * 2
    limit = native.TILE_PRODUCT_ROWS
    for rows in (1, 5, limit, limit + 1, 100):
        x = torch.randn(1, rows, 96).bfloat16()
        got = on_tiles(x)
        assert got.dtype == torch.bfloat16 and got.shape == (1, rows, 70)
        if rows <= limit:
            assert torch.equal(got, on_tiles.row_weight(x))
        else:
            assert torch.equal(got, onednn(x))
        torch.testing.assert_close(got.float(), linear(x).float(), rtol=0.02, atol=0.02)


def vm_flags(address: int) -> list[str] | None:
    """The kernel's flags for the mapping holding ``address`` (``/proc/self/smaps``), None where unknown."""
    try:
        lines = open("/proc/self/smaps").read().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    return None


def test_the_copies_lie_in_huge_page_chunks_that_outlive_the_arena():
    arena = native._HugeArena()
    a, b = arena.empty(1000, torch.bfloat16), arena.empty(10, torch.float32)
    assert a.numel() == 1000 and b.numel() == 10 and b.dtype == torch.float32
    assert a.data_ptr() % 4096 == 0 and b.data_ptr() - a.data_ptr() == 4096  # 4 KB steps in one chunk
    big = arena.empty(native._ARENA_CHUNK, torch.uint8)  # more than a quarter chunk: a mapping of its own
    assert big.numel() == native._ARENA_CHUNK and abs(big.data_ptr() - a.data_ptr()) >= native._ARENA_CHUNK
    flags = vm_flags(a.data_ptr())
    if flags is not None and hasattr(mmap, "MADV_HUGEPAGE"):
        assert "hg" in flags and "hg" in vm_flags(big.data_ptr())  # asked to be backed by huge pages
    a.fill_(1.5)
    del arena  # the views keep their chunk mapped
    assert float(a.float().sum()) == 1500.0


def test_an_engine_on_the_tile_kernel_names_it_and_stays_bit_exact(tile_kernel):
    model, tok = build_model("tiny", "bfloat16")
    probe = Engine(build_model("tiny", "bfloat16")[0], tok,
                   EngineConfig(page_size=16, num_pages=64, compute=ComputeConfig(packed_linears=False)))
    weights = [m.weight for m in model.model.layers.modules() if type(m) is nn.Linear] + [model.lm_head.weight]
    # the room asked for packing counts each weight's copy for the tile kernel, padded to whole blocks
    assert (probe.compute.bytes_to_pack(tile_kernel) - probe.compute.bytes_to_pack()
            == sum(int(tile_kernel.mmc_tile_elements(*w.shape)) * 2 for w in weights) > 0)
    rng = np.random.default_rng(5)
    prefix = rng.integers(2, 512, size=40).tolist()
    prompts = [prefix + rng.integers(2, 512, size=n).tolist() for n in (9, 21)] + [list(prefix)]
    runs = exact_runs(model, tok, prompts, GREEDY, page_size=16, num_pages=64)
    eng = runs["on"][2]
    assert "+native-tile-rows" in eng.backend and "+native-rows" not in eng.backend
    assert eng.compute.num_tile_product_linears() == eng.compute.num_packed_linears > 0
    assert [o.matched_tokens for o in runs["on"][1]] == [0, 32, 32]
    assert all(rows_equal(runs["on"][0], runs["off"][0], i, GREEDY.max_tokens) for i in range(len(prompts)))
    off = Engine(build_model("tiny", "bfloat16")[0], tok,
                 EngineConfig.exact(page_size=16, num_pages=64, compute=ComputeConfig(row_products=False)))
    assert "tile-rows" not in off.backend and off.compute.num_tile_product_linears() == 0
    assert off.fingerprint != eng.fingerprint  # other bits, other names
