"""What a caller gives the engine and what it gets back: requests, sampling parameters, outputs, events.

Invariants:

* ``SamplingParams`` and ``Request`` are plain values; constructing one never raises. The engine validates a
  request when it is added (``validate``) and reports bad input as a typed error in that request's output,
  so one malformed request never takes a batch down.
* Times are ``time.perf_counter()`` stamps: ``arrival_time`` when the engine accepted the request (or the
  earlier ``Request.arrival_time`` a front end that prepared it gave), ``first_token_time`` when its first
  output token was sampled, ``token_times[i]`` when token ``i`` was.
* ``MultimodalInput.release``, when set, is called exactly once per request the engine was given, when that
  request ends, however it ends (finished, aborted, refused at intake, failed in a forward); a preempted
  request is not ended, so it keeps what ``release`` frees.
* ``finish_reason`` is one of ``FINISH_REASONS``; ``error`` is set exactly when it is ``"error"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..checks import finite_number
from ..errors import InvalidRequest, MmcacheError, without_frames
from ..names import MediaItem

FINISH_REASONS = ("length", "eos", "stop", "abort", "error")


@dataclass(frozen=True)
class SamplingParams:
    """Decoding settings of one request. ``temperature == 0`` is greedy; ``top_k <= 0`` and ``top_p == 1``
    disable those filters. ``seed`` makes random sampling reproducible per request (None: drawn from the
    engine's own seeded generator)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, request_id: object = None) -> None:
        """Raise ``InvalidRequest`` naming the first out-of-range field."""
        def bad(msg: str):
            raise InvalidRequest(f"sampling: {msg}", request_id)

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not finite_number(self.temperature) or self.temperature < 0:
            bad(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            bad(f"top_k must be an int, got {self.top_k!r}")
        if not finite_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must lie in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):
            bad(f"seed must be an int in [0, 2**63), got {self.seed!r}")
        if not isinstance(self.stop_token_ids, (list, tuple, set, frozenset)):
            bad(f"stop_token_ids must be a list of token ids, got {type(self.stop_token_ids).__name__}")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                bad(f"stop_token_ids must be non-negative ints, got {t!r}")
        if not isinstance(self.ignore_eos, bool):
            bad(f"ignore_eos must be a bool, got {self.ignore_eos!r}")


@dataclass
class MultimodalInput:
    """The multimodal part of a prompt, filled in by a VLM front end (the engine never decodes media).

    * ``media``: one ``MediaItem`` (digest, absolute position of its first placeholder token) per item; the
      allocation manager folds them into page names, so equal ids with different images never share pages.
    * ``embeds``: ``(start_position, tensor[n, hidden])`` pairs; rows replace the token embeddings at prompt
      positions ``start .. start + n - 1`` in whichever prefill chunk covers them. Each span must start at the
      position of a media item of its own (no two spans at one position; a media item needs no span), and its
      rows must be a function of that item's digest: page names hold ids and media, not embeddings.
    * ``mrope_positions``: optional ``tensor[3, prompt_len]`` of rotary positions (Qwen2-VL style). A token at
      sequence position ``p >= prompt_len`` (generated) gets position ``p + mrope_delta`` on all three axes.
      Before the first media item's position they must be the plain positions (each row ``0, 1, 2, ...``); with
      no media item, the whole prompt's must be, and ``mrope_delta`` must be 0. From the first media item on,
      they must be a function of the ids and media (as ``encoders.mrope``'s rule is), which names cannot check.
    * ``release``: optional callback that frees what backs ``embeds`` (encoder-output store leases); the
      engine calls it once when the request ends (see the module docstring). It must not raise.

    The engine refuses input that breaks one of the rules it can check with ``InvalidRequest`` at intake, for
    that request alone; ``VLMEngine``'s prompts always meet them.
    """

    media: Sequence[MediaItem] = ()
    embeds: Sequence[tuple[int, torch.Tensor]] = ()
    mrope_positions: torch.Tensor | None = None
    mrope_delta: int = 0
    release: Callable[[], None] | None = None


@dataclass
class Request:
    """One generation request. ``prompt`` is token ids or text (text needs the engine's tokenizer).

    ``negative_prompt`` with ``guidance_scale`` adds a classifier-free-guidance branch decoded in lockstep:
    logits = uncond + scale * (cond - uncond); a scale other than 1 without a negative prompt is refused.
    ``salt`` isolates the request's cached pages (equal salts share).
    ``arrival_time`` (a ``perf_counter`` stamp, not in the future) is when a front end received the request
    before preparing it (encoding its images), so that ``ttft`` counts that work; None: when the engine got it.
    """

    prompt: object
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: object = None
    salt: bytes | str = b""
    negative_prompt: object = None
    guidance_scale: float = 1.0
    mm: MultimodalInput | None = None
    arrival_time: float | None = None


@dataclass
class RequestOutput:
    request_id: object
    prompt_len: int
    output_ids: list[int]
    matched_tokens: int  # prompt tokens seeded from the cache at first admission (main label)
    finish_reason: str
    error: MmcacheError | None
    arrival_time: float
    first_token_time: float | None
    token_times: list[float]
    negative_matched_tokens: int = 0  # same for the CFG branch
    preemptions: int = 0
    text: str | None = None

    def __post_init__(self):
        if self.error is not None:  # an output must not keep the failed call's frames (and the engine) alive
            without_frames(self.error)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(frozen=True)
class StreamEvent:
    """One streamed token (``token_id``), or the end of a request (``finished``, with its ``output``)."""

    request_id: object
    token_id: int | None
    time: float
    finished: bool
    finish_reason: str | None = None
    output: RequestOutput | None = None
    key: object = field(default=None, repr=False, compare=False)  # routes the event to the call that added it
