"""The tensor-parallel agreement on one matched length (the RFC's phase 4a).

Under tensor parallelism every rank holds its own page pool and prefix index (its slice of the KV heads, under a
fingerprint that names the slice), and every rank must run the step rank 0 planned. A rank's index can hold less
than rank 0's (a page evicted on one rank only), so a match is used only after the group agrees on it: at an
admission each rank matches on its own index, the group takes the minimum of the matched page counts, and each
rank seeds exactly that many pages. ``AllocationManager(agreement=...)`` calls the agreement between its lookup
and counting any page, so a rank that matched more never takes an owner count it would have to give back.

Invariants:

* ``GroupMinimum(k)`` returns the same value on every rank of the group, and it is at most ``k`` on each: one
  all-reduce (MIN) over one 64-bit integer, on the group's backend (gloo on CPU, NCCL where the pools are on CUDA).
* Every rank calls it once for every admission, in the same order (rank 0 announces each admission before its
  own call: ``announce``); a rank that does not answer within the group's timeout, or dies, makes the call raise
  ``GroupFailed`` on the others, never hang past the timeout.
* ``calls`` and ``seconds`` count the agreements and the time spent in them on this rank (the announcement
  included); ``reduce_seconds`` the all-reduce alone, which is all the agreement adds where the matched length
  travels with a message the step sends anyway; ``summary()`` adds their medians over the last ``RECENT`` calls
  (a busy machine's scheduling makes the mean a poor summary).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Callable

import torch

from .errors import GroupFailed

RECENT = 1024  # calls whose durations ``summary`` takes the medians of


class GroupMinimum:
    """``agreement(k) -> the group's minimum of k``; ``group`` is a ``torch.distributed`` process group (None: the
    default group); ``announce(k)`` runs first: on the rank that leads the step it sends the admission it matched
    ``k`` pages for, so that the other ranks join the same all-reduce (another rank may note its arrival)."""

    def __init__(self, group=None, announce: Callable[[int], None] | None = None, device="cpu"):
        self.group = group
        self.announce = announce
        self.device = torch.device(device)
        self.calls = 0
        self.seconds = 0.0
        self.reduce_seconds = 0.0
        self._recent: deque = deque(maxlen=RECENT)  # (seconds, all-reduce seconds) of the latest calls

    def __call__(self, k: int) -> int:
        import torch.distributed as dist

        start = reducing = time.perf_counter()
        try:
            if self.announce is not None:
                self.announce(k)
            reducing = time.perf_counter()
            value = torch.tensor([k], dtype=torch.int64, device=self.device)
            dist.all_reduce(value, op=dist.ReduceOp.MIN, group=self.group)
            agreed = int(value.item())
            self.reduce_seconds += time.perf_counter() - reducing
        except GroupFailed:
            raise
        except Exception as e:  # gloo and NCCL raise RuntimeError (DistBackendError, timeouts) for a lost rank
            raise GroupFailed(f"the tensor-parallel group did not agree on a matched length: "
                              f"{type(e).__name__}: {e}") from e
        finally:
            end = time.perf_counter()
            self.calls += 1
            self.seconds += end - start
            self._recent.append((end - start, end - reducing))
        return agreed

    def summary(self) -> dict:
        """Calls, total seconds (``seconds``, ``reduce_seconds``) and the medians of the latest calls in ms."""
        recent = list(self._recent)
        return {"calls": self.calls, "seconds": self.seconds, "reduce_seconds": self.reduce_seconds,
                "median_ms": 1e3 * statistics.median(r[0] for r in recent) if recent else None,
                "median_reduce_ms": 1e3 * statistics.median(r[1] for r in recent) if recent else None}
