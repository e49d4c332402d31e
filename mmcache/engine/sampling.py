"""Token selection from logits: greedy, temperature, top-k, top-p, and classifier-free guidance.

Invariants:

* Logits are combined and filtered in float32 whatever the model dtype (greedy needs no conversion).
* Greedy selection is the first maximum (``argmax``'s index on ties) and consumes no randomness; the
  engine picks a step's greedy tokens together with ``greedy_picks``, the reduction ``sample`` uses too.
* Random sampling draws one uniform number per token from the request's own ``torch.Generator`` (inverse
  CDF over the kept tokens), so a request's tokens depend on its seed and its logits only, never on which
  requests share a step.
* Top-k, then top-p within the top-k tokens' probability; the kept tokens' probabilities are renormalised.
* Logits with a NaN, or without a finite maximum, raise ``RuntimeError`` under random sampling; greedy
  selection takes the ``argmax`` as it is.
* Any temperature > 0 gives finite weights: logits are shifted by their maximum before they are divided, so
  as the temperature goes to 0 the draw goes to the maximum (ties shared evenly), never to NaN.
"""

from __future__ import annotations

import torch

from .request import SamplingParams


def guided(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """Classifier-free guidance: ``uncond + scale * (cond - uncond)`` in float32."""
    cond, uncond = cond.float(), uncond.float()
    return uncond + float(scale) * (cond - uncond)  # float(): torch refuses Python ints beyond int64


def greedy_picks(logits: torch.Tensor, rows: dict) -> dict:
    """``{key: first maximum of logits[row]}`` for ``rows = {key: row}``: greedy tokens of several rows of a
    step's logits from one row-wise reduction (~0.4 ms per separate reduction over a 150k vocabulary). The
    indices are those ``sample`` gives a greedy request (torch.max reduces ~3x faster than argmax here, with
    argmax's index)."""
    if not rows:
        return {}
    index = list(rows.values())
    every = index == list(range(len(logits)))  # all rows in order: no gathered copy
    picks = torch.max(logits if every else logits[index], dim=-1).indices.tolist()
    return dict(zip(rows, picks))


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from a 1-D row of logits."""
    if params.greedy:
        return greedy_picks(logits[None], {0: 0})[0]
    logits = logits.float()
    top = torch.max(logits)
    if not (torch.isfinite(top) and not torch.isnan(logits).any()):
        raise RuntimeError(f"cannot sample from logits with NaN or no finite maximum (max {float(top)})")
    # Shifted so the maximum is exactly 0 before scaling: a tiny temperature sends the rest to -inf (the greedy
    # limit) instead of overflowing the maximum itself to inf and every weight to NaN.
    logits = (logits - top) / float(params.temperature)
    vocab = logits.numel()
    k = params.top_k if 0 < params.top_k < vocab else vocab
    if params.top_p < 1.0:
        values, ids = _nucleus(logits, k, params.top_p)
    elif k < vocab:
        values, ids = torch.topk(logits, k)
    else:
        values, ids = logits, None
    weights = torch.exp(values - values.max())
    i = _draw(weights, generator)
    return i if ids is None else int(ids[i])


_CANDIDATES = (256, 4096)  # the nucleus search looks at this many best tokens before it bins them all
_BINS = 2048  # logit bins of the large-nucleus search


def _nucleus(logits: torch.Tensor, k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits and ids (in no particular order) of the top-``k`` tokens that top-p keeps: in descending
    order, a token is dropped when the tokens before it already cover ``top_p`` of the top-``k`` probability
    (the first token always stays; tied tokens at the boundary are ordered arbitrarily, as by any sort).

    With top-k the ``k`` best tokens come sorted from ``topk``, and the cut is read off their cumulative sum.
    Over the whole vocabulary a sort costs ~10 ms and a trained model's nucleus is usually far smaller, so the
    best 256, then 4096, tokens are tried first (``topk``, sorted). A larger nucleus (near-flat logits) is
    found by binning: the logits fall into ``_BINS`` equal-width bins, the bins' masses are summed from the
    top, and only the bin where the mass reaches ``top_p`` is sorted."""
    if k < logits.numel():
        values, ids = torch.topk(logits, k)
        return _head(values, ids, torch.logsumexp(values, dim=0), top_p)[:2]
    norm = torch.logsumexp(logits, dim=0)
    covered, tried = 0.0, 1
    for c in (c for c in _CANDIDATES if c < k):
        if covered * c / tried < top_p:  # else c tokens cannot cover top_p: each is at most the tried ones' mean
            values, ids, covered = _head(*torch.topk(logits, c), norm, top_p)
            if len(ids) < c:
                return values, ids
            tried = c
    ids = _binned_nucleus(logits, norm, top_p)
    return logits[ids], ids


def _head(values: torch.Tensor, ids: torch.Tensor, norm: torch.Tensor,
          top_p: float) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The leading tokens of ``values`` (sorted, descending) that top-p keeps, and the mass of all of them."""
    probs = torch.exp(values - norm)
    cum = torch.cumsum(probs, dim=0)
    kept = int(((cum - probs) < top_p).sum())
    return values[:kept], ids[:kept], float(cum[-1])


def _binned_nucleus(logits: torch.Tensor, norm: torch.Tensor, top_p: float) -> torch.Tensor:
    """Indices of the nucleus of ``logits`` (see ``_nucleus``) without sorting them all."""
    probs = torch.exp(logits - norm)
    lo, hi = float(logits.min()), float(logits.max())
    if lo == float("-inf"):
        lo = float(logits[logits > lo].min())
    # Bin by arithmetic (a binary search per token costs ~8 ms here): (x - lo) * scale is non-decreasing in x
    # under rounding, so a token in a higher bin always has a strictly higher logit; -inf falls into bin 0.
    if hi > lo:
        bins = ((logits - lo) * ((_BINS - 1) / (hi - lo))).clamp_(0, _BINS - 1).long()
    else:  # one distinct finite value (the rest -inf): one bin, sorted whole
        bins = torch.zeros(logits.shape, dtype=torch.long)
    mass = torch.bincount(bins, weights=probs.double(), minlength=_BINS)
    above = mass.flip(0).cumsum(0).flip(0) - mass  # mass of the bins above each bin
    # The boundary bin: the highest bin whose tokens' mass reaches top_p counting everything above it.
    reach = torch.nonzero(above + mass >= top_p)
    boundary = int(reach.max()) if len(reach) else 0
    inside = torch.nonzero(bins == boundary).flatten()
    order = inside[torch.sort(logits[inside], descending=True).indices]
    p = probs[order].double()
    kept = order[(float(above[boundary]) + torch.cumsum(p, dim=0) - p) < top_p]
    return torch.cat([torch.nonzero(bins > boundary).flatten(), kept])


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """Index ``i`` with probability ``weights[i] / weights.sum()`` (inverse CDF, one uniform draw).

    ``torch.multinomial`` draws one exponential variate per entry (~4 ms over a 150k vocabulary); this draws one
    number. Cumulative sums are in float64; a zero weight is never chosen (``right=True`` skips flat steps)."""
    cdf = weights.double().cumsum(dim=0)  # (torch.cumsum with dtype= ran 5x slower on peaked rows here)
    u = torch.rand((), dtype=torch.float64, generator=generator)
    i = int(torch.searchsorted(cdf, (u * cdf[-1]).reshape(1), right=True))
    if i == len(cdf):  # u * total rounded up to the total: the last token of positive weight
        i = int(torch.nonzero(weights)[-1])
    return i
