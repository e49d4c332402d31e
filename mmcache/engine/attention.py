"""Paged attention plugged into transformers' attention interface.

``register()`` adds ``ATTENTION_BACKEND`` to ``transformers.AttentionInterface`` and a mask function that
returns ``None`` to ``AttentionMaskInterface``, so transformers builds no dense mask: masking is decided here,
per segment. A model whose ``config._attn_implementation`` is ``ATTENTION_BACKEND`` calls ``paged_attention``
in every layer with the layer's query and the step's new post-RoPE keys and values; the step's ``PagedBatch``
reaches it as the keyword argument ``BATCH_KWARG`` given to the model's forward.

Layout: the forward packs several segments (one request's scheduled tokens of one label) along the sequence
axis of a batch of one. Segment ``s`` owns rows ``rows[s]`` and attends to positions ``0 .. ctx_len - 1`` of
its own sequence only. Invariants:

* Every new key/value row is written into its pool slot (``slots``: page * page_size + offset) before any
  segment reads, so a segment sees its own new tokens through the pool like any earlier token.
* A segment that starts at position 0 attends over its fresh keys directly (plain causal); any other reads
  its pages with one ``index_select`` per pool tensor and layer and applies a bottom-right causal mask
  (query ``i`` sees keys ``0 .. start + i``), or no mask for a single query.
* The result of a segment depends only on its own queries and the contents of its pages, never on which
  other segments share the forward (beyond the GEMM row-count effects of the projections around it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..errors import MmcacheError

ATTENTION_BACKEND = "mmcache_paged_sdpa"
BATCH_KWARG = "mmcache_batch"


class UnsupportedModel(MmcacheError, ValueError):
    """The model needs an attention feature the paged backend does not implement (e.g. logit soft-capping)."""


@dataclass
class Segment:
    rows: slice  # rows of the packed batch
    start: int  # sequence position of the first row
    ctx_len: int  # tokens attended after this step's write: start + number of rows
    kv: torch.Tensor  # the pool tensor holding this segment's pages
    pages: torch.Tensor | None  # page ids covering positions 0 .. ctx_len - 1; None when start == 0

    @property
    def q_len(self) -> int:
        return self.rows.stop - self.rows.start


@dataclass
class WriteGroup:
    """The rows of one pool: their keys and values go to ``slots`` of ``kv``."""

    kv: torch.Tensor
    rows: slice
    slots: torch.Tensor  # int64, one flat slot per row


@dataclass
class PagedBatch:
    """Everything the attention function needs for one forward; built once, read by every layer."""

    segments: list[Segment]
    writes: list[WriteGroup]
    page_size: int
    _masks: dict = field(default_factory=dict)

    def mask(self, index: int, window: int | None, dtype: torch.dtype) -> tuple[torch.Tensor | None, bool]:
        """``(attn_mask, is_causal)`` for segment ``index`` under an optional sliding window, cached per forward."""
        key = (index, window, dtype)
        hit = self._masks.get(key)
        if hit is None:
            hit = self._masks[key] = _mask(self.segments[index], window, dtype)
        return hit


def _mask(seg: Segment, window: int | None, dtype: torch.dtype) -> tuple[torch.Tensor | None, bool]:
    q, ctx, start = seg.q_len, seg.ctx_len, seg.start
    windowed = window is not None and ctx > window
    if not windowed and start == 0:
        return None, q > 1
    if not windowed and q == 1:
        return None, False
    qpos = torch.arange(start, ctx).unsqueeze(1)
    kpos = torch.arange(ctx).unsqueeze(0)
    allowed = kpos <= qpos
    if windowed:
        allowed &= kpos > qpos - window
    # An additive float mask takes the fused CPU kernel; a boolean one is slower there.
    return torch.zeros(q, ctx, dtype=dtype).masked_fill_(~allowed, float("-inf")), False


def paged_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                    scaling: float | None = None, dropout: float = 0.0, sliding_window: int | None = None,
                    **kwargs) -> tuple[torch.Tensor, None]:
    """The registered attention function. ``query``: (1, heads, T, d); ``key``/``value``: (1, kv_heads, T, d)."""
    batch: PagedBatch | None = kwargs.get(BATCH_KWARG)
    if batch is None:
        raise UnsupportedModel(f"{ATTENTION_BACKEND} needs the engine's {BATCH_KWARG} keyword argument")
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise UnsupportedModel(f"{ATTENTION_BACKEND} does not implement soft-capping or attention sinks")
    layer = module.layer_idx
    q, k, v = query[0], key[0], value[0]
    heads, total, dim = q.shape
    kv_heads = k.shape[0]
    for w in batch.writes:
        cache = w.kv[layer]
        cache[0].view(kv_heads, -1, dim).index_copy_(1, w.slots, k[:, w.rows])
        cache[1].view(kv_heads, -1, dim).index_copy_(1, w.slots, v[:, w.rows])
    out = q.new_empty(total, heads, dim)
    gqa = heads != kv_heads
    for i, seg in enumerate(batch.segments):
        if seg.pages is None:
            ks, vs = k[:, seg.rows], v[:, seg.rows]
        else:
            cache = seg.kv[layer]
            ks = cache[0].index_select(1, seg.pages).view(kv_heads, -1, dim)[:, :seg.ctx_len]
            vs = cache[1].index_select(1, seg.pages).view(kv_heads, -1, dim)[:, :seg.ctx_len]
        mask, causal = batch.mask(i, sliding_window, q.dtype)
        o = F.scaled_dot_product_attention(q[None, :, seg.rows], ks[None], vs[None], attn_mask=mask,
                                           is_causal=causal, scale=scaling, enable_gqa=gqa)
        out[seg.rows] = o[0].transpose(0, 1)
    return out[None], None


def no_mask(*args, **kwargs) -> None:
    """Mask function for ``AttentionMaskInterface``: masking happens inside ``paged_attention``."""
    return None


def register() -> str:
    """Register the backend with transformers (idempotent) and return its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_BACKEND, paged_attention)
    AttentionMaskInterface.register(ATTENTION_BACKEND, no_mask)
    return ATTENTION_BACKEND
