"""One forward over a step's works: pack tokens, positions and embeddings, build the ``PagedBatch``, run.

Invariants:

* Works are packed grouped by pool (label), in the order given within a group, so each pool's rows are
  contiguous and are written with one ``index_copy_`` per layer.
* Positions are absolute sequence positions (names are rooted at position 0); a 3-D (M-RoPE) model gets the
  request's ``mrope_positions`` inside the prompt and ``p + mrope_delta`` on every axis after it.
* Multimodal embeddings replace the token embeddings at exactly the prompt positions they cover, in
  whichever chunk covers them; a chunk that covers part of an item takes the matching rows.
* Logits are computed only for works that reach the end of their branch's tokens; the result's row ``i``
  belongs to the ``i``-th such work in the given order.
"""

from __future__ import annotations

import numpy as np
import torch

from .adapter import CausalLMAdapter
from .attention import PagedBatch, Segment, WriteGroup
from .scheduler import Work


class ModelRunner:
    def __init__(self, adapter: CausalLMAdapter, page_size: int):
        self.adapter = adapter
        self.page_size = page_size

    def order(self, works: list[Work]) -> list[Work]:
        """Works grouped by pool, stable within a group (the packing order of ``run``)."""
        labels: dict[str, int] = {}
        for w in works:
            labels.setdefault(w.branch.label, len(labels))
        return sorted(works, key=lambda w: labels[w.branch.label])

    @torch.inference_mode()
    def run(self, works: list[Work]) -> torch.Tensor:
        """Run one forward over ``works`` (already in ``order``); returns float32 logits, one row per work
        that wants them."""
        p = self.page_size
        ids, pos, slots, segments, writes, logit_rows = [], [], [], [], [], []
        row = 0
        group_start, group_pool = 0, None
        for w in works:
            b = w.branch
            n = w.end - w.start
            positions = np.arange(w.start, w.end, dtype=np.int64)
            ids.append(np.asarray(b.tokens[w.start:w.end], dtype=np.int64))
            pos.append(positions)
            pages = w.pages.astype(np.int64, copy=False)
            kv = b.manager.pool.kv
            if group_pool is not kv:
                if group_pool is not None:
                    writes.append(self._write_group(group_pool, group_start, row, slots))
                group_pool, group_start, slots = kv, row, []
            slots.append(pages[positions // p] * p + positions % p)
            table = None if w.start == 0 else torch.from_numpy(pages[: -(-w.end // p)])
            segments.append(Segment(slice(row, row + n), w.start, w.end, kv, table))
            row += n
            if w.wants_logits:
                logit_rows.append(row - 1)
        writes.append(self._write_group(group_pool, group_start, row, slots))
        input_ids = torch.from_numpy(np.concatenate(ids))
        embeds = self.adapter.embed(input_ids)
        self._substitute(embeds, works)
        positions = self._positions(works, torch.from_numpy(np.concatenate(pos)))
        batch = PagedBatch(segments, writes, p)
        logits = self.adapter.forward(embeds, positions, torch.tensor(logit_rows, dtype=torch.long), batch)
        return logits.float()

    @staticmethod
    def _write_group(kv: torch.Tensor, start: int, stop: int, slots: list) -> WriteGroup:
        return WriteGroup(kv, slice(start, stop), torch.from_numpy(np.concatenate(slots)))

    def _substitute(self, embeds: torch.Tensor, works: list[Work]) -> None:
        row = 0
        for w in works:
            mm = w.branch.mm
            if mm is not None:
                for start, tensor in mm.embeds:
                    lo, hi = max(start, w.start), min(start + len(tensor), w.end)
                    if lo < hi:
                        embeds[row + lo - w.start: row + hi - w.start] = tensor[lo - start: hi - start].to(embeds.dtype)
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
                    out[:, row: row + cut - w.start] = mm.mrope_positions[:, w.start:cut]
                out[:, row + cut - w.start: row + n] += mm.mrope_delta
            row += n
        return out
