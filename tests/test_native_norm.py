"""The compiled RMSNorm (``native.rms_norm``) and its modules (``mmcache.engine.compute.norms``): the Llama family's
formula to one rounding of the element type, a row's bits independent of its company and of the thread count,
typed refusals, modules replaced only where the kernel reproduces them (with their parameters untouched), and
an engine that runs on them and names them in its backend."""

import numpy as np
import pytest
import torch
from torch import nn

from mmcache.engine import ComputeConfig, Engine, EngineConfig, SamplingParams
from mmcache.engine.compute import native, norms
from mmcache.engine.inspect import record_logits
from mmcache.presets.text import build_model


def module_formula(x, w, eps):
    """LlamaRMSNorm.forward, written out."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def case(rows, cols, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=g) * 3).to(dtype), torch.randn(cols, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,cols", [(1, 896), (7, 64), (300, 896), (5, 37), (2, 16)])
def test_kernel_computes_the_module_formula_to_one_rounding(native_kernel, dtype, rows, cols):
    x, w = case(rows, cols, dtype)
    got, want = native.rms_norm(native_kernel, x, w, 1e-6), module_formula(x, w, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(got.float(), want.float(), rtol=2 * ulp, atol=ulp * float(want.abs().max()))
    if dtype == torch.bfloat16:  # the sum of squares' order moves a bfloat16 rounding only rarely
        assert (got != want).float().mean() < 0.01


def test_a_rows_bits_do_not_depend_on_its_company_threads_or_layout(native_kernel):
    x, w = case(300, 896, torch.bfloat16, seed=1)
    whole = native.rms_norm(native_kernel, x, w, 1e-5, threads=2)
    assert torch.equal(whole, native.rms_norm(native_kernel, x, w, 1e-5, threads=1))
    assert torch.equal(whole[17:18], native.rms_norm(native_kernel, x[17:18], w, 1e-5))
    wide = torch.zeros(300, 1000, dtype=torch.bfloat16)
    wide[:, 50:946] = x
    view = wide[:, 50:946]  # rows 1000 elements apart
    assert not view.is_contiguous() and torch.equal(whole, native.rms_norm(native_kernel, view, w, 1e-5))
    batched = native.rms_norm(native_kernel, x.view(3, 100, 896), w, 1e-5)
    assert batched.shape == (3, 100, 896) and torch.equal(batched.view(300, 896), whole)


def test_the_kernel_refuses_what_it_cannot_take(native_kernel):
    x, w = case(4, 32, torch.bfloat16)
    for bad_x, bad_w in [(x, w.float()), (x.half(), w.half()), (x, w[:16]), (x, w.view(2, 16))]:
        with pytest.raises(ValueError, match="rms_norm"):
            native.rms_norm(native_kernel, bad_x, bad_w, 1e-6)
    with pytest.raises(ValueError, match="refused"):
        native.rms_norm(native_kernel, x, w, float("nan"))


class GemmaStyleRMSNorm(nn.Module):
    """Another formula under the same kind of name: (1 + weight), product in float32."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = 1e-6

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


def test_install_replaces_only_what_the_kernel_reproduces_and_keeps_the_parameters(native_kernel):
    model, _ = build_model("tiny-qwen2", "bfloat16")
    decoder = model.get_decoder()
    decoder.layers[0].extra_norm = GemmaStyleRMSNorm(decoder.config.hidden_size).to(torch.bfloat16)
    before = {k: v for k, v in model.state_dict().items()}
    weight = decoder.layers[1].input_layernorm.weight
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        want = model(input_ids=ids).logits
    layers = len(decoder.layers)
    assert norms.install(decoder, native_kernel) == 2 * layers + 1  # two per layer and the final norm
    assert isinstance(decoder.layers[1].input_layernorm, norms.NativeRMSNorm)
    assert decoder.layers[1].input_layernorm.weight is weight  # the same Parameter, still tied to the same data
    assert isinstance(decoder.layers[0].extra_norm, GemmaStyleRMSNorm)  # its formula differs: not replaced
    after = model.state_dict()
    assert after.keys() == before.keys() and all(after[k] is before[k] or torch.equal(after[k], before[k])
                                                  for k in before)
    assert norms.install(decoder, native_kernel) == 2 * layers + 1  # idempotent
    with torch.no_grad():
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.05 * float(want.abs().max()))


def test_inputs_the_kernel_does_not_take_run_the_formula_in_torch(native_kernel):
    x, w = case(6, 64, torch.float32)
    source = nn.Module()
    source.weight, source.variance_epsilon = nn.Parameter(w.bfloat16()), 1e-6
    module = norms.NativeRMSNorm(source, native_kernel)
    assert torch.equal(module(x), module_formula(x, source.weight, 1e-6))  # float32 input, bfloat16 weight


def test_an_engine_runs_its_norms_on_the_kernel_and_names_them(native_kernel, monkeypatch):
    """Native norms on one model, torch's on an identical one: the backend names differ (so their pages never
    mix), greedy tokens agree and logits stay close; every norm of every forward runs on the kernel."""
    calls = []
    real = native.rms_norm
    monkeypatch.setattr(native, "rms_norm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    tok = build_model("tiny-llama", "bfloat16")[1]
    on = Engine(build_model("tiny-llama", "bfloat16")[0], tok, EngineConfig(page_size=16, num_pages=64))
    off = Engine(build_model("tiny-llama", "bfloat16")[0], tok,
                 EngineConfig(page_size=16, num_pages=64, compute=ComputeConfig(layer_kernels=False)))
    assert on.backend == off.backend + "+native-norm" and on.fingerprint != off.fingerprint
    assert on.compute.num_native_norms == 2 * on.adapter.num_layers + 1 and off.compute.num_native_norms == 0
    calls.clear()  # construction probed each module once
    rows = {"on": record_logits(on), "off": record_logits(off)}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 512, size=n).tolist() for n in (9, 33)]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    a = on.generate(prompts, sp)
    forwards = on.counters["forwards"]
    assert len(calls) == forwards * (2 * on.adapter.num_layers + 1)
    b = off.generate(prompts, sp)
    assert [o.output_ids for o in a] == [o.output_ids for o in b]
    pairs = [xy for a_rows, b_rows in zip(rows["off"].values(), rows["on"].values()) for xy in zip(a_rows, b_rows)]
    assert len(pairs) == 2 * 6
    for x, y in pairs:
        torch.testing.assert_close(y.float(), x.float(), rtol=0, atol=0.05 * float(x.abs().max()))
    on.check_invariants()
