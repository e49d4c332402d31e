"""Qwen2-VL's 3-D rotary positions (M-RoPE) for a prompt with image placeholder runs.

Rule (the one ``Qwen2VLModel.get_rope_index`` implements; tests compare the two):

* A text token gets the same position ``c`` on the temporal, height and width axes, and ``c`` advances by one.
* An image whose merged grid is ``(t, h, w)`` (patches divided by the spatial merge size) occupies ``t*h*w``
  placeholder tokens in ``(t, h, w)`` raster order; the token at grid cell ``(i, j, k)`` gets positions
  ``(c + i, c + j, c + k)``, where ``c`` is the position the next text token would have had. Afterwards
  ``c`` advances by ``max(h, w)``.
* ``delta = max position + 1 - prompt length``: a token at sequence position ``p >= prompt length`` (generated)
  gets position ``p + delta`` on all three axes, which continues the text numbering after the prompt.

Positions depend only on the prompt's token count and its image runs, so a prompt that extends another (the
next chat turn) has positions that extend the other's: equal prefixes get equal positions.
"""

from __future__ import annotations

from typing import Sequence

import torch

from mmcache.errors import InvalidRequest


def mrope_positions(length: int, runs: Sequence[tuple[int, tuple[int, int, int]]]) -> tuple[torch.Tensor, int]:
    """``(LongTensor[3, length], delta)`` for a prompt of ``length`` tokens whose image runs are
    ``(start position, merged grid (t, h, w))``, in any order; runs must not overlap or pass the end."""
    positions = torch.empty(3, length, dtype=torch.long)
    next_pos = 0  # the position the next text token gets
    cursor = 0  # the next sequence index not yet assigned
    for start, (t, h, w) in sorted(runs):
        n = t * h * w
        if n <= 0 or start < cursor or start + n > length:
            raise InvalidRequest(f"image run at {start} with grid {(t, h, w)} overlaps another run or passes the "
                                 f"prompt end {length}")
        positions[:, cursor:start] = torch.arange(next_pos, next_pos + start - cursor)
        next_pos += start - cursor
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
        positions[:, start:start + n] = grid.reshape(3, n) + next_pos
        next_pos += max(h, w)
        cursor = start + n
    positions[:, cursor:] = torch.arange(next_pos, next_pos + length - cursor)
    delta = int(positions.max()) + 1 - length if length else 0
    return positions, delta


def continuation_positions(start: int, count: int, delta: int) -> torch.Tensor:
    """``LongTensor[3, count]`` for sequence positions ``start .. start+count-1`` past the prompt (generated)."""
    return (torch.arange(start, start + count, dtype=torch.long) + delta).expand(3, count).clone()
