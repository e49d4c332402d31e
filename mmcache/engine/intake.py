"""Intake: a ``Request`` becomes a ``LiveRequest`` (its branches named) or a typed error.

Invariants:

* Every check runs before any pool is touched, so a refused request leaves nothing behind; the error is an
  ``InvalidRequest`` naming the request and the first thing wrong (sampling values, empty prompt, ids outside
  the vocabulary, a prompt with no room under the model's length or larger than its label's pool (a negative
  prompt: the CFG pool's ``cfg_num_pages``; the first output's slot counted unless it is the last), malformed
  multimodal input, a non-finite guidance scale or one other than 1 without a negative prompt, text without a
  tokenizer, an arrival time in the future).
* Multimodal input is accepted only where page names can tell it apart, because names hash token ids and media
  items, nothing else: every ``embeds`` span starts at the position of a media item of its own (no two spans
  start at one position; a media item without a span is allowed, it only makes names more specific), and
  ``mrope_positions`` equal the plain text positions (``arange`` on each of the three rows) before the first
  media item's position, or over the whole prompt with ``mrope_delta == 0`` when there is no media item. A
  page whose name holds no media digest therefore always has the token embeddings and positions a text
  request with the same ids has, and could otherwise be seeded from (or seed) that request's KV.
* Page names are computed here (``Branch.prepare``), before the engine takes any lock.
* A random-sampling request without a seed gets one from the intake's own generator (seeded by the engine
  config), so an engine's outputs are reproducible run to run.
"""

from __future__ import annotations

import threading
from typing import Callable

import numpy as np
import torch

from ..checks import finite_number, unicode_text
from ..errors import InvalidRequest
from ..manager import AllocationManager
from ..names import MediaItem, as_token_array
from ..shadow import ShadowedManager
from .adapter import CausalLMAdapter
from .request import MultimodalInput, Request, SamplingParams
from .sequence import CFG, MAIN, Branch, LiveRequest, Timing


class Intake:
    def __init__(self, adapter: CausalLMAdapter, tokenizer, max_model_len: int, page_size: int, num_pages: int,
                 eos_ids: frozenset, manager: Callable[[str], AllocationManager | ShadowedManager], seed: int,
                 cfg_num_pages: int | None = None):
        self.adapter = adapter
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.page_size = page_size
        self.num_pages = num_pages
        self.cfg_num_pages = cfg_num_pages or num_pages  # the CFG branch's pool (made on first use)
        self.eos_ids = eos_ids
        self.manager = manager
        self._seeds = np.random.default_rng(seed)
        self._seeds_lock = threading.Lock()

    def live(self, req: Request, rid, arrival: float) -> LiveRequest:
        """The request's live state, or ``InvalidRequest``."""
        arrival = _checked_arrival(req, rid, arrival)
        # A prompt's pages, and the slot of its first output token's KV unless that token is also its last.
        written = 1 if req.sampling.max_tokens > 1 else 0
        ids = self._token_ids(req.prompt, rid, "prompt", self.num_pages, written)
        mm = req.mm
        media: tuple[MediaItem, ...] = ()
        if mm is not None:
            media = self._check_mm(mm, len(ids), rid)
        branches = {MAIN: Branch(MAIN, self.manager(MAIN), ids.tolist(), len(ids), req.salt, media, mm)}
        cfg = self._cfg_branch(req, rid, written)
        if cfg is not None:
            branches[CFG] = cfg
        for b in branches.values():
            b.prepare(rid)  # page names, computed before any lock is taken
        return LiveRequest(rid, req, req.sampling, branches, self._generator(req.sampling), Timing(arrival), len(ids),
                           self.max_model_len, frozenset() if req.sampling.ignore_eos else self.eos_ids)

    def _cfg_branch(self, req: Request, rid, written: int) -> Branch | None:
        """The branch of the request's negative prompt, or None without one; ``InvalidRequest`` for a guidance
        scale that is not finite, or other than 1 without a negative prompt."""
        scale = req.guidance_scale
        if not finite_number(scale):
            raise InvalidRequest(f"guidance_scale must be a finite number, got {scale!r}", rid)
        if req.negative_prompt is None and scale != 1.0:
            raise InvalidRequest(f"guidance_scale {scale!r} needs a negative_prompt (the branch it guides away "
                                 f"from); without one the request would run unguided", rid)
        if req.negative_prompt is None:
            return None
        neg = self._token_ids(req.negative_prompt, rid, "negative prompt", self.cfg_num_pages, written)
        return Branch(CFG, self.manager(CFG), neg.tolist(), len(neg), req.salt)

    def _generator(self, sampling: SamplingParams) -> torch.Generator | None:
        """The request's random generator, None for greedy sampling; seeded from the intake's own generator
        where the request gives no seed (so outputs are reproducible run to run)."""
        if sampling.greedy:
            return None
        seed = sampling.seed
        if seed is None:
            with self._seeds_lock:
                seed = int(self._seeds.integers(0, 2**63 - 1))
        return torch.Generator().manual_seed(seed)

    def _token_ids(self, prompt, rid, what: str, pool_pages: int, written: int) -> np.ndarray:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest(f"{what} is text but the engine has no tokenizer", rid)
            if not unicode_text(prompt):
                raise InvalidRequest(f"{what} is not valid Unicode text (it holds a lone surrogate)", rid)
            try:
                prompt = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            except Exception as e:  # a tokenizer that cannot take this text: this request fails, not the call
                raise InvalidRequest(f"{what} could not be tokenized: {type(e).__name__}: {e}", rid) from e
        ids = as_token_array(prompt, rid)
        if len(ids) == 0:
            raise InvalidRequest(f"empty {what}", rid)
        if int(ids.max()) >= self.adapter.vocab_size:
            raise InvalidRequest(f"{what} has ids outside the vocabulary (size {self.adapter.vocab_size})", rid)
        if len(ids) >= self.max_model_len:
            raise InvalidRequest(f"{what} of {len(ids)} tokens leaves no room under max_model_len "
                                 f"{self.max_model_len}", rid)
        pages = -(-(len(ids) + written) // self.page_size)
        if pages > pool_pages:
            raise InvalidRequest(f"{what} needs {pages} pages, its pool has {pool_pages}", rid)
        return ids

    def _check_mm(self, mm: MultimodalInput, prompt_len: int, rid) -> tuple[MediaItem, ...]:
        """The request's media items, once every part of ``mm`` a forward will read is checked."""
        # Everything a forward will read is checked here: a bad value found in a step would fail the whole
        # forward (every request in it), not this request alone.
        if not isinstance(mm, MultimodalInput):
            raise InvalidRequest(f"mm must be MultimodalInput, got {type(mm).__name__}", rid)
        if not isinstance(mm.media, (list, tuple)) or not isinstance(mm.embeds, (list, tuple)):
            raise InvalidRequest("mm.media and mm.embeds must be lists", rid)
        if mm.release is not None and not callable(mm.release):
            raise InvalidRequest(f"mm.release must be callable or None, got {type(mm.release).__name__}", rid)
        for item in mm.media:
            if not isinstance(item, MediaItem) or item.position >= prompt_len:
                raise InvalidRequest(f"media item {item!r} is not a MediaItem inside the prompt", rid)
        media_at = {int(item.position) for item in mm.media}
        self._check_embeds(mm.embeds, media_at, prompt_len, rid)
        if mm.mrope_positions is not None:
            self._check_mrope(mm, media_at, prompt_len, rid)
        return tuple(mm.media)

    def _check_embeds(self, embeds, media_at: set[int], prompt_len: int, rid) -> None:
        """``InvalidRequest`` unless every span is a (start, [n, hidden] float tensor) pair inside the prompt,
        starting at a media item's position of its own."""
        spans_at: set[int] = set()
        for pair in embeds:
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise InvalidRequest("mm.embeds must hold (start position, tensor) pairs", rid)
            start, t = pair
            if (not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[1] != self.adapter.hidden_size
                    or not t.is_floating_point()):
                raise InvalidRequest(f"embeds must be floating-point tensors [n, {self.adapter.hidden_size}]", rid)
            if isinstance(start, bool) or not isinstance(start, int) or start < 0 or start + t.shape[0] > prompt_len:
                raise InvalidRequest(f"embeds at {start!r} (+{t.shape[0]}) outside the prompt", rid)
            # Names hold media digests, not embeddings: a span no media item names would share pages with the
            # same ids under other rows (or under the token embeddings).
            if start not in media_at:
                raise InvalidRequest(f"embeds at {start} start at no media item's position; each span needs a "
                                     f"MediaItem at its start (page names are built from ids and media only)", rid)
            if start in spans_at:
                raise InvalidRequest(f"two embeds spans start at {start}; each span needs a media item of its own",
                                     rid)
            spans_at.add(start)

    def _check_mrope(self, mm: MultimodalInput, media_at: set[int], prompt_len: int, rid) -> None:
        """``InvalidRequest`` unless ``mm``'s 3-D positions and delta are well formed and equal a text request's
        wherever no media digest enters the page names (the module's invariant)."""
        if self.adapter.position_dims != 3:
            raise InvalidRequest("mrope_positions given for a model with 1-D positions", rid)
        p = mm.mrope_positions
        if (not isinstance(p, torch.Tensor) or p.is_floating_point() or p.is_complex() or p.dtype == torch.bool
                or tuple(p.shape) != (3, prompt_len)):
            raise InvalidRequest(f"mrope_positions must be an integer tensor of shape (3, {prompt_len})", rid)
        d = mm.mrope_delta
        if isinstance(d, bool) or not isinstance(d, int) or abs(d) >= 2**40:
            raise InvalidRequest(f"mrope_delta must be an int (|delta| < 2**40), got {d!r}", rid)
        # Positions are not in page names: before the first media item (whose digest enters the names) they
        # must be a text request's, and without media the whole sequence, generated tokens included, must be.
        first = min(media_at, default=prompt_len)
        if not bool((p[:, :first] == torch.arange(first, device=p.device)).all()):
            raise InvalidRequest(f"mrope_positions before the first media item (position {first}) must be the "
                                 f"plain positions 0..{first - 1} on all three rows", rid)
        if not media_at and d != 0:
            raise InvalidRequest(f"mrope_delta {d} without a media item; positions past the prompt would differ "
                                 f"from a text request's under the same page names", rid)


def _checked_arrival(req: Request, rid, arrival: float) -> float:
    """The request's arrival stamp (its own ``arrival_time`` where given, else ``arrival``), once its id and
    sampling are checked; ``InvalidRequest`` otherwise."""
    try:
        hash(rid)
    except TypeError:
        raise InvalidRequest(f"request_id must be hashable, got {type(rid).__name__}") from None
    if not isinstance(req.sampling, SamplingParams):
        raise InvalidRequest(f"sampling must be SamplingParams, got {type(req.sampling).__name__}", rid)
    req.sampling.validate(rid)
    if req.arrival_time is not None:
        if not finite_number(req.arrival_time) or req.arrival_time > arrival:
            raise InvalidRequest(f"arrival_time must be a perf_counter stamp not after now, got "
                                 f"{req.arrival_time!r}", rid)
        arrival = float(req.arrival_time)
    return arrival
