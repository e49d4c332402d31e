"""Token selection from logits: greedy, temperature, top-k, top-p, and classifier-free guidance.

Invariants:

* Logits are combined and filtered in float32 whatever the model dtype.
* Greedy selection is ``argmax`` (the first maximum on ties) and consumes no randomness.
* Random sampling draws from the request's own ``torch.Generator``, so a request's tokens depend on its seed
  and its logits only, never on which requests share a step.
"""

from __future__ import annotations

import torch

from .request import SamplingParams


def guided(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """Classifier-free guidance: ``uncond + scale * (cond - uncond)`` in float32."""
    cond, uncond = cond.float(), uncond.float()
    return uncond + scale * (cond - uncond)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from a 1-D row of logits."""
    logits = logits.float()
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if 0 < params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens before it already cover top_p; the first token always stays.
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        logits = logits.index_fill(0, order[drop], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))

