"""The compiled row kernel (``native.linear``, ``native.RowWeight``) and its use by packed linears
(``kernels.PackedWeight``, the engine's ``row_products``): float32 products of a weight laid out in panels in its
own dtype (bfloat16 widened exactly), a row's bits independent of its company, of the panel its column falls in
and of the thread count, typed refusals, products of few rows routed to it and more
rows to oneDNN, the fused MLP on it, and an engine on it that names it and stays bit-exact with the cache on and
off. The engine uses it only on AVX2 builds (``native.row_products``); these tests ask for it on every machine."""

import numpy as np
import pytest
import torch
from torch import nn

from mmcache.engine import ComputeConfig, ComputeConfigError, Engine, EngineConfig, Request, SamplingParams
from mmcache.engine.compute import kernels, native
from mmcache.engine.inspect import exact_runs, record_logits, rows_equal
from mmcache.presets.text import build_model

pytestmark = pytest.mark.skipif(not kernels.available(torch.device("cpu"), torch.float32),
                                reason="oneDNN is not available in this torch build")

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def case(m, k, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=g), (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    return x, w, torch.randn(n, generator=g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k,n", [(1, 896, 130), (3, 64, 8), (7, 37, 5), (16, 200, 9), (2, 5, 1), (40, 48, 4),
                                   (2, 33, 70), (13, 24, 48)])
def test_the_kernel_computes_the_product_in_float32(native_kernel, dtype, m, k, n):
    x, w, b = case(m, k, n, dtype)
    exact = x.double() @ w.double().T + b.double()
    got = native.linear(native_kernel, x, w, b)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    # float32 sums of k products: within k float32 steps of the sum of the products' magnitudes
    bound = (x.double().abs() @ w.double().abs().T + b.double().abs()) * k * 2.0 ** -23 + 1e-30
    assert torch.all((got.double() - exact).abs() <= bound)
    without = native.linear(native_kernel, x, w)
    assert torch.equal(got, without + b)  # the bias is added last, once
    if dtype == torch.bfloat16:  # widened exactly: the same bits as the float32 copy of the weight gives
        assert torch.equal(got, native.linear(native_kernel, x, w.float(), b))


def test_a_rows_bits_do_not_depend_on_its_company_or_threads(native_kernel):
    x, w, b = case(17, 300, 21, torch.bfloat16, seed=1)
    whole = native.linear(native_kernel, x, w, b)
    for i in (0, 2, 5, 16):  # first, last of a block of rows, in the remainder, alone
        assert torch.equal(native.linear(native_kernel, x[i:i + 1], w, b)[0], whole[i])
        assert torch.equal(native.linear(native_kernel, x[i:], w, b)[0], whole[i])
    assert torch.equal(native.linear(native_kernel, x, w, b, threads=1), whole)
    assert torch.equal(native.linear(native_kernel, x, w[3:4], b[3:4])[:, 0], whole[:, 3])  # a weight row alone
    batched = native.linear(native_kernel, x.view(1, 17, 300), w, b)
    assert batched.shape == (1, 17, 21) and torch.equal(batched[0], whole)


def test_bad_arguments_are_refused_with_a_typed_error(native_kernel):
    x, w, b = case(2, 32, 4, torch.float32)
    with pytest.raises(ValueError, match="linear takes"):
        native.linear(native_kernel, x.bfloat16(), w, b)  # inputs are float32
    with pytest.raises(ValueError, match="linear takes"):
        native.linear(native_kernel, x[:, :31], w, b)  # K differs
    with pytest.raises(ValueError, match="linear takes"):
        native.linear(native_kernel, x, w, b[:3])
    with pytest.raises(ValueError, match="linear takes"):
        native.linear(native_kernel, x, w, b.double())
    for bad in (w.half(), w[0], w[:0], w.unsqueeze(0)):
        with pytest.raises(ValueError, match="a row weight is"):
            native.linear(native_kernel, x, bad, b)
    assert native.linear(native_kernel, x[:0], w, b).shape == (0, 4)
    # a weight laid out from a strided view is the same weight
    strided = w.t().contiguous().t()
    assert torch.equal(native.linear(native_kernel, x, strided, b), native.linear(native_kernel, x, w, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_weight_is_a_padded_copy_in_the_weights_own_dtype(native_kernel, dtype):
    x, w, b = case(4, 40, 37, dtype, seed=2)
    laid = native.RowWeight(native_kernel, w)
    width = native_kernel.mmc_row_panel()
    assert laid.panels.dtype == dtype and laid.panels.shape == (-(-37 // width), 40, width)
    assert laid.nbytes == laid.panels.numel() * w.element_size() >= w.numel() * w.element_size()
    before = native.linear(native_kernel, x, laid, b)
    assert torch.equal(before, native.linear(native_kernel, x, w, b))
    w.mul_(2)  # a copy: the weight's later changes are not seen
    assert torch.equal(native.linear(native_kernel, x, laid, b), before)
    own = native.RowWeight(native_kernel, w.div_(2), b)  # a row weight with its own bias: called, or through linear
    assert torch.equal(own(x), before) and torch.equal(native.linear(native_kernel, x, own), before)
    with pytest.raises(ValueError, match="not both"):
        native.linear(native_kernel, x, own, b)
    assert laid.with_bias(b).panels is laid.panels and laid.bias is None  # the panels shared, not copied
    with pytest.raises(ValueError, match="float32 bias"):
        native.RowWeight(native_kernel, w, b[:3])
    assert int((laid.panels[-1] != 0).sum()) <= (37 % width or width) * 40  # the padding is zeros


def test_the_engine_uses_it_where_the_library_is_the_avx2_build(native_kernel):
    assert native.row_products(native_kernel) == (native_kernel.lanes == 8)
    assert not native.row_products(None)


@pytest.mark.parametrize("widen", [True, False])
def test_few_rows_go_to_the_kernel_and_more_to_onednn(native_kernel, widen):
    torch.manual_seed(0)
    dtype = torch.bfloat16 if widen else torch.float32
    linear = nn.Linear(96, 40).to(dtype)
    on_rows = kernels.PackedWeight(linear.weight, linear.bias, widen=widen, rows=native_kernel)
    onednn = kernels.PackedWeight(linear.weight, linear.bias, widen=widen)
    assert on_rows.rows is native_kernel and onednn.rows is None
    assert onednn.row_weight is None  # without the row kernel no second copy is made
    limit = native.ROW_PRODUCT_ROWS
    for rows in (1, 5, limit, limit + 1, 64):
        x = torch.randn(1, rows, 96).to(dtype)
        got = on_rows(x)
        assert got.dtype == dtype and got.shape == (1, rows, 40)
        if rows <= limit:
            want = native.linear(native_kernel, x.float(), linear.weight.detach(), linear.bias.detach().float())
            assert torch.equal(got, want.to(dtype))
        else:
            assert torch.equal(got, onednn(x))
        torch.testing.assert_close(got.float(), linear(x).float(), rtol=0.02 if widen else 1e-5, atol=1e-2)


def test_a_bfloat16_weight_that_onednn_packs_as_it_is_stays_off_the_kernel(native_kernel, monkeypatch):
    monkeypatch.setattr(kernels, "_pack", lambda weight: weight)  # as where oneDNN packs bfloat16 itself
    monkeypatch.setattr(native, "tile_products", lambda lib: False)  # neither tile unit nor AVX-512 BF16
    monkeypatch.setattr(native, "vector_products", lambda lib: False)  # (else: test_native_tiles)
    w = torch.randn(8, 32).bfloat16()
    packed = kernels.PackedWeight(w, None, widen=False, rows=native_kernel)
    assert packed.rows is None  # the row kernel takes float32 inputs: a bfloat16 product stays on oneDNN
    assert kernels.PackedWeight(w, None, widen=True, rows=native_kernel).rows is native_kernel
    strided = kernels.PackedWeight(w.t(), None, widen=True, rows=native_kernel)  # laid out from a copy
    x = torch.randn(2, 8)
    assert strided.rows is native_kernel and torch.equal(strided.product(x), native.linear(native_kernel, x, w.t()))


def test_the_fused_mlp_on_the_kernel_applies_its_activation_between_the_products(native_kernel):
    model, _ = build_model("tiny", "float32")
    mlp = model.model.layers[0].mlp
    fused = kernels.PackedGatedMLP(mlp, "swish", "", rows=native_kernel)
    x = torch.randn(1, 3, mlp.gate_proj.in_features)
    w = lambda m: m.weight.detach()  # noqa: E731
    want = native.linear(native_kernel, mlp.act_fn(native.linear(native_kernel, x, w(mlp.gate_proj)))
                         * native.linear(native_kernel, x, w(mlp.up_proj)), w(mlp.down_proj))
    with torch.inference_mode():
        got = fused(x)
        assert torch.equal(got, want)
        torch.testing.assert_close(got, mlp(x), rtol=1e-5, atol=1e-6)


@pytest.fixture
def row_products_everywhere(native_kernel, monkeypatch):
    """The engine asks for the row kernel whatever build the library is (on AVX2 it would anyway)."""
    monkeypatch.setattr(native, "row_products", lambda lib: lib is not None)
    return native_kernel


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_an_engine_on_the_row_kernel_names_it_and_stays_bit_exact(row_products_everywhere, monkeypatch, dtype):
    if dtype == "bfloat16":  # as on an AVX2 CPU: bfloat16 weights widened for oneDNN, read as they are here
        monkeypatch.setattr(kernels, "_PACKS", {torch.bfloat16: False})
    model, tok = build_model("tiny", dtype)
    probe = Engine(build_model("tiny", dtype)[0], tok,
                   EngineConfig(page_size=16, num_pages=64, compute=ComputeConfig(packed_linears=False)))
    weights = [m.weight for m in model.model.layers.modules() if type(m) is nn.Linear] + [model.lm_head.weight]
    # the room asked for packing counts each weight's copy for the row kernel, in the weight's own dtype
    assert (probe.compute.bytes_to_pack(rows=True) - probe.compute.bytes_to_pack()
            == sum(w.numel() * w.element_size() for w in weights) > 0)
    rng = np.random.default_rng(5)
    prefix = rng.integers(2, 512, size=40).tolist()
    prompts = [prefix + rng.integers(2, 512, size=n).tolist() for n in (9, 21)] + [list(prefix)]
    runs = exact_runs(model, tok, prompts, GREEDY, page_size=16, num_pages=64)
    eng = runs["on"][2]
    assert "+native-rows" in eng.backend and eng.compute.num_row_product_linears == eng.compute.num_packed_linears > 0
    assert [o.matched_tokens for o in runs["on"][1]] == [0, 32, 32]
    assert all(rows_equal(runs["on"][0], runs["off"][0], i, GREEDY.max_tokens) for i in range(len(prompts)))
    # Another setting on the same model object is refused before anything changes; a copy takes it.
    with pytest.raises(ComputeConfigError, match="row_products"):
        Engine(model, tok, EngineConfig(page_size=16, num_pages=64, compute=ComputeConfig(row_products=False)))
    other, _ = build_model("tiny", dtype)
    off = Engine(other, tok, EngineConfig.exact(page_size=16, num_pages=64, compute=ComputeConfig(row_products=False)))
    assert "+native-rows" not in off.backend and off.compute.num_row_product_linears == 0
    # Within the dtype's rounding of the same model on oneDNN only.
    off_rows = record_logits(off)
    off.generate([Request(p, SamplingParams(max_tokens=1, temperature=0.0), request_id=i)
                  for i, p in enumerate(prompts)])
    tol = 0.05 if dtype == "bfloat16" else 1e-4
    for i in range(len(prompts)):
        want, got = off_rows[i][0].float(), runs["off"][0][i][0].float()
        torch.testing.assert_close(got, want, rtol=0, atol=tol * float(want.abs().max()))
