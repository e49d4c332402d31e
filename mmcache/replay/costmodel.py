"""How long a replayed request holds its pages: prefill of its uncached prompt tokens, then decode.

    running time = uncached prompt tokens / prefill_tps + output tokens / decode_tps

The rates are per request (a request's own prefill throughput and decode speed); requests do not slow each
other down, so the only resource they share in replay is the page pool. The defaults are nominal figures for
one GPU replica serving a mid-size model (about 10k prompt tokens/s of prefill, 20 ms per output token);
they are not measured on this project's reference engine, whose rates replace them (``--prefill-tps``,
``--decode-tps``) once measured. What they set is how many requests are in flight at once, so the shares
depend on them through concurrency; ``benchmarks/RESULTS.md`` ("Cost-model sensitivity") shows how much.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import InvalidRequest


@dataclass(frozen=True)
class CostModel:
    prefill_tps: float = 10_000.0  # uncached prompt tokens per second, per request
    decode_tps: float = 50.0  # output tokens per second, per request

    def __post_init__(self):
        for name in ("prefill_tps", "decode_tps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
                raise InvalidRequest(f"{name} must be a positive finite number, got {v!r}")

    def prefill_s(self, uncached_tokens: int) -> float:
        return uncached_tokens / self.prefill_tps

    def decode_s(self, output_tokens: int) -> float:
        return output_tokens / self.decode_tps
