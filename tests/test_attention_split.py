"""The two-part attention of a chunk over a cached prefix equals one masked attention over the whole context."""

import pytest
import torch
import torch.nn.functional as F

from mmcache.engine.compute import native
from mmcache.engine.attention import _over_prefix


def reference(q, k, v, start, scale):
    """Bottom-right causal attention of q (heads, n, d) over k/v (kv_heads, start + n, d), in float64."""
    ctx = k.shape[1]
    allowed = torch.arange(ctx)[None, :] <= torch.arange(start, ctx)[:, None]
    group = q.shape[0] // k.shape[0]
    k64, v64 = (t.double().repeat_interleave(group, 0) for t in (k, v))
    o = F.scaled_dot_product_attention(q.double(), k64, v64, attn_mask=allowed, scale=scale)
    return o.transpose(0, 1)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (14, 2), (8, 1)])
@pytest.mark.parametrize("start,n", [(16, 16), (128, 32), (37, 5), (256, 1), (1, 64)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_prefix_and_causal_parts_merged_by_log_sum_exp_equal_masked_attention(heads, kv_heads, start, n, dtype, tol):
    g = torch.Generator().manual_seed(start * 100 + n)
    d = 64
    q = torch.randn(heads, n, d, generator=g).to(dtype)
    k = (torch.randn(kv_heads, start + n, d, generator=g) * 2).to(dtype)  # spread logits: unequal weights
    v = torch.randn(kv_heads, start + n, d, generator=g).to(dtype)
    scale = d ** -0.5
    got = _over_prefix(q, k[:, :start], v[:, :start], k[:, start:], v[:, start:], scale)
    assert got.shape == (n, heads, d) and got.dtype == dtype
    want = reference(q, k, v, start, scale)
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=0)


def test_a_query_whose_own_keys_dominate_takes_them_and_not_the_prefix():
    """The mixing weight is sigmoid(l_prefix - l_new): when the new keys outweigh the prefix by far, the
    output is the new part's average (and the other way round), with no overflow."""
    d, n, start = 8, 4, 8
    q = torch.ones(1, n, d) * 10
    k_prefix, v_prefix = -torch.ones(1, start, d), torch.full((1, start, d), 5.0)
    k_new, v_new = torch.ones(1, n, d), torch.full((1, n, d), -3.0)
    got = _over_prefix(q, k_prefix, v_prefix, k_new, v_new, 1.0)
    torch.testing.assert_close(got, torch.full((n, 1, d), -3.0))
    got = _over_prefix(-q, k_prefix, v_prefix, k_new, v_new, 1.0)
    torch.testing.assert_close(got, torch.full((n, 1, d), 5.0))


def decode_reference(q, cache, table, ctx_lens, scale, window=None):
    """Per sequence, attention of its one query (heads, d) over its first ctx_len tokens (the last
    ``window`` of them under a window), in float64."""
    kv_heads, dim = cache.shape[1], cache.shape[-1]
    out = []
    for s, (pages, ctx) in enumerate(zip(table, ctx_lens)):
        lo = 0 if window is None else max(0, int(ctx) - window)
        k = cache[0].index_select(1, pages).reshape(kv_heads, -1, dim)[:, lo:ctx].double()
        v = cache[1].index_select(1, pages).reshape(kv_heads, -1, dim)[:, lo:ctx].double()
        group = q.shape[1] // kv_heads
        o = F.scaled_dot_product_attention(q[s].double()[:, None], k.repeat_interleave(group, 0),
                                           v.repeat_interleave(group, 0), scale=scale)
        out.append(o[:, 0])
    return torch.stack(out)


def decode(cache, table, ctx_lens, q, window=None, scale=0.25):
    """``paged_attention`` over one decode group whose keys are already in ``cache`` (layer 0)."""
    from mmcache.engine.attention import DecodeGroup, PagedBatch, paged_attention

    n, heads, d = q.shape
    kv_heads, page_size = cache.shape[1], cache.shape[-2]
    batch = PagedBatch([], [DecodeGroup(slice(0, n), cache[None], table, ctx_lens)], [], page_size, native.library())
    empty = torch.zeros(1, kv_heads, n, d, dtype=q.dtype)
    module = type("M", (), {"layer_idx": 0})()
    out = paged_attention(module, q.transpose(0, 1)[None], empty, empty, None, scaling=scale,
                          sliding_window=window, mmcache_batch=batch)[0]
    return out[0], batch


@pytest.fixture
def cascades(monkeypatch):
    """ATen's decode path (the compiled kernel reads every sequence's pages itself and has no shared part),
    with every cascade call's shared keys' shape recorded in the returned list."""
    from mmcache.engine import attention

    monkeypatch.setenv("MMCACHE_NATIVE", "off")
    calls = []
    real = attention._over_shared_pages
    monkeypatch.setattr(attention, "_over_shared_pages", lambda *a: calls.append(a[1].shape) or real(*a))
    return calls


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_decodes_sharing_leading_pages_read_them_once_and_equal_plain_attention(dtype, tol, cascades):
    g = torch.Generator().manual_seed(3)
    P, heads, kv_heads, d, num_pages = 8, 6, 2, 16, 12
    cache = (torch.randn(2, kv_heads, num_pages, P, d, generator=g) * 2).to(dtype)
    # Three sequences: pages 5 and 2 shared, then their own; the third is shorter (its table is padded).
    table = torch.tensor([[5, 2, 7, 9], [5, 2, 1, 3], [5, 2, 4, 4]])
    ctx_lens = torch.tensor([30, 25, 19])
    q = torch.randn(3, heads, d, generator=g).to(dtype)
    got, batch = decode(cache, table, ctx_lens, q)
    assert batch.prefix_groups(0, None) == [([0, 1, 2], 2)] and cascades == [(kv_heads, 2 * P, d)]  # read once
    assert batch.prefix_groups(0, 24) == []  # a window in reach: no shared part
    want = decode_reference(q, cache, table, ctx_lens, 0.25)
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=0)


@pytest.mark.parametrize("window", [None, 13])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_each_decode_attends_over_exactly_its_own_keys_whatever_its_company(dtype, tol, window, decode_path):
    """Without shared pages every sequence is attended alone over its own context (the last ``window`` of
    it under a window), whether its pages form a run (read in place) or not (gathered): it equals plain
    attention, and its output is bit for bit what it is when decoded alone or beside other sequences."""
    g = torch.Generator().manual_seed(7)
    P, heads, kv_heads, d, num_pages = 8, 4, 2, 16, 16
    cache = (torch.randn(2, kv_heads, num_pages, P, d, generator=g) * 2).to(dtype)
    table = torch.tensor([[3, 4, 5, 6], [9, 1, 12, 12], [0, 7, 7, 7]])  # a run; scattered; short, padded
    ctx_lens = torch.tensor([29, 17, 9])
    q = torch.randn(3, heads, d, generator=g).to(dtype)
    together, batch = decode(cache, table, ctx_lens, q, window)
    assert batch.prefix_groups(0, window) == []
    full = decode_reference(q, cache, table, ctx_lens, 0.25, window)
    torch.testing.assert_close(together.double(), full, atol=tol, rtol=0)
    for s in range(3):
        alone, _ = decode(cache, table[s:s + 1, : -(-int(ctx_lens[s]) // P)], ctx_lens[s:s + 1], q[s:s + 1], window)
        assert torch.equal(alone[0], together[s])


def test_shared_pages_stop_where_tables_differ_or_a_sequence_ends():
    from mmcache.engine.attention import DecodeGroup, PagedBatch

    kv = torch.zeros(2, 1, 8, 4, 2)
    cases = [([[1, 2, 3], [1, 2, 4]], [12, 12], [([0, 1], 2)]), ([[1, 2, 3], [1, 5, 3]], [12, 12], [([0, 1], 1)]),
             ([[1, 2, 3], [1, 2, 3]], [9, 12], [([0, 1], 2)]),
             ([[1, 2, 3], [1, 2, 3]], [8, 12], [([0, 1], 1)]),  # 8: page 2 ends the first
             ([[6, 2], [1, 2]], [8, 8], []), ([[1, 2, 3]], [12], []),  # different first pages; one sequence
             # two prefixes, each shared by its own sequences, and one sequence on its own
             ([[1, 2, 3], [6, 7, 0], [1, 2, 4], [5, 2, 3], [6, 7, 4]], [12] * 5, [([0, 2], 2), ([1, 4], 2)])]
    for table, ctx, want in cases:
        group = DecodeGroup(slice(0, len(table)), kv, torch.tensor(table), torch.tensor(ctx))
        assert PagedBatch([], [group], [], 4).prefix_groups(0, None) == want, (table, ctx)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_decodes_under_two_prefixes_read_each_prefix_once_and_equal_plain_attention(dtype, tol, cascades):
    g = torch.Generator().manual_seed(5)
    P, heads, kv_heads, d, num_pages = 8, 6, 2, 16, 16
    cache = (torch.randn(2, kv_heads, num_pages, P, d, generator=g) * 2).to(dtype)
    # Pages 5, 2 start two sequences and 8, 9, 10 two others (two system prompts); the fifth shares nothing.
    table = torch.tensor([[5, 2, 7, 7], [8, 9, 10, 1], [5, 2, 3, 4], [8, 9, 10, 12], [11, 6, 0, 0]])
    ctx_lens = torch.tensor([20, 30, 29, 25, 21])
    q = torch.randn(5, heads, d, generator=g).to(dtype)
    got, batch = decode(cache, table, ctx_lens, q)
    assert batch.prefix_groups(0, None) == [([0, 2], 2), ([1, 3], 3)]
    assert cascades == [(kv_heads, 2 * P, d), (kv_heads, 3 * P, d)]  # each prefix read once
    torch.testing.assert_close(got.double(), decode_reference(q, cache, table, ctx_lens, 0.25), atol=tol, rtol=0)


def test_page_runs_are_recognised_exactly():
    from mmcache.engine.attention import _run_start

    runs = {(4,): 4, (4, 5): 4, (0, 1, 2, 3): 0, (7, 8, 9): 7}
    not_runs = [(), (5, 4), (4, 6), (1, 3, 2, 4), (2, 2, 3), (4, 6, 5, 7), (3, 2, 1, 0)]
    for pages, start in runs.items():
        assert _run_start(torch.tensor(pages)) == start
    for pages in not_runs:
        assert _run_start(torch.tensor(pages, dtype=torch.int64)) is None, pages


def test_a_run_of_pages_is_read_in_place_and_other_tables_are_gathered():
    from mmcache.engine.attention import PagedBatch

    part = torch.arange(2 * 10 * 4 * 3, dtype=torch.float32).view(2, 10, 4, 3)  # (kv_heads, pages, P, d)
    batch = PagedBatch([], [], [], 4)
    run = batch.read(part, ("x",), torch.tensor([3, 4, 5]))
    assert run.shape == (2, 12, 3) and run.data_ptr() == part[:, 3].data_ptr()  # a view: nothing copied
    scattered = batch.read(part, ("y",), torch.tensor([5, 3, 4]))
    assert scattered.data_ptr() != part[:, 5].data_ptr()
    for got, pages in ((run, [3, 4, 5]), (scattered, [5, 3, 4])):
        assert torch.equal(got, torch.cat([part[:, p] for p in pages], dim=1))
    # The check is made once per key and forward: a later call with the same key reuses it.
    assert batch.read(part, ("x",), torch.tensor([3, 4, 5])).data_ptr() == run.data_ptr()


@pytest.mark.parametrize("window", [None, 16])  # 16: masked segments and plain decodes (no shared part)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reading_pages_in_place_gives_the_bits_of_gathering_them(dtype, window, decode_path):
    """The same keys and values in a run of pages and in scattered pages: prefix chunks, decodes over shared
    leading pages, and masked segments give identical outputs (the in-place read changes strides, not values)."""
    from mmcache.engine.attention import DecodeGroup, PagedBatch, Segment, paged_attention

    g = torch.Generator().manual_seed(11)
    P, heads, kv_heads, d, num_pages, layers = 8, 4, 2, 16, 16, 1
    ctx = 5 * P
    keys = (torch.randn(2, kv_heads, ctx, d, generator=g) * 2).to(dtype)
    layouts = {"run": [2, 3, 4, 5, 6], "scattered": [9, 1, 12, 4, 7]}
    outs = {}
    for name, pages in layouts.items():
        kv = torch.zeros(layers, 2, kv_heads, num_pages, P, d, dtype=dtype)
        for j, page in enumerate(pages):
            kv[0, :, :, page] = keys[:, :, j * P:(j + 1) * P]
        table = torch.tensor(pages)
        # A 6-token chunk at positions 34..39 over the first 34 tokens, plus two decodes sharing 3 pages.
        seg = Segment(slice(0, 6), 34, ctx, kv, table)
        dec_table = torch.stack([table, table])
        group = DecodeGroup(slice(6, 8), kv, dec_table, torch.tensor([ctx, ctx - 3]))
        batch = PagedBatch([seg], [group], [], P, native.library())
        q = torch.randn(1, heads, 8, d, generator=torch.Generator().manual_seed(5)).to(dtype)
        module = type("M", (), {"layer_idx": 0})()
        # No new keys to write (writes=[]): the step's tokens are already in the pages above.
        empty = torch.zeros(1, kv_heads, 8, d, dtype=dtype)
        outs[name] = paged_attention(module, q, empty, empty, None, scaling=0.25, sliding_window=window,
                                     mmcache_batch=batch)[0]
        assert batch.prefix_groups(0, window) == ([([0, 1], 4)] if window is None else [])
    assert torch.equal(outs["run"], outs["scattered"])
