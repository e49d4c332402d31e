"""The compiled rotary embedding (``native.rotary``) and its installation (``mmcache.engine.rotary``): the same
bits as transformers' ``apply_rotary_pos_emb`` in float32 and bfloat16, laid out as the input is, typed
refusals, a replacement only where it reproduces the original, the original for every call it does not take,
and an engine whose logits do not change by a bit with it."""

import sys
import types

import numpy as np
import pytest
import torch
import transformers.models.llama.modeling_llama as modeling_llama
from torch import nn

from mmcache.engine import Engine, EngineConfig, SamplingParams, native, rotary
from mmcache.engine.inspect import record_logits
from mmcache.engine.models import build_model


def original():
    fn = modeling_llama.apply_rotary_pos_emb
    return fn.original if isinstance(fn, rotary.NativeRotary) else fn


def case(tokens, heads, kv_heads, dim, dtype, seed=0):
    """q and k as the attention modules make them (a transpose of the projections), cos and sin (1, T, D)."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(1, tokens, heads * dim, generator=g) * 4).to(dtype).view(1, tokens, heads, dim).transpose(1, 2)
    k = torch.randn(1, tokens, kv_heads * dim, generator=g).to(dtype).view(1, tokens, kv_heads, dim).transpose(1, 2)
    cos, sin = (torch.randn(1, tokens, dim, generator=g).to(dtype) for _ in range(2))
    return q, k, cos, sin


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,heads,kv_heads,dim", [(1, 14, 2, 64), (300, 14, 2, 64), (5, 4, 2, 16),
                                                       (3, 2, 1, 6), (7, 4, 4, 128)])
def test_kernel_gives_transformers_bits_and_layout(native_kernel, dtype, tokens, heads, kv_heads, dim):
    q, k, cos, sin = case(tokens, heads, kv_heads, dim, dtype)
    want_q, want_k = original()(q, k, cos, sin)
    for x, want in ((q, want_q), (k, want_k)):
        got = native.rotary(native_kernel, x, cos, sin)
        assert got.dtype == want.dtype and torch.equal(got, want)
        if min(x.shape[1:]) > 1:  # torch lays a result out as the projections' transpose; with a dimension of
            assert got.stride() == want.stride()  # size 1 its choice depends on cos's layout, not on values
    contiguous = q.contiguous()  # and a plain (B, H, T, D) tensor, as other callers pass
    assert torch.equal(native.rotary(native_kernel, contiguous, cos, sin), original()(contiguous, k, cos, sin)[0])


def test_threads_do_not_change_a_bit(native_kernel):
    q, _, cos, sin = case(2048, 14, 2, 64, torch.bfloat16, seed=3)
    assert torch.equal(native.rotary(native_kernel, q, cos, sin, threads=1),
                       native.rotary(native_kernel, q, cos, sin, threads=2))


def test_the_kernel_refuses_what_it_cannot_take(native_kernel):
    q, k, cos, sin = case(4, 2, 2, 16, torch.bfloat16)
    bad = [(q.float(), cos, sin), (q, cos.float(), sin.float()), (q, cos[:, :3], sin[:, :3]),
           (q[..., :15], cos[..., :15], sin[..., :15]), (q.half(), cos.half(), sin.half()),
           (q.transpose(2, 3).contiguous().transpose(2, 3), cos, sin), (q, cos, sin[:, :, :8])]
    for x, c, s in bad:
        assert not native.rotary_takes(x, c, s)
        with pytest.raises(ValueError, match="rotary takes"):
            native.rotary(native_kernel, x, c, s)
    assert native.rotary_takes(q, cos, sin)


def test_the_replacement_hands_what_it_does_not_take_to_the_original(native_kernel):
    replacement = rotary.NativeRotary(original(), native_kernel)
    q, k, cos, sin = case(6, 4, 2, 16, torch.float32)
    for args in [(q.half(), k.half(), cos.half(), sin.half()), (q, k, cos.float()[:, None], sin.float()[:, None])]:
        want, got = original()(*args), replacement(*args)
        assert all(torch.equal(a, b) for a, b in zip(want, got))
    qt, kt = q.transpose(1, 2), k.transpose(1, 2)  # (B, T, H, D) with unsqueeze_dim=2
    want, got = original()(qt, kt, cos, sin, unsqueeze_dim=2), replacement(qt, kt, cos, sin, unsqueeze_dim=2)
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_install_replaces_only_what_it_reproduces_and_uninstall_restores(native_kernel, monkeypatch):
    fake = types.ModuleType("fake_modeling")

    def interleaved(q, k, cos, sin, unsqueeze_dim=1):  # another rotary layout under the same name
        def rot(x):
            return torch.stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + rot(q) * sin, k * cos + rot(k) * sin

    class FakeAttention(nn.Module):
        head_dim = 16

    FakeAttention.__module__ = fake.__name__
    fake.apply_rotary_pos_emb = interleaved
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    root = nn.Module()
    root.attn = FakeAttention()
    assert rotary.install(root, native_kernel) == 0 and fake.apply_rotary_pos_emb is interleaved

    model, _ = build_model("tiny-llama", "float32")
    before = modeling_llama.apply_rotary_pos_emb
    rotary.uninstall(model)
    plain = modeling_llama.apply_rotary_pos_emb
    assert not isinstance(plain, rotary.NativeRotary)
    try:
        assert rotary.install(model, native_kernel) == 1 == rotary.installed(model)
        installed = modeling_llama.apply_rotary_pos_emb
        assert isinstance(installed, rotary.NativeRotary) and installed.original is plain
        assert rotary.install(model, native_kernel) == 1 and modeling_llama.apply_rotary_pos_emb is installed
        rotary.uninstall(model)
        assert modeling_llama.apply_rotary_pos_emb is plain and rotary.installed(model) == 0
    finally:
        modeling_llama.apply_rotary_pos_emb = before


def test_an_engine_installs_it_and_its_logits_keep_every_bit(native_kernel):
    """bfloat16, exact schedule, cache off: the same requests with transformers' function and with the
    replacement give logits equal bit for bit (the replacement changes speed, not results)."""
    before = modeling_llama.apply_rotary_pos_emb
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 512, size=n).tolist() for n in (9, 40)]
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    runs = {}
    try:
        for side in ("torch", "kernels"):
            model, tok = build_model("tiny-llama", "bfloat16")  # a model each: the first engine sets it up
            eng = Engine(model, tok, EngineConfig.exact(page_size=16, num_pages=64, cache_mode="off"))
            assert isinstance(modeling_llama.apply_rotary_pos_emb, rotary.NativeRotary)
            if side == "torch":
                rotary.uninstall(model)
            rows = record_logits(eng)
            eng.generate(prompts, sp)
            runs[side] = [r for v in rows.values() for r in v]
    finally:
        modeling_llama.apply_rotary_pos_emb = before
    assert len(runs["torch"]) == len(runs["kernels"]) == 2 * 8
    assert all(torch.equal(a, b) for a, b in zip(runs["torch"], runs["kernels"]))
