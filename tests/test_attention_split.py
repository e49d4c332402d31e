"""The two-part attention of a chunk over a cached prefix equals one masked attention over the whole context."""

import pytest
import torch
import torch.nn.functional as F

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
