"""An attention module's query, key and value projections as one packed product (``kernels.PackedProjections``):
one product per input tensor object, each part within float rounding of its own linear, nothing kept once all
parts are handed out, and the engine using it where the three projections can be grouped."""

import pytest
import torch
from torch import nn

from mmcache.engine import Engine, EngineConfig
from mmcache.engine.compute import kernels
from mmcache.presets.text import build_model

pytestmark = pytest.mark.skipif(not kernels.available(torch.device("cpu"), torch.float32),
                                reason="oneDNN is not available in this torch build")


def projections(bias: bool, dtype=torch.float32, widths=(48, 16, 16)) -> list[nn.Linear]:
    torch.manual_seed(0)
    return [nn.Linear(32, w, bias=bias).to(dtype) for w in widths]


def same_product(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_part_is_its_own_linear_and_one_tensor_takes_one_product(bias, dtype):
    parts = projections(bias, dtype)
    group = kernels.PackedProjections(parts)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for rows in (1, 5, 130):
        x = torch.randn(rows, 32).to(dtype)
        got = [group.part(i, x) for i in range(3)]
        for g, p in zip(got, parts):
            want = p(x).detach()
            assert g.shape == want.shape and g.dtype == dtype
            torch.testing.assert_close(g.float(), want.float(), rtol=tol, atol=tol)
        assert same_product(got[0], got[1]) and same_product(got[1], got[2])  # one product for the three
        assert group._x is None and group._parts == ()  # nothing kept once every part is out


def test_another_tensor_or_a_part_asked_twice_computes_afresh():
    group = kernels.PackedProjections(projections(True))
    x = torch.randn(4, 32)
    twin = x.clone()  # equal values, another object
    q = group.part(0, x)
    k_twin = group.part(1, twin)
    assert not same_product(q, k_twin) and torch.equal(k_twin, group.part(1, twin.clone()))
    k = group.part(1, x)  # x's parts were replaced by twin's: afresh, and equal
    v = group.part(2, x)
    assert same_product(k, v) and torch.equal(k, k_twin)
    q2 = group.part(0, x)
    q3 = group.part(0, x)  # the same part twice: the second is a new product
    assert torch.equal(q2, q) and not same_product(q2, q3) and torch.equal(q3, q)


def test_parts_may_be_asked_in_any_order():
    group = kernels.PackedProjections(projections(False))
    x = torch.randn(3, 32)
    v, q, k = group.part(2, x), group.part(0, x), group.part(1, x)
    assert same_product(v, q) and same_product(q, k) and group._x is None
    assert [t.shape[-1] for t in (q, k, v)] == [48, 16, 16]


def test_only_groupable_projections_are_grouped():
    class Attention(nn.Module):
        def __init__(self, parts):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = parts

    mixed_bias = projections(True)
    mixed_bias[1] = nn.Linear(32, 16, bias=False)
    other_input = projections(False)
    other_input[2] = nn.Linear(24, 16, bias=False)
    for parts in (mixed_bias, other_input):
        layers = nn.ModuleList([Attention(parts)])
        kernels.pack_linears(layers)
        assert all(type(getattr(layers[0], n)) is kernels.PackedLinear for n in kernels.PROJECTIONS)
    layers = nn.ModuleList([Attention(projections(True))])
    state = {k: v.clone() for k, v in layers.state_dict().items()}
    kernels.pack_linears(layers)
    assert all(type(getattr(layers[0], n)) is kernels.PackedProjection for n in kernels.PROJECTIONS)
    after = layers.state_dict()  # the parameters, names and values, are the model's own
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-llama"])  # biased and unbiased projections
def test_the_engine_groups_the_projections_of_every_layer(name):
    model, tok = build_model(name, "float32")
    eng = Engine(model, tok, EngineConfig(page_size=16, num_pages=32))
    for layer in model.model.layers:
        groups = {id(getattr(layer.self_attn, n).group) for n in kernels.PROJECTIONS}
        assert len(groups) == 1
    out = eng.generate([list(range(5, 40))], None)[0]
    assert out.finish_reason in ("length", "eos") and out.output_ids
    assert all(getattr(layer.self_attn, n).group._x is None for layer in model.model.layers
               for n in kernels.PROJECTIONS)  # no activation kept between forwards
