"""The VLM front end, a host that composes the reference engine with the encoders: chat messages with images,
or token ids plus images, served by an ``Engine`` whose model is a transformers VLM (LLaVA, Qwen2-VL).

``VLMEngine`` pairs the engine with a ``PromptBuilder`` (``encoders.chat``). For each request the builder
encodes the images through the encoder-output store (the vision tower runs only on store misses), expands
each image's placeholder run and returns the media items, the features to substitute and, for Qwen2-VL, the
3-D rotary positions. The engine names pages with the media digests (equal ids with another image share no
page past the image's first placeholder), seeds from the prefix index, substitutes the features at the
placeholders in whichever prefill chunk covers them and runs the language model over its page pools. A chat's
next turn carries the previous answer's ``token_ids`` (``answer_message``), so it extends the previous prompt
and reuses its pages, and its earlier images are store hits.

``mmcache.presets.vlm_from_preset`` builds one over an embedded preset. Neither the engine, the core nor
``encoders`` imports this module.

Invariants:

* A request holds one store lease per distinct image from the moment it is built until it ends; the engine's
  end-of-request callback (``MultimodalInput.release``) releases them once, however the request ends
  (finished, aborted, refused at intake, failed in a forward, abandoned stream). Preemption keeps them: the
  request recomputes from its features after re-admission. ``check_invariants`` verifies that each store
  entry's hold count equals the number of live requests holding it.
* A request whose messages are malformed or whose images cannot be read or decoded ends at once with the
  typed error (``InvalidRequest``, ``MediaDecodeError``) in its output and holds no page and no store entry;
  the other requests of the call are unaffected. So does one whose image encoding raised (the vision tower's
  forward, for example), with ``ForwardError`` and the cause attached.
* A request's sampling parameters, its image count (``ImageLimits.max_images``) and its length with every
  placeholder run expanded (``max_prompt_tokens``: the engine's ``max_model_len`` and pool, as intake counts
  them) are checked before any image is encoded: such a refusal runs no tower and adds or evicts no store entry.
* Page names and store keys both take the request's salt: different salts share neither pages nor entries.
* ``ttft`` counts from when the front end received the request, so reading and encoding images is part of it.
* Threads: as on ``Engine``, ``add_request`` and ``abort`` may be called from another thread than the one that
  steps. A prompt is built (images read and encoded through the store, which has its own lock) outside any
  lock; the front end's own state (pending build failures, lease bookkeeping, automatic ids) changes under its
  lock, which is never held while calling the engine, so every build failure reaches a ``step`` and no two
  requests get the same automatic id. ``check_invariants`` compares hold counts and is meant for a quiet
  front end (no ``add_request`` under way).
* Memory of concurrent builds: every image decode (and its preprocessing) first reserves its worst case, 32 bytes
  a pixel of its header's size, from the one decode budget of the builder's ``ImageLimits``
  (``media.DecodeBudget``). Intake threads beyond what the budget holds wait their turn rather than decode at
  once, so the threads times one image at the pixel limit need not fit in memory: the budget does.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..engine.config import EngineConfigError
from ..engine.engine import Engine, ForwardError
from ..engine.request import MultimodalInput, Request, RequestOutput, SamplingParams, StreamEvent
from ..errors import InvalidRequest, MmcacheError

if TYPE_CHECKING:
    from encoders.chat import MultimodalPrompt, PromptBuilder
    from mmcache.store import EncoderOutputStore

DEFAULT_STORE_BYTES = 256 * 2**20


@dataclass
class VLMRequest:
    """One VLM request: OpenAI-style ``messages`` (text and image parts, see ``encoders.chat``), or
    ``token_ids`` in which each image is one image token (or its expanded run), with ``images`` in order.
    Images are bytes, file paths or data URLs."""

    messages: Sequence[Mapping] | None = None
    token_ids: Sequence[int] | None = None
    images: Sequence[object] = ()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: object = None
    salt: bytes | str = b""


def answer_message(output: RequestOutput) -> dict:
    """The assistant message that continues a chat after ``output``: its tokens exactly as generated."""
    return {"role": "assistant", "token_ids": list(output.output_ids)}


class _Held:
    """A built prompt's leases, released once (the engine's callback, or the front end for a request it never
    handed over); keyed by identity so a reused request id cannot release another request's leases."""

    def __init__(self, front: "VLMEngine", prompt: "MultimodalPrompt"):
        self.front = front
        self.prompt = prompt

    def release(self) -> None:
        with self.front._lock:
            held = self.front._holding.pop(id(self), None)
        if held is not None:
            self.prompt.release()


class VLMEngine:
    """Serve a VLM: ``engine`` runs its language model, ``builder`` (whose adapter wraps the same model) builds
    prompts and encodes images through its store. ``generate`` / ``stream`` take ``VLMRequest`` lists;
    ``add_request`` / ``step`` / ``abort`` drive it step by step, as on ``Engine``."""

    def __init__(self, engine: Engine, builder: "PromptBuilder"):
        if builder.adapter.model is not engine.model:
            raise EngineConfigError("the prompt builder's vision adapter must wrap the engine's own model")
        self.engine = engine
        self.builder = builder
        self._holding: dict[int, _Held] = {}
        # Store keys requests held, for check_invariants; keys the store no longer has (evicted: no hold left to
        # check) are dropped when the set grows past twice the store's entries, so it stays bounded by the store.
        self._keys_seen: set[bytes] = set()
        self._events: list[StreamEvent] = []  # build failures of add_request, returned by the next step
        self._next_id = 0
        # guards the four above; never held while calling the engine or the store. Reentrant: the garbage
        # collector may finalise an abandoned stream inside an allocation made under it, whose abort releases
        # that request's leases (``_Held.release``) on this same thread
        self._lock = threading.RLock()

    def max_prompt_tokens(self, sampling: SamplingParams) -> int:
        """The longest prompt (placeholder runs expanded) the engine's intake accepts with ``sampling``: room
        under ``max_model_len`` for one output, and its pages (with the first output's slot unless that token
        is also the last) within the pool."""
        intake = self.engine.intake
        written = 1 if sampling.max_tokens > 1 else 0
        return min(intake.max_model_len - 1, intake.num_pages * intake.page_size - written)

    @property
    def store(self) -> "EncoderOutputStore":
        return self.builder.adapter.store

    @property
    def tower(self):
        """The vision tower module (it runs once per store miss)."""
        return self.builder.adapter.tower

    # ---- public API --------------------------------------------------------------------------------
    def generate(self, requests: Sequence[VLMRequest]) -> list[RequestOutput]:
        """Run ``requests`` to completion; outputs in input order (a request that could not be built has its
        typed error in its output)."""
        slots, built = self._build_all(requests)
        try:
            outputs = iter(self.engine.generate(built))
        finally:
            self._release_unhanded(built)
        return [slot if slot is not None else next(outputs) for slot in slots]

    def stream(self, requests: Sequence[VLMRequest]) -> Iterator[StreamEvent]:
        """Like ``Engine.stream``; requests that could not be built come first, each as one finished event."""
        slots, built = self._build_all(requests)
        try:
            for out in slots:
                if out is not None:
                    yield StreamEvent(out.request_id, None, time.perf_counter(), True, "error", out)
            yield from self.engine.stream(built)
        finally:
            self._release_unhanded(built)

    def add_request(self, request: VLMRequest) -> object:
        """Build and queue one request for ``step``; a build failure comes out of the next ``step``."""
        failed, req = self._build(request)
        if failed is not None:
            event = StreamEvent(failed.request_id, None, time.perf_counter(), True, "error", failed)
            with self._lock:  # step swaps the list under it: the failure lands in the list a step returns
                self._events.append(event)
            return failed.request_id
        try:
            return self.engine.add_request(req)
        except BaseException:
            self._release_unhanded([req])
            raise

    def step(self) -> list[StreamEvent]:
        stepped = self.engine.step()  # first: when it raises, the queued build failures stay for the next step
        with self._lock:
            events, self._events = self._events, []
        return events + stepped

    def has_unfinished(self) -> bool:
        return bool(self._events) or self.engine.has_unfinished()

    def abort(self, request_id) -> bool:
        return self.engine.abort(request_id)

    def metrics(self) -> dict:
        """The engine's metrics, the store's (``encoder``) and how many requests hold leases."""
        out = self.engine.metrics()
        out["encoder"] = self.store.metrics.as_dict()
        with self._lock:
            out["encoder"]["requests_holding"] = len(self._holding)
        return out

    def check_invariants(self) -> None:
        """The engine's and the store's invariants, and exact hold counts: every store entry a request held is
        held exactly as many times as live requests hold it (zero once they ended)."""
        self.engine.check_invariants()
        self.store.check_invariants()
        with self._lock:
            holding, keys_seen = list(self._holding.values()), set(self._keys_seen)
        want: Counter = Counter()
        for held in holding:
            for image in {id(im): im for im in held.prompt.images}.values():
                if not image.lease.bypassed:
                    want[image.key] += 1
        for key in keys_seen:
            if self.store.held(key) != want[key]:
                raise AssertionError(f"store entry {key.hex()} held {self.store.held(key)} times, by {want[key]} "
                                     f"live request(s)")
        if holding and not self.engine.has_unfinished():
            raise AssertionError(f"{len(holding)} request(s) hold leases although none is live")

    # ---- building ----------------------------------------------------------------------------------
    def _build_all(self, requests: Sequence[VLMRequest]) -> tuple[list, list[Request]]:
        """Per request its error output (``None`` when built) and the built engine requests, in order."""
        if isinstance(requests, VLMRequest) or not isinstance(requests, Sequence):
            raise TypeError("requests must be a list of VLMRequest")
        slots: list[RequestOutput | None] = []
        built: list[Request] = []
        try:
            for request in requests:
                failed, req = self._build(request)
                slots.append(failed)
                if req is not None:
                    built.append(req)
        except BaseException:
            self._release_unhanded(built)
            raise
        return slots, built

    def _build(self, request: VLMRequest) -> tuple[RequestOutput | None, Request | None]:
        """``(None, engine request holding its leases)`` or ``(error output, None)``; never both held."""
        arrival = time.perf_counter()
        rid = request.request_id if isinstance(request, VLMRequest) else None
        if rid is None:
            while True:  # skips ids live in the engine ("vlm-0" is an id a caller may choose)
                with self._lock:
                    rid = f"vlm-{self._next_id}"
                    self._next_id += 1
                # Asked outside this front's lock: a step holding the engine's lock takes it to release leases.
                if not self.engine.is_live(rid):
                    break
        try:
            prompt = self._prompt(request, rid)
        except MmcacheError as err:
            return RequestOutput(rid, 0, [], 0, "error", err, arrival, None, []), None
        except Exception as cause:  # the tower (or the tokenizer) raised: this request fails, not the call
            err = ForwardError(f"building the prompt failed: {type(cause).__name__}: {cause}", cause)
            return RequestOutput(rid, 0, [], 0, "error", err, arrival, None, []), None
        held = _Held(self, prompt)
        with self._lock:
            self._holding[id(held)] = held
            self._keys_seen.update(image.key for image in prompt.images)
            if len(self._keys_seen) > 2 * len(self.store) + 64:
                self._keys_seen = {k for k in self._keys_seen if k in self.store}
        mm = MultimodalInput(prompt.media, prompt.embeds, prompt.mrope_positions, prompt.mrope_delta, held.release)
        return None, Request(prompt.token_ids, request.sampling, rid, request.salt, mm=mm, arrival_time=arrival)

    def _prompt(self, request: VLMRequest, rid) -> "MultimodalPrompt":
        if not isinstance(request, VLMRequest):
            raise InvalidRequest(f"expected a VLMRequest, got {type(request).__name__}", rid)
        if (request.messages is None) == (request.token_ids is None):
            raise InvalidRequest("give exactly one of messages and token_ids", rid)
        if not isinstance(request.sampling, SamplingParams):
            raise InvalidRequest(f"sampling must be SamplingParams, got {type(request.sampling).__name__}", rid)
        request.sampling.validate(rid)  # here, so that a request intake would refuse encodes no image
        limit = self.max_prompt_tokens(request.sampling)
        if request.messages is not None:
            if request.images:
                raise InvalidRequest("images of a chat request go in its messages' content parts", rid)
            return self.builder.from_messages(request.messages, salt=request.salt, max_tokens=limit)
        if not isinstance(request.images, (list, tuple)):  # one bytes object or path would read as many items
            raise InvalidRequest(f"images must be a list of images, got {type(request.images).__name__}", rid)
        return self.builder.from_token_ids(request.token_ids, list(request.images), salt=request.salt,
                                           max_tokens=limit)

    def _release_unhanded(self, built: list[Request]) -> None:
        """Release the leases of built requests the engine does not hold: a no-op for those it ended, the
        release for those it never took (a stream closed early, an exception while adding). One it still holds
        (a stream collected inside a step: its abort waits for the step's end) is released when it ends."""
        for req in built:
            if not self.engine.holds(req):
                req.mm.release()
