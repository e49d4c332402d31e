"""One forward over a step's works: pack tokens, positions and embeddings, build the ``PagedBatch``, run.

Invariants:

* Works are packed grouped by pool (label), decodes first within a pool, so each pool's rows are contiguous
  (written with one ``index_copy_`` per layer) and its decodes form one contiguous ``DecodeGroup``.
* Positions are absolute sequence positions (names are rooted at position 0); a 3-D (M-RoPE) model gets the
  request's ``mrope_positions`` inside the prompt and ``p + mrope_delta`` on every axis after it.
* Multimodal embeddings replace the token embeddings at exactly the prompt positions they cover, in
  whichever chunk covers them; a chunk that covers part of an item takes the matching rows.
* Logits are computed only for works that reach the end of their branch's tokens; the result's row ``i``
  belongs to the ``i``-th such work in the given order.
* A work with ``write`` False (a whole hit's last token) writes no KV: its rows are left out of its pool's
  ``WriteGroup`` (whose rows are then an index tensor rather than a slice), and it is attended as a prefill
  chunk over its pages, never as a decode.
"""

from __future__ import annotations

import numpy as np
import torch

from .adapter import CausalLMAdapter
from .attention import DecodeGroup, PagedBatch, Segment, WriteGroup
from .scheduler import Work


class ModelRunner:
    def __init__(self, adapter: CausalLMAdapter, page_size: int, decode_kernel=None):
        self.adapter = adapter
        self.page_size = page_size
        self.decode_kernel = decode_kernel  # ``native.library()``, or None for ATen's decode attention

    def order(self, works: list[Work]) -> list[Work]:
        """The packing order of ``run``: grouped by pool (label, in order of first appearance), decodes
        before prefill chunks within a pool, stable otherwise."""
        labels: dict[str, int] = {}
        for w in works:
            labels.setdefault(w.branch.label, len(labels))
        return sorted(works, key=lambda w: (labels[w.branch.label], not _is_decode(w)))

    @torch.inference_mode()
    def run(self, works: list[Work]) -> torch.Tensor:
        """Run one forward over ``works`` (already in ``order``); returns float32 logits, one row per work
        that wants them."""
        p = self.page_size
        ids, pos, segments, decodes, writes, logit_rows = [], [], [], [], [], []
        row = 0
        for kv, group in _by_pool(works):
            group_start, slots, tables, ctx_lens, unwritten = row, [], [], [], []
            for w in group:
                n = w.end - w.start
                positions = np.arange(w.start, w.end, dtype=np.int64)
                ids.append(np.asarray(w.branch.tokens[w.start:w.end], dtype=np.int64))
                pos.append(positions)
                pages = w.pages.astype(np.int64, copy=False)
                if w.write:
                    slots.append(pages[positions // p] * p + positions % p)
                else:
                    unwritten.append(row)  # a whole hit's last token: one row
                if _is_decode(w):
                    tables.append(pages[: -(-w.end // p)])
                    ctx_lens.append(w.end)
                else:
                    table = None if w.start == 0 else self._tensor(pages[: -(-w.end // p)])
                    segments.append(Segment(slice(row, row + n), w.start, w.end, kv, table))
                row += n
                if w.wants_logits:
                    logit_rows.append(row - 1)
            decode, write = self._pool_groups(kv, group_start, row, slots, tables, ctx_lens, unwritten)
            if decode is not None:
                decodes.append(decode)
            if write is not None:
                writes.append(write)
        return self._forward(works, ids, pos, logit_rows, PagedBatch(segments, decodes, writes, p, self.decode_kernel))

    def _forward(self, works: list[Work], ids: list, pos: list, logit_rows: list, batch: PagedBatch) -> torch.Tensor:
        """The model's float32 logits at ``logit_rows`` over the packed ``ids`` and positions ``pos`` of ``works``
        (multimodal embeddings substituted), attending through ``batch``."""
        embeds = self.adapter.embed(self._tensor(np.concatenate(ids)))
        self._substitute(embeds, works)
        positions = self._positions(works, self._tensor(np.concatenate(pos)))
        logits = self.adapter.forward(embeds, positions, self._tensor(np.asarray(logit_rows, dtype=np.int64)), batch)
        return logits.float()

    def _pool_groups(self, kv: torch.Tensor, start: int, end: int, slots: list, tables: list, ctx_lens: list,
                     unwritten: list) -> tuple[DecodeGroup | None, WriteGroup | None]:
        """The ``DecodeGroup`` of the pool's rows ``start .. end`` (None without decodes) and their ``WriteGroup``
        (None where no row writes)."""
        decode = self._decode_group(kv, start, tables, ctx_lens, self.adapter.device) if tables else None
        write = None
        if not unwritten:
            write = WriteGroup(kv, slice(start, end), self._tensor(np.concatenate(slots)))
        elif slots:  # some rows write no KV (whole hits' last tokens): the others by index
            rows = np.setdiff1d(np.arange(start, end, dtype=np.int64), unwritten)
            write = WriteGroup(kv, self._tensor(rows), self._tensor(np.concatenate(slots)))
        return decode, write

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.adapter.device)

    @staticmethod
    def _decode_group(kv: torch.Tensor, start: int, tables: list, ctx_lens: list, device) -> DecodeGroup:
        """The pool's decodes, which ``order`` placed first in its rows: rows ``start .. start + len(tables)``."""
        width = max(len(t) for t in tables)
        table = np.empty((len(tables), width), dtype=np.int64)
        for i, t in enumerate(tables):
            table[i, : len(t)] = t
            table[i, len(t):] = t[-1]  # padding re-reads the sequence's own last page; the mask hides it
        return DecodeGroup(slice(start, start + len(tables)), kv, torch.from_numpy(table).to(device),
                           torch.tensor(ctx_lens, dtype=torch.long, device=device))

    def _substitute(self, embeds: torch.Tensor, works: list[Work]) -> None:
        row = 0
        for w in works:
            mm = w.branch.mm
            if mm is not None:
                for start, tensor in mm.embeds:
                    lo, hi = max(start, w.start), min(start + len(tensor), w.end)
                    if lo < hi:
                        rows = tensor[lo - start: hi - start].to(embeds.device, embeds.dtype)
                        embeds[row + lo - w.start: row + hi - w.start] = rows
            row += w.end - w.start

    def _positions(self, works: list[Work], flat: torch.Tensor) -> torch.Tensor:
        if self.adapter.position_dims == 1:
            return flat
        out = flat.unsqueeze(0).repeat(3, 1)
        row = 0
        for w in works:
            b = w.branch
            n = w.end - w.start
            mm = b.mm
            if mm is not None and mm.mrope_positions is not None:
                cut = min(max(b.prompt_len, w.start), w.end)
                if cut > w.start:
                    out[:, row: row + cut - w.start] = mm.mrope_positions[:, w.start:cut].to(out.device)
                out[:, row + cut - w.start: row + n] += mm.mrope_delta
            row += n
        return out


def _is_decode(w: Work) -> bool:
    """A decode: one written token after others. A whole hit's last token (``write`` False) is a one-row prefill
    chunk instead, so it is attended as the chunk that wrote it was (see ``Engine.whole_hits``)."""
    return w.end - w.start == 1 and w.start > 0 and w.write


def _by_pool(works: list[Work]) -> list[tuple[torch.Tensor, list[Work]]]:
    """Consecutive works sharing a pool tensor (``order`` makes each pool's works consecutive)."""
    out: list = []
    for w in works:
        kv = w.branch.manager.pool.kv
        if out and out[-1][0] is kv:
            out[-1][1].append(w)
        else:
            out.append((kv, [w]))
    return out
