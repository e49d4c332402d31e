"""Per-request state while a request lives in the engine.

A live request has one ``Branch`` per label: ``main`` (the prompt) and, for classifier-free guidance,
``cfg`` (the negative prompt). Invariants:

* ``branch.tokens`` is the branch's prompt followed by every token generated so far; both branches append the
  same sampled token, so they advance in lockstep.
* ``branch.computed`` equals the branch manager's ``seq_len`` while the branch is admitted: positions
  ``0 .. computed - 1`` have KV in the branch's pages. A decoding branch has ``computed == len(tokens) - 1``
  (the last sampled token is the next input). A branch seeded with its whole prompt (``Engine.whole_hits``)
  has ``computed == len(tokens)`` and no logits until its last token is computed again (without a write).
* ``branch.logits`` holds the branch's logits at its last token once it was computed and until the next
  token is sampled; a token is sampled when every branch holds logits.
* A preempted request is back at the head of the queue suspended (``Scheduler.suspended``): its branches stay
  admitted with ``computed == 0`` while the managers keep the pages it shares; resuming it re-seeds each branch
  from the index (then the tiers) over prompt + generated-so-far.
* ``branch.names`` are the names of the full pages of ``tokens`` as of the latest admission (from its
  ``PreparedPrompt``): while the branch is admitted, the pages from ``computed // page_size`` on are the ones
  it has yet to write, which the scheduler's deferral compares waiting requests against.
* ``timing.tokens`` holds one stamp per output token, in order (``Timing``); ``setbacks`` only count up.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import MmcacheError
from ..manager import AllocationManager, PreparedPrompt
from ..names import MediaItem
from ..shadow import ShadowedManager
from .request import MultimodalInput, Request, RequestOutput, SamplingParams

MAIN = "main"
CFG = "cfg"


@dataclass(eq=False)  # identity: a live branch equals only itself (``in`` and ``remove`` stay O(1) per item)
class Branch:
    label: str
    manager: AllocationManager | ShadowedManager
    tokens: list[int]
    prompt_len: int
    salt: bytes | str = b""
    media: tuple[MediaItem, ...] = ()
    mm: MultimodalInput | None = None
    prepared: PreparedPrompt | None = None  # names of ``tokens`` as of the next admission
    names: np.ndarray | None = None  # full-page names of ``tokens`` as of the latest admission
    admitted: bool = False
    computed: int = 0
    matched: int = 0  # tokens seeded at the latest admission
    first_matched: int | None = None  # tokens seeded at the first admission
    reading: object = None  # the future of a deferred read-in from the second tier, until it is completed
    reading_first: bool = False  # that read-in belongs to the first admission (``first_matched`` grows with it)
    logits: torch.Tensor | None = None

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.computed if self.logits is None else 0

    def prepare(self, request_id) -> None:
        """Name the branch's current tokens (outside any lock; the manager's ``prepare`` takes none)."""
        self.prepared = self.manager.prepare(np.asarray(self.tokens, dtype=np.int32), self.media, self.salt,
                                             request_id)


@dataclass
class Timing:
    """``perf_counter`` stamps of one request: when the engine accepted it (or a front end received it) and when
    each output token was sampled. ``tokens`` only grows, in order, and ``first_token`` is its first stamp."""

    arrival: float
    first_token: float | None = None
    tokens: list[float] = field(default_factory=list)

    def token_sampled(self, now: float) -> None:
        self.tokens.append(now)
        if self.first_token is None:
            self.first_token = now


@dataclass
class Setbacks:
    """What held a request back on its way: preemptions (torn down and queued again) and steps it spent
    deferred behind a running request computing the same pages (``scheduler``)."""

    preemptions: int = 0
    deferrals: int = 0


@dataclass(eq=False)  # identity, not a field-by-field comparison on every ``in`` / ``remove`` of the scheduler
class LiveRequest:
    request_id: object
    request: Request
    sampling: SamplingParams
    branches: dict[str, Branch]
    generator: torch.Generator | None
    timing: Timing
    prompt_len: int
    max_len: int  # the sequence may not grow past this many tokens (model limit)
    eos_ids: frozenset
    output_ids: list[int] = field(default_factory=list)
    setbacks: Setbacks = field(default_factory=Setbacks)
    finish_reason: str | None = None
    error: MmcacheError | None = None
    sink: list = field(default_factory=list)  # where this request's events go
    key: object = None  # identifies the request to the call that added it

    @property
    def admitted(self) -> bool:
        return any(b.admitted for b in self.branches.values())

    def output(self, text: str | None = None) -> RequestOutput:
        main = self.branches[MAIN]
        cfg = self.branches.get(CFG)
        return RequestOutput(
            request_id=self.request_id, prompt_len=self.prompt_len, output_ids=list(self.output_ids),
            matched_tokens=main.first_matched or 0, finish_reason=self.finish_reason, error=self.error,
            arrival_time=self.timing.arrival, first_token_time=self.timing.first_token,
            token_times=list(self.timing.tokens), negative_matched_tokens=(cfg.first_matched or 0) if cfg else 0,
            preemptions=self.setbacks.preemptions, text=text)
