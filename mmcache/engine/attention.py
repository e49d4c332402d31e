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
* A prefill segment that starts at position 0 attends over its fresh keys directly (plain causal). Any
  other (a chunk over a cached prefix) sees keys ``0 .. start + i`` from query ``i``. On CPU, outside a
  sliding window, that is computed as two unmasked flash-attention calls merged by their log-sum-exp: every
  query over the prefix ``0 .. start - 1`` (read from its pages with one ``index_select`` per layer), and
  plain causal over the chunk's own new keys, so no float mask is built or read. Otherwise the segment reads
  all its pages and applies a bottom-right causal (and window) mask.
* In bfloat16, where the engine's compiled library can use the tile unit (and no sliding window is in reach),
  a prefill segment instead goes whole to ``native.chunk_attention``: every query over the cached prefix and,
  causally, over the chunk's own keys, in one call per layer (no log-sum-exp merge).
* Single-token segments (decodes) of one pool form one group. On CPU the group goes, in one call per layer,
  to the compiled kernel of ``native`` where it builds and takes the shape: it reads every sequence's pages
  where they lie, through its page table. Otherwise (ATen's path) each sequence of the group is attended
  alone over exactly its own keys (no padding, no mask: its context, or the last ``window`` of it), read in
  place when its pages form one ascending run and gathered otherwise: one flash call per sequence costs less
  than gathering every table into one padded tensor (the gather copies every key and value once more).
  Sequences whose tables start with the same pages (a prefix seeded from the cache; several such groups may
  decode in one step, e.g. under two system prompts) read those pages once per group, in one unmasked call
  for all the group's queries, merged with each sequence's own part by log-sum-exp (cascade attention).
  Off CPU the group's page tables are padded to a common length, gathered with one ``index_select`` per
  layer, and an additive mask hides each sequence's padding.
* The result of a segment depends only on its own queries and the contents of its pages, never on which
  other segments share the forward (beyond the GEMM row-count effects of the projections around it). A
  decode on the kernel gives the same bits alone or beside other decodes; on ATen's path too where it shares
  no pages (with shared pages, where the split falls depends on the group).
* Pages are read in place when the ids to read form one ascending run (``a, a+1, ..., a+n-1``: the usual case
  for a prompt whose pages were taken together), as a view of the pool; otherwise with ``index_select``. The
  kernels receive the same values either way, and give the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..errors import MmcacheError
from .compute import native

ATTENTION_BACKEND = "mmcache_paged_sdpa"
BATCH_KWARG = "mmcache_batch"
# Flash attention that also returns each query's log-sum-exp (what the two-part path merges by).
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


class UnsupportedModel(MmcacheError, ValueError):
    """The model needs an attention feature the paged backend does not implement (e.g. logit soft-capping)."""


@dataclass
class Segment:
    """A run of rows of one sequence (a prefill chunk), attended on its own."""

    rows: slice  # rows of the packed batch
    start: int  # sequence position of the first row
    ctx_len: int  # tokens attended after this step's write: start + number of rows
    kv: torch.Tensor  # the pool tensor holding this segment's pages
    pages: torch.Tensor | None  # page ids covering positions 0 .. ctx_len - 1; None when start == 0

    @property
    def q_len(self) -> int:
        return self.rows.stop - self.rows.start


@dataclass
class DecodeGroup:
    """Single-token segments of one pool (decodes), attended in one call over their padded page tables."""

    rows: slice  # contiguous rows, one per sequence
    kv: torch.Tensor
    table: torch.Tensor  # (sequences, max pages) page ids, padded with a valid page that the mask hides
    ctx_lens: torch.Tensor  # (sequences,) tokens attended by each

    @property
    def size(self) -> int:
        return self.rows.stop - self.rows.start


@dataclass
class WriteGroup:
    """The rows of one pool: their keys and values go to ``slots`` of ``kv``."""

    kv: torch.Tensor
    rows: slice | torch.Tensor  # a slice, or int64 row indices where some rows of the pool write nothing
    slots: torch.Tensor  # int64, one flat slot per row


@dataclass
class PagedBatch:
    """Everything the attention function needs for one forward; built once, read by every layer."""

    segments: list[Segment]
    decodes: list[DecodeGroup]
    writes: list[WriteGroup]
    page_size: int
    kernel: object = None  # the compiled decode kernel (``native.library()``) the engine chose, or None: ATen
    windows: dict | None = None  # when a dict, each layer records the sliding window it was called with (a probe)
    _memo: dict = field(default_factory=dict)  # per-forward results (masks, shared pages, page runs), by key

    def mask(self, index: int, window: int | None, dtype: torch.dtype,
             device: torch.device) -> tuple[torch.Tensor | None, bool]:
        """``(attn_mask, is_causal)`` for segment ``index`` under an optional sliding window, cached per forward."""
        key = ("segment", index, window, dtype)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = _segment_mask(self.segments[index], window, dtype, device)
        return hit

    def prefix_groups(self, index: int, window: int | None) -> list[tuple[list[int], int]]:
        """The sequences of decode group ``index`` that share leading pages (the same page ids: a prefix seeded
        from the cache), as ``(members, pages)``: two or more sequences whose tables start with the same page,
        and how many leading pages all of them share, leaving each a non-empty rest. Sequences in no such
        group, and every sequence where the shared-prefix path does not apply (a sliding window in reach, not
        CPU), are in none. Cached per forward."""
        key = ("shared", index, window)
        hit = self._memo.get(key)
        if hit is None:
            g = self.decodes[index]
            hit = []
            if g.size >= 2 and g.kv.device.type == "cpu" and (window is None or max(self.lengths(index)) <= window):
                by_first: dict[int, list[int]] = {}
                for j, first in enumerate(g.table[:, 0].tolist()):
                    by_first.setdefault(first, []).append(j)
                for members in by_first.values():
                    if len(members) < 2:
                        continue
                    rows = g.table[members]
                    same = (rows == rows[:1]).all(0)
                    leading = int(same.to(torch.int32).cumprod(0).sum())
                    pages = min(leading, (min(self.lengths(index)[j] for j in members) - 1) // self.page_size)
                    if pages:
                        hit.append((members, pages))
            self._memo[key] = hit
        return hit

    def lengths(self, index: int) -> list[int]:
        """The context lengths of decode group ``index`` as Python ints, cached per forward."""
        key = ("lengths", index)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = [int(x) for x in self.decodes[index].ctx_lens.tolist()]
        return hit

    def read(self, part: torch.Tensor, key: tuple, pages: torch.Tensor) -> torch.Tensor:
        """The pages ``pages`` of one layer's key or value pool ``part`` (kv_heads, pages, page_size, d), as
        (kv_heads, len(pages) * page_size, d): a view when the ids are one ascending run, else a gathered copy.
        ``key`` names ``pages`` within this forward (the same ids are read in every layer), so the run check is
        made once per forward."""
        k = ("run",) + key
        start = self._memo.get(k, False)
        if start is False:
            start = self._memo[k] = _run_start(pages)
        kv_heads, dim = part.shape[0], part.shape[-1]
        if start is None:
            return part.index_select(1, pages).view(kv_heads, -1, dim)
        return part[:, start:start + pages.numel()].reshape(kv_heads, -1, dim)

    def decode_mask(self, index: int, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """(sequences, 1, 1, padded length) additive mask of decode group ``index`` over its padded page table,
        cached per forward (the batched decode path off CPU)."""
        key = ("decode", index, window, dtype)
        hit = self._memo.get(key)
        if hit is None:
            g = self.decodes[index]
            kpos = torch.arange(g.table.shape[1] * self.page_size, device=g.ctx_lens.device).unsqueeze(0)
            ctx = g.ctx_lens.unsqueeze(1)
            allowed = kpos < ctx
            if window is not None:
                allowed &= kpos >= ctx - window
            hit = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
            hit = hit.masked_fill_(~allowed, float("-inf"))[:, None, None, :]
            self._memo[key] = hit
        return hit


def _run_start(pages: torch.Tensor) -> int | None:
    """``a`` when ``pages`` is exactly ``a, a+1, ..., a+n-1`` (n >= 1), else None."""
    n = pages.numel()
    if n == 0:
        return None
    first = int(pages[0])
    if int(pages[-1]) - first != n - 1:
        return None
    if n > 2 and not torch.equal(pages, torch.arange(first, first + n, dtype=pages.dtype, device=pages.device)):
        return None
    return first


def _segment_mask(seg: Segment, window: int | None, dtype: torch.dtype,
                  device: torch.device) -> tuple[torch.Tensor | None, bool]:
    q, ctx, start = seg.q_len, seg.ctx_len, seg.start
    windowed = window is not None and ctx > window
    if not windowed and start == 0:
        return None, q > 1
    if not windowed and q == 1:
        return None, False
    qpos = torch.arange(start, ctx, device=device).unsqueeze(1)
    kpos = torch.arange(ctx, device=device).unsqueeze(0)
    allowed = kpos <= qpos
    if windowed:
        allowed &= kpos > qpos - window
    # An additive float mask takes the fused CPU kernel; a boolean one is slower there.
    return torch.zeros(q, ctx, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf")), False


def paged_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                    scaling: float | None = None, dropout: float = 0.0, sliding_window: int | None = None,
                    **kwargs) -> tuple[torch.Tensor, None]:
    """The registered attention function. ``query``: (1, heads, T, d); ``key``/``value``: (1, kv_heads, T, d)."""
    batch = _batch_of(kwargs)
    layer = module.layer_idx
    if batch.windows is not None:
        batch.windows[layer] = sliding_window
    q, k, v = query[0], key[0], value[0]
    heads, total, dim = q.shape
    _write_new_rows(batch, layer, k, v, dim)
    out = q.new_empty(total, heads, dim)
    for i in range(len(batch.decodes)):
        _attend_decode_group(batch, i, layer, q, k.shape[0], out, sliding_window, scaling)
    for i in range(len(batch.segments)):
        _attend_segment(batch, i, layer, q, k, v, out, sliding_window, scaling)
    return out[None], None


def _batch_of(kwargs: dict) -> PagedBatch:
    """The step's ``PagedBatch`` from the forward's keyword arguments; raises ``UnsupportedModel`` for a call
    this backend cannot serve (no batch, soft-capping or attention sinks)."""
    batch: PagedBatch | None = kwargs.get(BATCH_KWARG)
    if batch is None:
        raise UnsupportedModel(f"{ATTENTION_BACKEND} needs the engine's {BATCH_KWARG} keyword argument")
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise UnsupportedModel(f"{ATTENTION_BACKEND} does not implement soft-capping or attention sinks")
    return batch


def _write_new_rows(batch: PagedBatch, layer: int, k: torch.Tensor, v: torch.Tensor, dim: int) -> None:
    """Writes every new key and value row into its pool slot, before any segment reads (the module invariant)."""
    kv_heads = k.shape[0]
    for w in batch.writes:
        cache = w.kv[layer]
        cache[0].view(kv_heads, -1, dim).index_copy_(1, w.slots, k[:, w.rows])
        cache[1].view(kv_heads, -1, dim).index_copy_(1, w.slots, v[:, w.rows])


def _attend_decode_group(batch: PagedBatch, index: int, layer: int, q: torch.Tensor, kv_heads: int,
                         out: torch.Tensor, window: int | None, scale: float | None) -> None:
    """Writes the rows of ``out`` of decode group ``index``: on the compiled kernel where it takes the shape,
    else on ATen's path (one sequence at a time on CPU, padded page tables elsewhere)."""
    g = batch.decodes[index]
    cache = g.kv[layer]
    heads, _, dim = q.shape
    n = g.size
    # Query heads grouped by their KV head (heads h*G .. h*G+G-1 read KV head h) become G query rows
    # per KV head, so no key is repeated.
    qg = q[:, g.rows].transpose(0, 1).reshape(n, kv_heads, heads // kv_heads, dim)
    lib = batch.kernel if batch.kernel is not None and native.supports(qg, cache) else None
    if lib is not None:
        hi = g.ctx_lens
        lo = (hi - window).clamp_(min=0) if window is not None else torch.zeros_like(hi)
        o = native.decode_attention(lib, qg, cache[0], cache[1], g.table, lo, hi,
                                    dim ** -0.5 if scale is None else scale)
    elif q.device.type == "cpu":
        o = _decodes_one_by_one(batch, index, cache, qg, window, scale)
    else:
        o = _decodes_padded(batch, index, cache, qg, window, scale)
    out[g.rows] = o.reshape(n, heads, dim)


def _decodes_padded(batch: PagedBatch, index: int, cache: torch.Tensor, qg: torch.Tensor, window: int | None,
                    scale: float | None) -> torch.Tensor:
    """Decode attention of group ``index`` off CPU, (n, kv_heads, G, d): every page table padded to a common
    length, gathered once per layer, the padding hidden by an additive mask."""
    g = batch.decodes[index]
    n, kv_heads, _, dim = qg.shape
    table = g.table.reshape(-1)
    length = g.table.shape[1] * batch.page_size
    ks = batch.read(cache[0], ("decode", index), table).view(kv_heads, n, length, dim).transpose(0, 1)
    vs = batch.read(cache[1], ("decode", index), table).view(kv_heads, n, length, dim).transpose(0, 1)
    return F.scaled_dot_product_attention(qg, ks, vs, attn_mask=batch.decode_mask(index, window, qg.dtype),
                                          scale=scale)


def _attend_segment(batch: PagedBatch, index: int, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, window: int | None, scale: float | None) -> None:
    """Writes the rows of ``out`` of prefill segment ``index``: on the chunk kernel where it takes it, else as
    two parts merged (``_splits``), else over all its keys under its mask."""
    if _on_chunk_kernel(batch, index, window, layer, q, k, v, out, scale):
        return
    seg = batch.segments[index]
    if seg.pages is None:
        ks, vs = k[:, seg.rows], v[:, seg.rows]
    else:
        cache = seg.kv[layer]
        if _splits(seg, window, q.device):
            n = -(-seg.start // batch.page_size)
            ks = batch.read(cache[0], ("prefix", index), seg.pages[:n])[:, :seg.start]
            vs = batch.read(cache[1], ("prefix", index), seg.pages[:n])[:, :seg.start]
            out[seg.rows] = _over_prefix(q[:, seg.rows], ks, vs, k[:, seg.rows], v[:, seg.rows], scale)
            return
        ks = batch.read(cache[0], ("segment", index), seg.pages)[:, :seg.ctx_len]
        vs = batch.read(cache[1], ("segment", index), seg.pages)[:, :seg.ctx_len]
    mask, causal = batch.mask(index, window, q.dtype, q.device)
    o = F.scaled_dot_product_attention(q[None, :, seg.rows], ks[None], vs[None], attn_mask=mask,
                                       is_causal=causal, scale=scale, enable_gqa=q.shape[0] != k.shape[0])
    out[seg.rows] = o[0].transpose(0, 1)


def _on_chunk_kernel(batch: PagedBatch, index: int, window: int | None, layer: int, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, out: torch.Tensor, scale: float | None) -> bool:
    """Segment ``index`` on ``native.chunk_attention`` (its cached prefix and its own keys in one call) when the
    engine's compiled library takes it: bfloat16, no sliding window in reach, a head size the kernel has.
    Writes the segment's rows of ``out`` and returns True; otherwise touches nothing and returns False."""
    seg, lib = batch.segments[index], batch.kernel
    heads, _, dim = q.shape
    if (lib is None or q.dtype != torch.bfloat16 or native.chunk_way(lib, dim) is native.CHUNK_NONE
            or (window is not None and seg.ctx_len > window)):
        return False
    kv_heads, n = k.shape[0], seg.q_len
    stacked = q[:, seg.rows].reshape(kv_heads, -1, dim)
    k_new, v_new = k[:, seg.rows], v[:, seg.rows]
    k_prefix = v_prefix = None
    if seg.start:
        cache, first = seg.kv[layer], -(-seg.start // batch.page_size)
        k_prefix = batch.read(cache[0], ("prefix", index), seg.pages[:first])[:, :seg.start]
        v_prefix = batch.read(cache[1], ("prefix", index), seg.pages[:first])[:, :seg.start]
    if not native.supports_chunk(lib, stacked, k_new, v_new, k_prefix, v_prefix):
        return False
    o, _ = native.chunk_attention(lib, stacked, k_prefix, v_prefix, k_new, v_new,
                                  dim ** -0.5 if scale is None else scale)
    out[seg.rows] = o.view(heads, n, dim).transpose(0, 1)
    return True


def _splits(seg: Segment, window: int | None, device: torch.device) -> bool:
    """Whether a chunk over a cached prefix takes the two-part path (CPU flash kernel, no window in reach)."""
    return device.type == "cpu" and (window is None or seg.ctx_len <= window)


def _over_prefix(q: torch.Tensor, k_prefix: torch.Tensor, v_prefix: torch.Tensor, k_new: torch.Tensor,
                 v_new: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Attention of a chunk's queries (heads, n, d) over a prefix every one of them sees whole
    (kv_heads, start, d) and over the chunk's own keys (kv_heads, n, d) causally; returns (n, heads, d).

    Each part is a normalised softmax average with its log-sum-exp ``l``; the whole is their mix with the
    prefix's weight ``exp(l1) / (exp(l1) + exp(l2)) = sigmoid(l1 - l2)``, in float32. For the prefix part the
    query heads that share a KV head are stacked into one run of rows per KV head (no mask, so rows are
    interchangeable), which gives the kernel longer query blocks; the causal part shares GQA heads in the kernel.
    """
    heads, n, dim = q.shape
    kv_heads = k_prefix.shape[0]
    o1, l1 = _FLASH(q.reshape(1, kv_heads, -1, dim), k_prefix[None], v_prefix[None], scale=scale)
    o2, l2 = _FLASH(q[None], k_new[None], v_new[None], is_causal=True, scale=scale)
    share = torch.sigmoid(l1.reshape(heads, n) - l2[0]).unsqueeze(-1)
    mixed = torch.lerp(o2[0].float(), o1.reshape(heads, n, dim).float(), share)
    return mixed.to(q.dtype).transpose(0, 1)


def _decodes_one_by_one(batch: PagedBatch, index: int, cache: torch.Tensor, qg: torch.Tensor,
                        window: int | None, scale: float | None) -> torch.Tensor:
    """Decode attention of group ``index`` on CPU; ``qg``: (n, kv_heads, G, d) queries grouped by KV head.

    Each sequence attends alone over exactly its own keys (its context, or the last ``window`` of it): a view
    of the pool where its pages form one ascending run, a gather of its own pages otherwise; no padding and no
    mask. Where several sequences share leading pages (``prefix_groups``: several groups, such as two system
    prompts, each with its own sequences), each group's shared pages are read once and attended by all its
    sequences in one call (rows stacked per KV head), and each sequence attends alone only over the rest;
    the two parts are merged by their log-sum-exps as in ``_over_prefix`` (cascade attention).
    """
    g = batch.decodes[index]
    p = batch.page_size
    groups = batch.prefix_groups(index, window)
    skip = [0] * g.size
    for members, pages in groups:
        for j in members:
            skip[j] = pages
    out = torch.empty_like(qg)
    lse = qg.new_empty(qg.shape[:3], dtype=torch.float32) if groups else None
    for j, ctx in enumerate(batch.lengths(index)):
        lo = skip[j] * p if window is None else max(skip[j] * p, ctx - window)
        first = lo // p
        pages = g.table[j, first: -(-ctx // p)]
        key = ("sequence", index, j, first)
        ks = batch.read(cache[0], key, pages)[:, lo - first * p: ctx - first * p]
        vs = batch.read(cache[1], key, pages)[:, lo - first * p: ctx - first * p]
        o, l = _FLASH(qg[j:j + 1], ks[None], vs[None], scale=scale)
        out[j] = o[0]
        if groups:
            lse[j] = l[0]
    for n, (members, shared) in enumerate(groups):
        pages = g.table[members[0], :shared]
        rows = torch.tensor(members, device=qg.device)
        out[rows] = _over_shared_pages(qg[rows], batch.read(cache[0], ("shared", index, n), pages),
                                       batch.read(cache[1], ("shared", index, n), pages), out[rows], lse[rows],
                                       scale)
    return out


def _over_shared_pages(qg: torch.Tensor, k_shared: torch.Tensor, v_shared: torch.Tensor, o_rest: torch.Tensor,
                       l_rest: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Decode attention of ``n`` sequences whose leading pages are the same pages (cascade attention).

    ``qg``: (n, kv_heads, G, d) queries grouped by KV head; ``k_shared``/``v_shared``: (kv_heads, S, d) the
    shared pages' keys and values; ``o_rest`` (n, kv_heads, G, d) and ``l_rest`` (n, kv_heads, G, float32):
    each sequence's attention over its keys after the shared pages and its log-sum-exp. Every sequence's
    queries attend to the shared pages in one unmasked call (rows stacked per KV head), and the two parts are
    mixed by their log-sum-exps as in ``_over_prefix``.
    """
    n, kv_heads, group, dim = qg.shape
    stacked = qg.permute(1, 0, 2, 3).reshape(1, kv_heads, n * group, dim)
    o1, l1 = _FLASH(stacked, k_shared[None], v_shared[None], scale=scale)
    o1 = o1.view(kv_heads, n, group, dim).transpose(0, 1)
    share = torch.sigmoid(l1.view(kv_heads, n, group).transpose(0, 1) - l_rest).unsqueeze(-1)
    return torch.lerp(o_rest.float(), o1.float(), share).to(qg.dtype)


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
