"""bfloat16 linears packed as float32 (``kernels.widened``), as on CPUs where oneDNN has no bfloat16 path (AVX2
only): decided by packing a small weight, products in float32 rounded once to bfloat16, the fused MLP and the
grouped projections installed as elsewhere, twice the bytes counted for packing, and an engine on them still
bit-exact with the cache on and off. The widening is forced here so that these tests run on every machine."""

import numpy as np
import pytest
import torch
from torch import nn

from mmcache.engine import ComputeConfig, Engine, EngineConfig, Request, SamplingParams
from mmcache.engine.compute import kernels
from mmcache.engine.inspect import exact_runs, record_logits, rows_equal
from mmcache.presets.text import build_model

pytestmark = pytest.mark.skipif(not kernels.available(torch.device("cpu"), torch.float32),
                                reason="oneDNN is not available in this torch build")

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture
def widen(monkeypatch):
    """This process's probe answer for bfloat16 set to "oneDNN cannot pack it"."""
    monkeypatch.setattr(kernels, "_PACKS", {torch.bfloat16: False})


def test_the_probe_widens_bfloat16_only_where_packing_it_fails(monkeypatch):
    real = kernels._pack

    def no_bf16(weight):
        if weight.dtype == torch.bfloat16:
            raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support ...")
        return real(weight)

    monkeypatch.setattr(kernels, "_PACKS", {})
    monkeypatch.setattr(kernels, "_pack", no_bf16)
    assert kernels.widened(torch.bfloat16) and not kernels.widened(torch.float32)
    w = torch.randn(8, 16).bfloat16()
    assert kernels.packed_bytes(w) == 8 * 16 * 4 and kernels.packed_bytes(w.float()) == 8 * 16 * 4
    monkeypatch.setattr(kernels, "_PACKS", {})
    monkeypatch.setattr(kernels, "_pack", lambda weight: weight)  # packing works: nothing widened
    assert not kernels.widened(torch.bfloat16) and kernels.packed_bytes(w) == 8 * 16 * 2


@pytest.mark.parametrize("bias", [True, False])
def test_a_widened_linear_rounds_a_float32_product_once(widen, bias):
    torch.manual_seed(0)
    linear = nn.Linear(96, 40, bias=bias).bfloat16()
    state = {k: v.clone() for k, v in linear.state_dict().items()}
    packed = kernels.PackedLinear(linear)
    assert packed.packed.widened and packed.packed.packed.dtype == torch.float32
    assert packed.state_dict().keys() == state.keys()
    assert all(torch.equal(packed.state_dict()[k], v) for k, v in state.items())
    for rows in (1, 7, 130):
        x = torch.randn(rows, 96).bfloat16()
        got = packed(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 40)
        exact = x.double() @ linear.weight.double().T + (linear.bias.double() if bias else 0)
        # one rounding of a float32 sum: within half a bfloat16 step of the exact value, plus float32 sums
        assert torch.all((got.double() - exact).abs() <= exact.abs() * 2.0 ** -8 + 1e-5)
        assert torch.equal(got, kernels.PackedWeight(linear.weight, linear.bias)(x))  # deterministic


def test_an_engine_on_widened_linears_packs_fuses_groups_and_stays_bit_exact(widen):
    model, tok = build_model("tiny", "bfloat16")
    need = Engine(build_model("tiny", "bfloat16")[0], tok,
                  EngineConfig(page_size=16, num_pages=64,
                               compute=ComputeConfig(packed_linears=False))).compute.bytes_to_pack()
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    assert need == sum(m.weight.numel() * 4 for m in linears)  # float32 copies of bfloat16 weights
    rng = np.random.default_rng(3)
    prefix = rng.integers(2, 512, size=40).tolist()
    prompts = [prefix + rng.integers(2, 512, size=n).tolist() for n in (9, 21)] + [list(prefix)]
    runs = exact_runs(model, tok, prompts, GREEDY, page_size=16, num_pages=64)
    eng = runs["on"][2]
    layer = model.model.layers[0]
    assert eng.compute.num_packed_linears > 0 and isinstance(layer.mlp, kernels.PackedGatedMLP)
    assert isinstance(layer.self_attn.q_proj, kernels.PackedProjection)
    assert layer.mlp.gate_proj.packed.widened and layer.self_attn.q_proj.group.packed.widened
    assert "+onednn-packed-f32" in eng.backend
    assert [o.matched_tokens for o in runs["on"][1]] == [0, 32, 32]
    assert all(rows_equal(runs["on"][0], runs["off"][0], i, GREEDY.max_tokens) for i in range(len(prompts)))

    # Within bfloat16 rounding of the same model on plain (ATen bfloat16) linears.
    plain_model, _ = build_model("tiny", "bfloat16")
    plain = Engine(plain_model, tok,
                   EngineConfig.exact(page_size=16, num_pages=64, compute=ComputeConfig(packed_linears=False)))
    plain_rows = record_logits(plain)
    plain.generate([Request(p, SamplingParams(max_tokens=1, temperature=0.0), request_id=i)
                    for i, p in enumerate(prompts)])
    for i in range(len(prompts)):
        want, got = plain_rows[i][0].float(), runs["off"][0][i][0].float()
        torch.testing.assert_close(got, want, rtol=0, atol=0.05 * float(want.abs().max()))
