"""The compiled rotary embedding (``native.rotary``) and its installation (``mmcache.engine.compute.rotary``): the same
bits as transformers' ``apply_rotary_pos_emb`` in float32 and bfloat16, laid out as the input is, typed
refusals, a replacement only where it reproduces the original, the original for every call it does not take,
and an engine whose logits do not change by a bit with it."""

import contextlib
import pickle
import sys
import types

import inspect

import numpy as np
import pytest
import torch
import transformers.models.llama.modeling_llama as modeling_llama
from torch import nn

from mmcache.engine import Engine, EngineConfig, SamplingParams
from mmcache.engine.compute import native, rotary
from mmcache.engine.inspect import record_logits
from mmcache.presets.text import build_model


def original():
    """transformers' plain function (behind the name, or inside the name's wrapper), replaced or not."""
    slot, _ = rotary._slot(modeling_llama)
    fn = slot.get()
    return fn.original if isinstance(fn, rotary.NativeRotary) else fn


@contextlib.contextmanager
def kept(home):
    """The modeling module's name, and what its wrapper (if any) holds, as they were before the block."""
    name = getattr(home, rotary.NAME)
    slot, _ = rotary._slot(home)
    inside = slot.get() if slot is not None else None
    try:
        yield
    finally:
        setattr(home, rotary.NAME, name)
        if slot is not None:
            slot.set(inside)


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
    with kept(modeling_llama):
        name = modeling_llama.apply_rotary_pos_emb  # transformers' function, or (5.25) its hub wrapper
        rotary.uninstall(model)
        plain = original()
        assert rotary.replacement(modeling_llama) is None and inspect.isfunction(plain)
        assert rotary.install(model, native_kernel) == 1 == rotary.installed(model)
        installed = rotary.replacement(modeling_llama)
        assert isinstance(installed, rotary.NativeRotary) and installed.original is plain
        assert modeling_llama.apply_rotary_pos_emb is (installed if inspect.isfunction(name) else name)
        assert rotary.install(model, native_kernel) == 1 and rotary.replacement(modeling_llama) is installed
        rotary.uninstall(model)
        assert original() is plain and modeling_llama.apply_rotary_pos_emb is name and rotary.installed(model) == 0


def test_an_engine_installs_it_and_its_logits_keep_every_bit(native_kernel):
    """bfloat16, exact schedule, cache off: the same requests with transformers' function and with the
    replacement give logits equal bit for bit (the replacement changes speed, not results)."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 512, size=n).tolist() for n in (9, 40)]
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    runs = {}
    with kept(modeling_llama):
        for side in ("torch", "kernels"):
            model, tok = build_model("tiny-llama", "bfloat16")  # a model each: the first engine sets it up
            eng = Engine(model, tok, EngineConfig.exact(page_size=16, num_pages=64, cache_mode="off"))
            assert rotary.installed(model) == 1, rotary.skipped(model)
            if side == "torch":
                rotary.uninstall(model)
            rows = record_logits(eng)
            eng.generate(prompts, sp)
            runs[side] = [r for v in rows.values() for r in v]
    assert len(runs["torch"]) == len(runs["kernels"]) == 2 * 8
    assert all(torch.equal(a, b) for a, b in zip(runs["torch"], runs["kernels"]))


def llama_rotary(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' function, under the name the installer looks for (a wrapper is built around it below)."""
    return original()(q, k, cos, sin, unsqueeze_dim)


llama_rotary.__name__ = rotary.NAME


def wrapped_modeling(monkeypatch, name):
    """A modeling module laid out as transformers 5.x lays out Llama's with the ``kernels`` package installed:
    ``apply_rotary_pos_emb`` a hub wrapper (an ``nn.Module``), the attention class routing it per instance."""
    import kernels as hub  # the test extra installs it: these tests never skip for want of it
    fake = types.ModuleType(name)
    wrapper = hub.use_kernel_forward_from_hub("rotary_pos_emb")(llama_rotary)

    @hub.use_kernelized_func(wrapper)
    class WrappedAttention(nn.Module):
        head_dim = 16

        def forward(self, q, k, cos, sin):
            return getattr(fake, rotary.NAME)(q, k, cos, sin)

    WrappedAttention.__module__ = fake.__name__
    fake.apply_rotary_pos_emb = wrapper
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    return fake, WrappedAttention


def test_a_wrapped_function_is_replaced_through_its_wrapper(native_kernel, monkeypatch):
    fake, attention = wrapped_modeling(monkeypatch, "fake_wrapped_modeling")
    wrapper = fake.apply_rotary_pos_emb
    root = nn.Module()
    root.attn = attention()
    assert rotary.install(root, native_kernel) == 1 == rotary.installed(root)
    installed = rotary.replacement(fake)
    assert isinstance(installed, rotary.NativeRotary) and installed.original is llama_rotary
    assert fake.apply_rotary_pos_emb is wrapper  # the name keeps its wrapper; the function inside is replaced
    taken = []
    monkeypatch.setattr(native, "rotary_taken", lambda *a: taken.append(1) or original_taken(*a))
    q, k, cos, sin = case(5, 4, 2, 16, torch.bfloat16)
    got, want = root.attn(q, k, cos, sin), original()(q, k, cos, sin)
    assert len(taken) == 2 and all(torch.equal(a, b) for a, b in zip(got, want))
    rotary.uninstall(root)
    assert fake.apply_rotary_pos_emb is wrapper and rotary.installed(root) == 0
    assert all(torch.equal(a, b) for a, b in zip(root.attn(q, k, cos, sin), want)) and len(taken) == 2


original_taken = native.rotary_taken


def test_a_call_the_wrapper_routes_to_a_kernelized_module_stays_the_wrappers(native_kernel, monkeypatch):
    """A module kernelized with a hub kernel (its private copy of the wrapper given a forward of its own, as
    ``kernels.kernelize`` gives it) keeps that kernel; the others get the compiled one."""
    fake, attention = wrapped_modeling(monkeypatch, "fake_kernelized_modeling")
    root = nn.Module()
    root.plain, root.hub = attention(), attention()
    assert rotary.install(root, native_kernel) == 1
    (hub_copy,) = root.hub._kernel_funcs.values()  # the private copy kernelize would give a kernel
    marker = torch.zeros(1)
    hub_copy.forward = types.MethodType(lambda self, q, k, cos, sin, unsqueeze_dim=1: (marker, marker), hub_copy)
    taken = []
    monkeypatch.setattr(native, "rotary_taken", lambda *a: taken.append(1) or original_taken(*a))
    q, k, cos, sin = case(3, 2, 2, 16, torch.float32)
    got = root.hub(q, k, cos, sin)
    assert got[0] is marker and got[1] is marker and not taken
    want = original()(q, k, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(root.plain(q, k, cos, sin), want)) and len(taken) == 2


def test_a_wrapper_it_cannot_follow_is_left_alone_with_the_reason(native_kernel, monkeypatch, caplog):
    fake = types.ModuleType("fake_opaque_modeling")

    class Opaque:  # a callable object around the function: nothing says how it dispatches
        def __call__(self, *args, **kwargs):
            return llama_rotary(*args, **kwargs)

    class OpaqueAttention(nn.Module):
        head_dim = 16

    OpaqueAttention.__module__ = fake.__name__
    fake.apply_rotary_pos_emb = opaque = Opaque()
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    root = nn.Module()
    root.attn = OpaqueAttention()
    with caplog.at_level("INFO", logger="mmcache.engine.compute.rotary"):
        assert rotary.install(root, native_kernel) == 0
    assert fake.apply_rotary_pos_emb is opaque
    why = rotary.skipped(root)[fake.__name__]
    assert "neither a function nor a known wrapper" in why and why in caplog.text


def test_the_installed_versions_take_the_replacement(native_kernel):
    """With the transformers installed here (a plain function, or 5.x's hub wrapper) an engine's model gets it:
    a new wrapping of transformers' function fails here first, not as a silent loss of the kernel."""
    model, _ = build_model("tiny-llama", "float32")
    with kept(modeling_llama):
        rotary.install(model, native_kernel)
        assert rotary.installed(model) == 1, rotary.skipped(model)
        copied = pickle.loads(pickle.dumps(model))  # the wrapper's own pickling still works with it in place
        ids = torch.arange(2, 12)[None]
        assert torch.equal(copied(ids).logits, model(ids).logits)
