"""The compiled prefix kernel (``native.prefix_attention``): a chunk's queries over a cached prefix that every
one of them sees whole. Equal to float64 attention within one bfloat16 rounding, the same bits for a row in any
company and on any number of threads, refusing what it cannot take, and used by the engine for bfloat16 chunks
over cached pages, where cache-on logits stay bit-identical to cache-off."""

import numpy as np
import pytest
import torch

from mmcache.engine import Engine, EngineConfig, Request, SamplingParams, native
from mmcache.engine.inspect import record_logits


@pytest.fixture
def lib(native_kernel):
    if not native_kernel.tiles:
        pytest.skip("the prefix kernel runs on the tile unit (AMX), which this CPU or kernel does not grant")
    return native_kernel


def case(heads, rows, keys, dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, rows, dim, generator=g).bfloat16()
    k = (torch.randn(heads, keys, dim, generator=g) * 2).bfloat16()
    v = torch.randn(heads, keys, dim, generator=g).bfloat16()
    return q, k, v


def reference(q, k, v, scale):
    scores = q.double() @ k.double().transpose(1, 2) * scale
    return torch.softmax(scores, -1) @ v.double(), torch.logsumexp(scores, -1)


@pytest.mark.parametrize("heads,rows,keys,dim", [(2, 896, 1920, 64), (2, 37, 50, 64), (1, 16, 16, 32),
                                                 (3, 100, 333, 64), (2, 7, 1, 64), (1, 17, 65, 32)])
def test_kernel_equals_float64_attention(lib, heads, rows, keys, dim):
    """Any number of rows and keys (whole tiles or not): the output within one bfloat16 rounding of the
    probabilities (about 2^-8 of the values), the log-sum-exp within float32 rounding."""
    q, k, v = case(heads, rows, keys, dim)
    out, lse = native.prefix_attention(lib, q, k, v, dim ** -0.5)
    want, want_lse = reference(q, k, v, dim ** -0.5)
    assert out.dtype == lse.dtype == torch.float32 and out.shape == q.shape and lse.shape == q.shape[:2]
    assert (out.double() - want).abs().max() < 1.6e-2
    assert (lse.double() - want_lse).abs().max() < 1e-4
    # No worse than ATen's flash kernel on the same inputs.
    aten, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q[None], k[None], v[None],
                                                                        scale=dim ** -0.5)
    assert (out.double() - want).abs().max() <= (aten[0].double() - want).abs().max() + 1e-6


def test_keys_and_values_read_in_place_from_a_view_of_the_pool(lib):
    """Heads may lie apart (a view of pages of the pool): the same bits as a contiguous copy."""
    g = torch.Generator().manual_seed(1)
    pool = torch.randn(2, 2, 12, 16, 64, generator=g).bfloat16()  # (k/v, kv_heads, pages, page, d)
    k = pool[0][:, 3:9].reshape(2, -1, 64)[:, :90]
    v = pool[1][:, 3:9].reshape(2, -1, 64)[:, :90]
    assert not k.is_contiguous() and native.supports_prefix(lib, torch.zeros(2, 5, 64).bfloat16(), k, v)
    q = torch.randn(2, 40, 64, generator=g).bfloat16()
    got = native.prefix_attention(lib, q, k, v, 0.125)
    want = native.prefix_attention(lib, q, k.contiguous(), v.contiguous(), 0.125)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_row_gets_the_same_bits_in_any_company_and_on_any_threads(lib):
    q, k, v = case(2, 75, 300, 64, seed=2)
    out, lse = native.prefix_attention(lib, q, k, v, 0.125)
    one = native.prefix_attention(lib, q, k, v, 0.125, threads=1)
    assert torch.equal(one[0], out) and torch.equal(one[1], lse)
    for lo, hi in ((0, 1), (5, 21), (16, 32), (60, 75)):
        part, part_lse = native.prefix_attention(lib, q[:, lo:hi], k, v, 0.125)
        assert torch.equal(part, out[:, lo:hi]) and torch.equal(part_lse, lse[:, lo:hi])


def test_supports_only_what_the_kernel_takes(lib):
    q, k, v = case(2, 8, 40, 64)
    assert native.supports_prefix(lib, q, k, v)
    assert not native.supports_prefix(lib, q.float(), k.float(), v.float())  # bfloat16 only
    for dim in (16, 48, 96, 128):  # 128: ATen's kernel is as fast there (benchmarks/RESULTS.md)
        assert not native.supports_prefix(lib, *case(2, 8, 40, dim))
    assert not native.supports_prefix(lib, q, k.transpose(1, 2).contiguous().transpose(1, 2), v)  # rows apart
    assert not native.supports_prefix(lib, q, k[:1], v[:1])  # another number of KV heads
    assert not native.supports_prefix(lib, q, k, v[:, :20])  # keys and values of different lengths
    assert not native.supports_prefix(lib, q, k[:, :0], v[:, :0])  # no keys

    class NoTiles:
        tiles = False

    assert not native.supports_prefix(NoTiles(), q, k, v)


def test_a_refused_call_raises_instead_of_writing(lib):
    q, k, v = case(2, 8, 40, 48)  # a head size the kernel does not take, past the check
    with pytest.raises(ValueError, match="prefix kernel refused"):
        native.prefix_attention(lib, q, k, v, 0.125)


def head64_model():
    """A two-layer Qwen2 with 64-wide heads (the tiny presets' are 16 wide, which the kernel does not take)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                      initializer_range=0.15, tie_word_embeddings=True, attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(cfg)
    return model.to(torch.bfloat16).eval()


@pytest.mark.usefixtures("one_thread")
def test_engine_hits_run_on_the_kernel_and_stay_bit_identical_to_cache_off(lib, monkeypatch):
    """bfloat16, exact schedule: with the cache on, later requests seed from the first one's pages and their
    chunks attend over them on the kernel; with it off, the same page-sized chunks attend over their own
    earlier pages on the kernel too. Every logits row is equal bit for bit."""
    calls = []
    real = native.prefix_attention
    monkeypatch.setattr(native, "prefix_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    model = head64_model()
    rng = np.random.default_rng(0)
    prefix = rng.integers(2, 512, 56).tolist()
    prompts = [prefix + rng.integers(2, 512, n).tolist() for n in (20, 9, 30)] + [list(prefix)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    runs = {}
    for mode in ("on", "off"):
        eng = Engine(model, None, EngineConfig.exact(page_size=16, num_pages=64, cache_mode=mode))
        assert eng.backend.endswith("+native-prefix")
        rec = record_logits(eng)
        calls.clear()
        outs = eng.generate([Request(p, sp, request_id=i) for i, p in enumerate(prompts)])
        assert calls, "no chunk went to the prefix kernel"
        runs[mode] = (rec, outs)
        eng.check_invariants()
    assert [o.matched_tokens for o in runs["on"][1]] == [0, 48, 48, 48]
    for i in range(len(prompts)):
        assert len(runs["on"][0][i]) == len(runs["off"][0][i]) == 12
        for a, b in zip(runs["on"][0][i], runs["off"][0][i]):
            assert torch.equal(a, b)
        assert runs["on"][1][i].output_ids == runs["off"][1][i].output_ids
