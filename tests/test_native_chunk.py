"""The compiled chunk kernel (``native.chunk_attention``): a prefill chunk's queries over its cached prefix, which
every one of them sees whole, and causally over the chunk's own keys. Equal to float64 attention within one
bfloat16 rounding, the same bits for a row in any company and on any number of threads, refusing what it cannot
take, and used by the engine for bfloat16 prefill chunks, where cache-on logits stay bit-identical to
cache-off. Each test runs on each way the kernel has on this CPU: the tile unit (AMX) and the vector unit
(AVX-512 BF16)."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mmcache.engine import Engine, EngineConfig, Request, SamplingParams, attention
from mmcache.engine.compute import native
from mmcache.engine.inspect import record_logits


@pytest.fixture
def lib(native_kernel):
    if native.chunk_way(native_kernel, 64) is native.CHUNK_NONE:
        pytest.skip("the chunk kernel needs AVX-512 BF16 or the tile unit (AMX), which this CPU does not have")
    return native_kernel


@pytest.fixture(params=[native.CHUNK_TILES, native.CHUNK_VECTOR])
def way(request, lib):
    """``vector_only`` for the way under test; the tile unit's way is skipped where it is not granted."""
    if request.param == native.CHUNK_TILES and native.chunk_way(lib, 64) is not native.CHUNK_TILES:
        pytest.skip("the tile unit (AMX) is not granted on this CPU (or MMCACHE_TILE_UNIT=off)")
    return {"vector_only": request.param == native.CHUNK_VECTOR}


def skip_unless_taken(lib, way, dim):
    """Skip a head size the way under test does not take (the tile unit: 32 and 64)."""
    if native.chunk_way(lib, dim, **way) is native.CHUNK_NONE:
        pytest.skip(f"head size {dim} is not on this way")


def case(kv_heads, group, n, cached, dim, seed=0):
    """Queries (kv_heads, group * n, d), cached keys and values (or None), the chunk's own keys and values."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(kv_heads, group * n, dim, generator=g).bfloat16()
    kp = (torch.randn(kv_heads, cached, dim, generator=g) * 2).bfloat16() if cached else None
    vp = torch.randn(kv_heads, cached, dim, generator=g).bfloat16() if cached else None
    kn = (torch.randn(kv_heads, n, dim, generator=g) * 2).bfloat16()
    vn = torch.randn(kv_heads, n, dim, generator=g).bfloat16()
    return q, kp, vp, kn, vn


def reference(q, kp, vp, kn, vn, scale):
    """float64: row r is token r % n; it sees every cached key and the chunk's keys up to its own."""
    n, cached = kn.shape[1], 0 if kp is None else kp.shape[1]
    keys = kn.double() if kp is None else torch.cat([kp, kn], 1).double()
    values = vn.double() if vp is None else torch.cat([vp, vn], 1).double()
    scores = q.double() @ keys.transpose(1, 2) * scale
    token = torch.arange(q.shape[1]) % n
    hidden = (torch.arange(cached + n)[None, :] - cached) > token[:, None]
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.softmax(scores, -1) @ values, torch.logsumexp(scores, -1)


def aten(q, kp, vp, kn, vn, scale):
    """The engine's ATen path for the same chunk, (kv_heads, group * n, d)."""
    kv_heads, rows, dim = q.shape
    n = kn.shape[1]
    heads_first = q.view(kv_heads, rows // n, n, dim).reshape(-1, n, dim)
    if kp is None:
        o = F.scaled_dot_product_attention(heads_first[None], kn[None], vn[None], is_causal=True, scale=scale,
                                           enable_gqa=True)[0]
    else:
        o = attention._over_prefix(heads_first, kp, vp, kn, vn, scale).transpose(0, 1)
    return o.reshape(kv_heads, rows, dim)


@pytest.mark.parametrize("kv_heads,group,n,cached,dim", [
    (2, 7, 128, 1920, 64),  # a hit's last page on the Qwen2.5-0.5B shape
    (2, 7, 300, 0, 64),  # a cold chunk
    (2, 7, 37, 50, 64),  # rows that straddle heads, keys that straddle tiles and sources
    (1, 1, 16, 0, 32), (2, 3, 5, 7, 32), (1, 2, 1, 3, 64), (1, 4, 20, 64, 32),
    (2, 4, 128, 300, 128), (1, 3, 33, 40, 96)])  # the Llama 3 / Qwen2.5-7B head size, and Phi-3's
def test_kernel_equals_float64_attention(lib, way, kv_heads, group, n, cached, dim):
    """The output within one bfloat16 rounding of the probabilities (about 2^-8 of the values) and no further
    from float64 than ATen's path with the same bfloat16 output, the log-sum-exp within float32 rounding."""
    skip_unless_taken(lib, way, dim)
    q, kp, vp, kn, vn = case(kv_heads, group, n, cached, dim)
    scale = dim ** -0.5
    out, lse = native.chunk_attention(lib, q, kp, vp, kn, vn, scale, **way)
    want, want_lse = reference(q, kp, vp, kn, vn, scale)
    assert out.dtype == lse.dtype == torch.float32 and out.shape == q.shape and lse.shape == q.shape[:2]
    err = (out.bfloat16().double() - want).abs().max()
    assert err < 1.6e-2
    assert err <= (aten(q, kp, vp, kn, vn, scale).double() - want).abs().max() + 4e-3
    assert (lse.double() - want_lse).abs().max() < 1e-4


def test_keys_and_values_read_in_place_from_views(lib, way):
    """Heads may lie apart (pages of the pool, the step's packed keys): the same bits as contiguous copies."""
    g = torch.Generator().manual_seed(1)
    pool = torch.randn(2, 2, 12, 16, 64, generator=g).bfloat16()  # (k/v, kv_heads, pages, page, d)
    kp = pool[0][:, 3:9].reshape(2, -1, 64)[:, :90]
    vp = pool[1][:, 3:9].reshape(2, -1, 64)[:, :90]
    step = torch.randn(2, 2, 50, 64, generator=g).bfloat16()  # (k/v, kv_heads, rows of the step, d)
    kn, vn = step[0][:, 10:30], step[1][:, 10:30]
    q = torch.randn(2, 3 * 20, 64, generator=g).bfloat16()
    assert not kp.is_contiguous() and not kn.is_contiguous()
    assert native.supports_chunk(lib, q, kn, vn, kp, vp)
    got = native.chunk_attention(lib, q, kp, vp, kn, vn, 0.125, **way)
    want = native.chunk_attention(lib, q, kp.contiguous(), vp.contiguous(), kn.contiguous(), vn.contiguous(), 0.125,
                                  **way)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # the chunk's own keys and values with their rows apart too, as in a projection's output (tokens, k/v,
    # heads, d): the vector way copies such key rows before its products
    packed = torch.randn(40, 2, 2, 64, generator=g).bfloat16()  # 40 tokens: keys 96 .. 111 lie in them alone
    kn, vn = packed[:, 0].transpose(0, 1), packed[:, 1].transpose(0, 1)
    q = torch.randn(2, 3 * 40, 64, generator=g).bfloat16()
    assert kn.stride(1) == 256 and native.supports_chunk(lib, q, kn, vn, kp, vp)
    got = native.chunk_attention(lib, q, kp, vp, kn, vn, 0.125, **way)
    want = native.chunk_attention(lib, q, kp.contiguous(), vp.contiguous(), kn.contiguous(), vn.contiguous(), 0.125,
                                  **way)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("dim", [64, 128])
def test_a_row_gets_the_same_bits_in_any_company_and_on_any_threads(lib, way, dim):
    """A row's result depends on its query and token only: computed with all of its chunk's rows, with one
    thread, or with only some of the chunk's query heads, the same bits."""
    skip_unless_taken(lib, way, dim)
    q, kp, vp, kn, vn = case(2, 5, 24, 70, dim, seed=2)
    out, lse = native.chunk_attention(lib, q, kp, vp, kn, vn, 0.125, **way)
    one = native.chunk_attention(lib, q, kp, vp, kn, vn, 0.125, threads=1, **way)
    assert torch.equal(one[0], out) and torch.equal(one[1], lse)
    for heads in (slice(0, 1), slice(1, 3), slice(4, 5)):  # query heads of each KV head, 24 rows apiece
        rows = slice(heads.start * 24, heads.stop * 24)
        part, part_lse = native.chunk_attention(lib, q[:, rows], kp, vp, kn, vn, 0.125, **way)
        assert torch.equal(part, out[:, rows]) and torch.equal(part_lse, lse[:, rows])


def test_supports_only_what_the_kernel_takes(lib):
    q, kp, vp, kn, vn = case(2, 4, 8, 40, 64)
    assert native.supports_chunk(lib, q, kn, vn, kp, vp) and native.supports_chunk(lib, q, kn, vn)
    assert not native.supports_chunk(lib, q.float(), kn.float(), vn.float())  # bfloat16 only
    tiles = native.chunk_way(lib, 64) is native.CHUNK_TILES
    for dim in (16, 32, 48, 64, 96, 128, 160):
        parts = case(2, 4, 8, 0, dim)[::3] + (case(2, 4, 8, 0, dim)[4],)
        # where the tile unit is granted, 32 and 64 only (others stay on ATen); the vector way: 32 to 128
        assert native.supports_chunk(lib, *parts) == (dim in ((32, 64) if tiles else (32, 64, 96, 128)))
        assert native.supports_chunk(lib, *parts, vector_only=True) == (dim in (32, 64, 96, 128))
    rows_apart = kn.transpose(1, 2).contiguous().transpose(1, 2)
    assert not native.supports_chunk(lib, q, rows_apart, vn)
    assert not native.supports_chunk(lib, q, kn[:1], vn[:1])  # another number of KV heads
    assert not native.supports_chunk(lib, q, kn, vn[:, :5])  # keys and values of different lengths
    assert not native.supports_chunk(lib, q[:, :30], kn, vn)  # rows not a whole number of query heads
    assert not native.supports_chunk(lib, q, kn, vn, kp, vp[:, :20])
    assert not native.supports_chunk(lib, q, kn, vn, kp[:, :0], vp[:, :0])  # an empty prefix: pass None
    assert not native.supports_chunk(lib, q, kn, vn, kp, None)

    class NoWay:  # a build without AVX-512 BF16 and without tiles
        @staticmethod
        def mmc_chunk_way(dim, vector_only):
            return 0

    assert not native.supports_chunk(NoWay(), q, kn, vn, kp, vp)
    assert native.chunk_way(None, 64) is native.CHUNK_NONE


def test_a_refused_call_raises_instead_of_writing(lib, way):
    q, kp, vp, kn, vn = case(2, 4, 8, 40, 48)  # a head size the kernel does not take, past the check
    with pytest.raises(ValueError, match="chunk kernel refused"):
        native.chunk_attention(lib, q, kp, vp, kn, vn, 0.125, **way)


def head64_model(head_dim: int = 64):
    """A two-layer Qwen2 with 64-wide heads (the tiny presets' are 16 wide, which the kernel does not take)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=1024,
                      initializer_range=0.15, tie_word_embeddings=True, attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(cfg)
    return model.to(torch.bfloat16).eval()


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_engine_chunks_run_on_the_kernel_and_stay_bit_identical_to_cache_off(lib, monkeypatch, head_dim):
    """bfloat16, exact schedule: with the cache on, later requests seed from the first one's pages and their
    chunks attend over them on the kernel; with it off, the same page-sized chunks attend over their own
    earlier pages on the kernel too. Every logits row is equal bit for bit."""
    calls = []
    real = native.chunk_attention
    monkeypatch.setattr(native, "chunk_attention", lambda *a, **kw: calls.append(a[2] is None) or real(*a, **kw))
    if native.chunk_way(lib, head_dim) is native.CHUNK_NONE:
        pytest.skip(f"no way of the kernel takes head size {head_dim} here")
    model = head64_model(head_dim)
    rng = np.random.default_rng(0)
    prefix = rng.integers(2, 512, 56).tolist()
    prompts = [prefix + rng.integers(2, 512, n).tolist() for n in (20, 9, 30)] + [list(prefix)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    runs = {}
    for mode in ("on", "off"):
        eng = Engine(model, None, EngineConfig.exact(page_size=16, num_pages=64, cache_mode=mode))
        suffix = {native.CHUNK_TILES: "native-chunk", native.CHUNK_VECTOR: "native-chunk-vector"}
        assert suffix[native.chunk_way(lib, head_dim)] in eng.backend.split("+")
        rec = record_logits(eng)
        calls.clear()
        outs = eng.generate([Request(p, sp, request_id=i) for i, p in enumerate(prompts)])
        assert set(calls) == {True, False}, "chunks at the start and over a prefix, both on the kernel"
        runs[mode] = (rec, outs)
        eng.check_invariants()
    assert [o.matched_tokens for o in runs["on"][1]] == [0, 48, 48, 48]
    for i in range(len(prompts)):
        assert len(runs["on"][0][i]) == len(runs["off"][0][i]) == 12
        for a, b in zip(runs["on"][0][i], runs["off"][0][i]):
            assert torch.equal(a, b)
        assert runs["on"][1][i].output_ids == runs["off"][1][i].output_ids


@pytest.mark.usefixtures("one_thread")
def test_engine_tokens_on_the_kernel_and_on_aten_agree(lib, monkeypatch):
    """The same requests with the kernel and on ATen (MMCACHE_NATIVE=off): the greedy tokens agree on this
    model (the two round differently in the last bits, which flips no greedy choice here)."""
    model = head64_model()
    rng = np.random.default_rng(3)
    prompts = [rng.integers(2, 512, n).tolist() for n in (70, 33, 100)]
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outs = {}
    for mode in ("require", "off"):
        monkeypatch.setenv(native.ENV_CHOICE, mode)
        # A copy each: an engine replaces the model's modules in place (and the norms only with the kernel).
        eng = Engine(copy.deepcopy(model), None, EngineConfig(page_size=16, num_pages=64))
        outs[mode] = [o.output_ids for o in eng.generate([Request(p, sp) for p in prompts])]
    assert outs["require"] == outs["off"]
