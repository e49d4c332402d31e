"""The reference engine: continuous batching over a transformers model with its KV in the core's page pools.

One ``AllocationManager`` per label (``main``; ``cfg`` for classifier-free-guidance branches, created on
first use), each with its own pool tensor and prefix index. A step asks the scheduler for works, runs one
forward, commits what was written, samples where every branch of a request has logits, and finishes
requests. Invariants:

* Every request added ends with exactly one finished event carrying its ``RequestOutput``; bad input ends it
  at once with a typed error (``finish_reason == "error"``) and touches no pool.
* A finished request's pages go back through ``teardown`` (mode ``on`` stores its full pages); a failed one
  through ``abort``. Its ``MultimodalInput.release`` runs once when it ends (also when refused at intake);
  preemption does not end a request. After any sequence of steps, aborts and failures, ``check_invariants``
  holds: every page is free, owned by the index, or held by a live admitted request.
* An exception raised inside a forward fails exactly the requests of that forward (``ForwardError``, cause
  attached); their pages return and the other requests go on. An error in an output holds no frames
  (``errors.without_frames``): a failed call's activations, images or the engine itself are not kept alive
  by an output the caller keeps.
* A KV pool in host memory larger than the process can still take (``memory.available_bytes``) is refused
  with ``EngineConfigError`` before the model is set up; the CFG pool, made on first use, fails the request
  that needed it with that error instead.
* The engine is single-threaded by design; ``step``, ``abort`` and ``add_request`` serialise on one lock
  (``add_request`` validates and names a prompt before taking it), so ``abort`` and ``add_request`` may be
  called from another thread or between streamed events, and every event they cause reaches ``step``.
* No request leaves in the middle of a change to the engine's state. An abort that re-enters on the thread
  already inside one (a stream finalised by the garbage collector during a forward, a model hook, a release
  callback) is queued and applied when the outermost change ends: for a step, after its commits and samples
  and before ``step`` returns its events, so the abort event reaches that same ``step``. Such an ``abort``
  returns True; the request still ends ``"eos"``/``"length"``/... instead if it finishes in that step.
* A stream that is closed (or collected) aborts its own unfinished requests only: never a later request that
  took the id of one of them after it ended. It never waits for the engine's lock to do so: the garbage
  collector may finalise it on a thread that holds another lock (the encoder store's, inside an allocation)
  which a step running on another thread is about to take. When the lock is taken elsewhere, its aborts are
  queued (``_orphans``) and applied by whichever thread next finds the lock free: every holder looks when it
  releases it (``_locked``, ``_changing_state``), and the finaliser looks again after queueing, so none is
  left behind. A change (a step, an abort, an add) applies those queued before it at its start, so no forward
  is computed for a closed stream's request.
* A request added without an id gets ``req-N``, N counting up per engine and skipping ids live or handed out
  to a request still being added; a caller adding such an id meanwhile gets ``DuplicateRequest``, as for a
  live one, so two requests never share an id.
* Decoding an output's text never prevents its finished event: a tokenizer whose ``decode`` raises leaves
  ``text`` None and logs why.
"""

from __future__ import annotations

import logging
import traceback
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch

from ..errors import DuplicateRequest, InvalidRequest, MmcacheError
from ..manager import AllocationManager, CacheConfig
from ..names import Fingerprint
from ..pool import KVSpec
from . import kernels, memory, native
from .adapter import adapter_for
from .attention import ATTENTION_BACKEND
from .config import EngineConfig, EngineConfigError
from .models import build_model, load_model, model_digest
from .request import MultimodalInput, Request, RequestOutput, SamplingParams, StreamEvent
from .intake import Intake
from .runner import ModelRunner
from .sampling import greedy_picks, guided, sample
from .scheduler import Scheduler, SchedulerLimits
from .sequence import CFG, MAIN, LiveRequest


_log = logging.getLogger("mmcache.engine")
_SETTING_UP = threading.Lock()
"""Held while an engine sets up its model (routes its attention, claims or replaces its modules, names its
compute path), so engines built at once on one model object from several threads neither both replace the
modules nor one name its backend from a half-replaced model. Building an engine is rare; serving never takes it."""
PACKING_HEADROOM = 0.9  # pack only when the packed copy and the KV pool fit in this share of available memory
# The chunk kernel's two ways differ in the last bits (their sums run in other orders), so each names the backend.
_CHUNK_SUFFIX = {native.CHUNK_TILES: "+native-chunk", native.CHUNK_VECTOR: "+native-chunk-vector",
                 native.CHUNK_NONE: ""}


def _packing_room(need: int, pool: int) -> str | None:
    """None when the packed copy of the linears (``need`` bytes) and the KV pool fit in available memory with
    headroom (or memory cannot be read); otherwise the reason not to pack."""
    have = memory.available_bytes()
    if have is None or need + pool <= PACKING_HEADROOM * have:
        return None
    return (f"the packed copy needs {_size(need)} and the KV pool {_size(pool)}, but only {_size(have)} is "
            f"available; decodes and short prefills run slower on plain linears "
            f"(EngineConfig(packed_linears=False) asks for this and silences the warning)")


def _size(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


class ForwardError(MmcacheError, RuntimeError):
    """The model's forward raised; every request of that forward ends with this error (cause attached, without
    its frames: ``cause_traceback`` holds them formatted)."""

    def __init__(self, message: str, cause: BaseException | None = None):
        super().__init__(message)
        self.cause_traceback = "" if cause is None else "".join(
            traceback.format_exception(type(cause), cause, cause.__traceback__))
        self.__cause__ = cause


class SamplingError(MmcacheError, RuntimeError):
    """A token could not be drawn from a request's logits (for example non-finite values); that request ends."""

    def __init__(self, message: str, request_id: object = None):
        super().__init__(f"request {request_id!r}: {message}")
        self.request_id = request_id


class Engine:
    """Serve a transformers decoder model (``model`` is taken over: its attention is routed to the paged
    backend and, on CPU, its linears are packed and its norms may run on the compiled kernel). Every engine on
    one model object computes with the same modules: one asking for other ``packed_linears`` or
    ``layer_kernels`` than the first raises ``EngineConfigError`` (give it a copy of the model).
    ``digest`` overrides the model digest of the fingerprint.

    ``generate`` / ``stream`` run a list of prompts to completion; ``add_request`` / ``step`` drive the engine
    one step at a time; ``abort``, ``metrics``, ``clear_cache`` and ``check_invariants`` complete the API.
    """

    def __init__(self, model: torch.nn.Module, tokenizer=None, config: EngineConfig | None = None,
                 digest: str | None = None):
        self.config = config = config or EngineConfig()
        self._lock = threading.RLock()
        self.model = model
        self.tokenizer = tokenizer
        with _SETTING_UP:  # see _SETTING_UP
            self.adapter = adapter_for(model)
            self.adapter.attach()
            a = self.adapter
            self.max_model_len = min(config.max_model_len or a.max_model_len, a.max_model_len)
            if config.max_model_len and config.max_model_len > a.max_model_len:
                _log.warning("max_model_len %d is more than this model serves; using %d (%s)", config.max_model_len,
                             a.max_model_len, a.max_model_len_reason)
            self.kv_dtype = a.dtype
            digest = digest or model_digest(model)  # before packing: the digest is over the model's own weights
            elem = torch.empty(0, dtype=a.dtype).element_size()
            self.page_bytes = 2 * a.num_layers * a.num_kv_heads * a.head_dim * config.page_size * elem
            self.num_pages = config.pages_for(self.page_bytes, self.max_model_len)
            self._check_pool_fits(self.num_pages, "num_pages")  # before anything is set up on the model
            # Chosen once, here (MMCACHE_NATIVE; built on first use): decodes on the compiled kernel or on ATen, and
            # (where the library can use the tile unit) bfloat16 prefill chunks on its chunk kernel; and the decoder's
            # RMSNorms and rotary embedding on its layer kernels (``norms``, ``rotary``).
            decode_kernel = native.library() if a.device.type == "cpu" else None
            packs = config.packed_linears and kernels.available(a.device, a.dtype)
            offers = (native.row_products(decode_kernel)  # the AVX2 build; or bfloat16 on the tile kernel
                      or kernels.row_kernel(decode_kernel, a.dtype, kernels.widened(a.dtype)) in kernels.TILE_LAYOUT)
            rows = decode_kernel if packs and config.row_products and offers else None
            requested = {"packed_linears": packs, "layer_kernels": config.layer_kernels and decode_kernel is not None,
                         "row_products": rows is not None}
            held = a.claim_compute_path(requested)
            #: Why the linears were left unpacked although ``packed_linears`` asked for them (not enough memory for
            #: the packed copy beside the KV pool), or None.
            self.packing_skipped = held["packing_skipped"] if held else None
            #: Why the row kernel's copies of the weights were left out although ``row_products`` asked for them
            #: (they did not fit beside the packed copy and the KV pool; the packed copy alone did), or None.
            self.row_products_skipped = held["row_products_skipped"] if held else None
            if held is None:  # the first engine on this model sets up its modules
                if requested["packed_linears"]:
                    pool = self.page_bytes * self.num_pages
                    self.packing_skipped = _packing_room(a.bytes_to_pack(rows), pool)
                    if self.packing_skipped and rows is not None and _packing_room(a.bytes_to_pack(), pool) is None:
                        self.row_products_skipped, self.packing_skipped, rows = self.packing_skipped, None, None
                        _log.warning("row kernel left out (packed linears alone fit): %s", self.row_products_skipped)
                    if self.packing_skipped is None:
                        a.pack_linears(rows)
                    else:
                        _log.warning("linears left unpacked: %s", self.packing_skipped)
                    a.record_compute_path(self.packing_skipped, self.row_products_skipped)
                if requested["layer_kernels"]:
                    a.install_layer_kernels(decode_kernel)
            if config.tune_malloc:
                kernels.tune_malloc()
            # Packed and plain linears (bfloat16 ones widened to float32 or not), and the kernels and ATen, differ
            # in the last bits, so the compute path is part of the backend's name.
            packed = "+onednn-packed" + ("-f32" if kernels.widened(a.dtype) else "") if a.num_packed_linears else ""
            tiles, vector = a.num_tile_product_linears(), a.num_tile_product_linears(native.PRODUCTS_VECTOR)
            packed += "+native-rows" if a.num_row_product_linears > tiles + vector else ""
            packed += ("+native-tile-rows" if tiles else "") + ("+native-vector-rows" if vector else "")
            self.backend = (ATTENTION_BACKEND + packed
                            + ("+native-decode" if decode_kernel is not None else "")
                            + (_CHUNK_SUFFIX[native.chunk_way(decode_kernel, a.head_dim)]
                               if a.dtype == torch.bfloat16 else "")
                            + ("+native-norm" if a.num_native_norms else ""))
            self.fingerprint = Fingerprint(model_digest=digest, kv_dtype=str(a.dtype).removeprefix("torch."),
                                           attention_backend=self.backend, page_size=config.page_size)
            #: Why ``whole_hits`` was asked for but not taken (``CausalLMAdapter.whole_hit_blocker``), or None.
            self.whole_hits_skipped = (a.whole_hit_blocker(decode_kernel, config.page_size)
                                       if config.whole_hits and config.cache_mode == "on" else None)
            #: Whether a prompt held whole in the cache is matched to its end and only its last token computed
            #: again (``EngineConfig.whole_hits``, where this model's forward allows it; see ``scheduler``).
            self.whole_hits = config.whole_hits and config.cache_mode == "on" and self.whole_hits_skipped is None
        self.managers: dict[str, AllocationManager] = {MAIN: self._new_manager(self.num_pages)}
        self.scheduler = Scheduler(SchedulerLimits(config.page_size, config.max_num_seqs, config.max_tokens_per_step,
                                                   config.prefill_chunk_tokens, config.schedule == "serial",
                                                   config.defer_shared_prefill, self.whole_hits))
        self.runner = ModelRunner(a, config.page_size, decode_kernel)
        self.eos_ids = self._eos_ids()
        self.intake = Intake(a, tokenizer, self.max_model_len, config.page_size, self.num_pages, self.eos_ids,
                             self._manager, config.seed, config.cfg_num_pages)
        self._live: dict[object, LiveRequest] = {}
        self._changing = False  # inside a change to the state (a step, an abort, an add); under the lock
        self._deferred_aborts: list[LiveRequest] = []  # aborts that re-entered a change; applied when it ends
        self._orphans: deque[LiveRequest] = deque()  # aborts of streams closed while another thread held the lock
        self._events: list[StreamEvent] = []  # events of requests added with add_request
        self._next_id = 0
        self._naming: set = set()  # automatic ids handed out whose requests are not registered yet
        # prompt_tokens: tokens of forwards at prompt positions (negative prompts included), hits excluded.
        self.counters = {"steps": 0, "forwards": 0, "forward_tokens": 0, "prompt_tokens": 0, "failed_forwards": 0,
                         "greedy_pick_failures": 0}

    # ---- construction ------------------------------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str, dtype="float32", config: EngineConfig | None = None) -> "Engine":
        model, tokenizer = build_model(name, dtype)
        return cls(model, tokenizer, config)

    @classmethod
    def from_pretrained(cls, path, dtype="bfloat16", config: EngineConfig | None = None) -> "Engine":
        model, tokenizer = load_model(path, dtype)
        return cls(model, tokenizer, config)

    def _check_pool_fits(self, num_pages: int, setting: str) -> None:
        """Refuse a KV pool in host memory larger than this process can still take: zeroing it would have the
        process killed (or swapping) instead of failing with a reason."""
        if self.adapter.device.type != "cpu":
            return
        pool, have = self.page_bytes * num_pages, memory.available_bytes()
        if have is not None and pool > have:
            raise EngineConfigError(f"a KV pool of {num_pages} pages needs {_size(pool)}, but only {_size(have)} "
                                    f"is available; ask for fewer pages ({setting})")

    def _new_manager(self, num_pages: int) -> AllocationManager:
        a = self.adapter
        spec = KVSpec(a.num_layers, a.num_kv_heads, a.head_dim, a.dtype, a.device)
        cache = CacheConfig(num_pages=num_pages, page_size=self.config.page_size, mode=self.config.cache_mode,
                            store_at=self.config.store_at)
        return AllocationManager(cache, self.fingerprint, kv_spec=spec)

    def _manager(self, label: str) -> AllocationManager:
        """The label's manager; the CFG pool is allocated on its first request."""
        with self._locked():
            if label not in self.managers:
                pages = self.config.cfg_num_pages or self.num_pages
                self._check_pool_fits(pages, "cfg_num_pages")  # fails this request with the reason, not the engine
                self.managers[label] = self._new_manager(pages)
            return self.managers[label]

    def _eos_ids(self) -> frozenset:
        ids: set[int] = set()
        sources = [getattr(self.model, "generation_config", None), self.adapter.text_config, self.model.config]
        for src in sources:
            v = getattr(src, "eos_token_id", None) if src is not None else None
            ids.update([v] if isinstance(v, int) else (v or []))
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return frozenset(ids)

    # ---- public API --------------------------------------------------------------------------------
    def generate(self, prompts: Sequence, sampling: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run ``prompts`` (text, token ids or ``Request`` objects) to completion; outputs in input order."""
        outputs: dict[object, RequestOutput] = {}
        order = []
        for ev in self._stream(prompts, _sampling_per_prompt(prompts, sampling), order):
            if ev.finished:
                outputs[ev.key] = ev.output
        return [outputs[k] for k in order]

    def stream(self, prompts: Sequence, sampling: SamplingParams | Sequence[SamplingParams] | None = None
               ) -> Iterator[StreamEvent]:
        """Like ``generate``, yielding a ``StreamEvent`` per token and one ``finished`` event per request
        (its ``output`` attached) as the steps produce them. Arguments are checked here, as ``generate`` does;
        the requests are added on the first ``next``."""
        return self._stream(prompts, _sampling_per_prompt(prompts, sampling), [])

    def add_request(self, prompt, sampling: SamplingParams | None = None, request_id=None) -> object:
        """Queue one request for ``step``; its events (including a bad-input error) come out of ``step``. A
        ``Request`` carries its own sampling and id: giving either beside one raises ``InvalidRequest``."""
        if isinstance(prompt, Request):
            if sampling is not None or request_id is not None:
                raise InvalidRequest("a Request carries its own sampling and request_id; pass them in the Request, "
                                     "not beside it", prompt.request_id)
            req = prompt
        else:
            req = Request(prompt, sampling or SamplingParams(), request_id)
        return self._add(req, self._events)[1]  # not read back from the events: another thread may step

    def step(self) -> list[StreamEvent]:
        """Run one scheduling step; returns the events of requests queued with ``add_request``."""
        with self._locked():  # an abort from another thread appends under the lock: none lands between copy and clear
            self._step()  # its deferred aborts are applied before it returns: their events are in this copy
            events = list(self._events)
            self._events.clear()  # cleared in place: live requests hold this list as their sink
        return events

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def abort(self, request_id) -> bool:
        """End a live request now (its computed full pages are stored); False if it is not live (an id that
        cannot be hashed names no request: ``add_request`` refuses those). Called on the thread of a running
        step (a model hook, a stream collected by the garbage collector), it ends the request when that step
        ends, before the step returns its events."""
        with self._locked():
            live = self._live_of(request_id)
            return live is not None and self._abort(live)

    def is_live(self, request_id) -> bool:
        """Whether a request with this id is live (added, not yet finished)."""
        with self._locked():
            return self._live_of(request_id) is not None

    def holds(self, request: Request) -> bool:
        """Whether this ``Request`` object is live here (not merely one with its id): its resources, such as
        ``mm.release``, are then the engine's to give back when it ends. Without the lock (one dict lookup):
        a stream's finaliser asks it, which must never wait for a step running on another thread."""
        live = self._live_of(request.request_id)
        return live is not None and live.request is request

    def _live_of(self, request_id) -> LiveRequest | None:
        """The live request of ``request_id``, or None (also for an id that cannot be hashed: none has one)."""
        try:
            return self._live.get(request_id)
        except TypeError:
            return None

    def metrics(self) -> dict:
        """Per label the core's ``CacheMetrics`` (plus ``shadow`` in shadow mode), and engine counters."""
        out: dict = {}
        for label, m in list(self.managers.items()):  # a copy: adding a first CFG request inserts a label
            d = m.metrics.as_dict()
            d["num_pages"] = m.pool.num_pages
            d["free_pages"] = m.pool.num_free
            d["cached_pages"] = m.index.size
            if m.shadow is not None:
                d["shadow"] = m.shadow.metrics.as_dict()
                d["shadow_failures"] = m.shadow_failures
            out[label] = d
        out["engine"] = dict(self.counters, preemptions=self.scheduler.preemptions, deferrals=self.scheduler.deferrals)
        return out

    def clear_cache(self) -> int:
        """Drop every cached page no live request holds (for cold measurements); returns how many."""
        with self._changing_state():
            return sum(m.clear_cache() for m in self.managers.values())

    def check_invariants(self) -> None:
        """The managers' invariants, and agreement between them and the engine's live requests."""
        with self._changing_state():  # reads only; but an abort re-entering mid-check must wait for its end
            for label, m in self.managers.items():
                m.check_invariants()
                admitted = [lv for lv in self._live.values() if label in lv.branches and lv.branches[label].admitted]
                if m.num_requests != len(admitted):
                    raise AssertionError(f"{label}: manager holds {m.num_requests} requests, engine {len(admitted)}")
                for lv in admitted:
                    if m.state(lv.request_id).seq_len != lv.branches[label].computed:
                        raise AssertionError(f"{label}: request {lv.request_id!r} written length disagrees")

    # ---- adding ------------------------------------------------------------------------------------
    def _stream(self, prompts, sampling: list, order: list) -> Iterator[StreamEvent]:
        """Add ``prompts`` (one ``sampling`` entry each, checked by ``_sampling_per_prompt``) and yield their
        events until every one has finished."""
        sink: list[StreamEvent] = []
        pending: dict[object, LiveRequest] = {}  # key -> live state of this call's unfinished requests
        try:
            for prompt, sp in zip(prompts, sampling):
                req = prompt if isinstance(prompt, Request) else Request(prompt, sp or SamplingParams())
                key = object()
                order.append(key)
                live, _ = self._add(req, sink, key)
                if live is not None:
                    pending[key] = live
            while True:
                while sink:
                    ev = sink.pop(0)
                    if ev.finished:
                        pending.pop(ev.key, None)
                    yield ev
                if not pending:
                    return
                self._step()
        finally:
            # A consumer that stops iterating early (or an exception) must not leave requests holding pages. By
            # their live state, not their ids: one that ended unread may have given its id to a new request.
            self._abort_without_waiting(list(pending.values()))

    def _abort_without_waiting(self, lives: list[LiveRequest]) -> None:
        """Abort ``lives`` now if the lock is free or this thread's, else queue them for the change running on
        the thread that holds it (see the module docstring: a stream's finaliser must never wait for the lock)."""
        if not lives:
            return
        if not self._lock.acquire(blocking=False):
            self._orphans.extend(lives)  # deque.extend is atomic
            # The holder may have looked at the queue and released the lock between our try and our append:
            # look again. If another holder has it now, it looks when it releases it.
            self._apply_orphans_if_free()
            return
        try:
            for live in lives:
                self._abort(live)
        finally:
            self._lock.release()
        self._apply_orphans_if_free()

    @contextmanager
    def _locked(self):
        """The lock, for a read or a bookkeeping change that is not a change to the requests' state; on release,
        the aborts streams queued meanwhile are applied if the lock is free (``_apply_orphans_if_free``)."""
        with self._lock:
            yield
        self._apply_orphans_if_free()

    def _apply_orphans_if_free(self) -> None:
        """Apply the aborts queued by streams closed while another thread held the lock, if it is free now (or
        this thread's outside a change). Never waits: it runs in finalisers too. A change running on this thread
        (the lock held further out) applies them itself when it ends."""
        while self._orphans and self._lock.acquire(blocking=False):
            try:
                if self._changing:
                    return
                with self._changing_state():
                    pass  # a change applies the queued aborts at its start
            finally:
                self._lock.release()

    def _add(self, req: Request, sink: list, key: object = None) -> tuple[LiveRequest | None, object]:
        """Take ``req`` (its live state and its id), or refuse it with an error event in ``sink`` (None, its id)."""
        arrival = time.perf_counter()
        rid, named = req.request_id, req.request_id is None
        if named:
            with self._locked():  # skips ids live or being added ("req-0" is an id like any other), and holds it
                while (rid := f"req-{self._next_id}") in self._live or rid in self._naming:
                    self._next_id += 1
                self._next_id += 1
                self._naming.add(rid)
        try:
            live = self.intake.live(req, rid, arrival)
        except MmcacheError as err:
            _release_media(req)
            out = RequestOutput(rid, _safe_len(req.prompt), [], 0, "error", err, arrival, None, [])
            with self._locked():  # step copies and clears the event list under it
                if named:
                    self._naming.discard(rid)
                sink.append(StreamEvent(rid, None, time.perf_counter(), True, "error", out, key))
            return None, rid
        except BaseException:
            if named:
                with self._locked():
                    self._naming.discard(rid)
            raise
        live.sink, live.key = sink, key
        with self._changing_state():
            if named:
                self._naming.discard(rid)
            if rid in self._live or (not named and rid in self._naming):
                err = DuplicateRequest(rid)
                _release_media(req)
                out = RequestOutput(rid, live.prompt_len, [], 0, "error", err, arrival, None, [])
                sink.append(StreamEvent(rid, None, time.perf_counter(), True, "error", out, key))
                return None, rid
            self._live[rid] = live
            self.scheduler.add(live)
        return live, rid

    # ---- stepping ----------------------------------------------------------------------------------
    @contextmanager
    def _changing_state(self):
        """Hold the lock for a change to the engine's state. An abort that re-enters on this thread meanwhile
        (the lock is an RLock: a stream finalised by the garbage collector inside a forward, a model hook, a
        release callback) is queued by ``_abort`` and applied here when the outermost change ends, so a request
        never leaves between a forward and its commit, nor in the middle of a scheduler or pool update. The
        aborts of streams closed on other threads (``_orphans``) are applied at its start and its end, and looked
        for again once the lock is released (``_apply_orphans_if_free``)."""
        with self._lock:
            if self._changing:
                yield
                return
            self._changing = True
            failure = None
            try:
                failure = self._end_queued(failure)  # streams closed meanwhile: before this change's work
                yield
            finally:
                try:
                    failure = self._end_queued(failure)  # an abort applied here may itself queue more
                finally:
                    self._changing = False
                if failure is not None:
                    raise failure
        self._apply_orphans_if_free()

    def _end_queued(self, failure: Exception | None) -> Exception | None:
        """Abort every queued request still live (this thread's deferred aborts, then other threads' closed
        streams); the others are still ended when one fails, and the first failure is returned."""
        while self._deferred_aborts or self._orphans:
            live = self._deferred_aborts.pop(0) if self._deferred_aborts else self._orphans.popleft()
            try:
                if self._is_live(live):
                    self._finish(live, "abort", None, store=True)
            except Exception as e:
                failure = failure or e
        return failure

    def _abort(self, live: LiveRequest) -> bool:
        """End ``live`` as aborted if it is still the live request of its id (now, or when the change to the
        state running on this thread ends); False if it is not."""
        with self._locked():
            if not self._is_live(live):
                return False
            if self._changing:  # this thread's change: another thread's would hold the lock
                self._deferred_aborts.append(live)
                return True
            with self._changing_state():
                if self._is_live(live):  # the change's start may have ended it (a stream closed elsewhere)
                    self._finish(live, "abort", None, store=True)
            return True

    def _is_live(self, live: LiveRequest) -> bool:
        return self._live.get(live.request_id) is live

    def _step(self) -> None:
        with self._changing_state():  # aborts re-entering during the step are applied when it ends
            self.counters["steps"] += 1
            plan = self.scheduler.schedule()
            for live, err in plan.failed:
                self._finish(live, "error", err, store=False)
            if not plan.works:
                if self.scheduler.num_unfinished and not (plan.preempted or plan.failed):
                    self._fail_stuck()
                return
            works = self.runner.order(plan.works)
            self.counters["forwards"] += 1
            self.counters["forward_tokens"] += sum(w.end - w.start for w in works)
            self.counters["prompt_tokens"] += sum(max(0, min(w.end, w.branch.prompt_len) - w.start) for w in works)
            try:
                logits = self.runner.run(works)
            except Exception as cause:  # any failure inside the model: its requests fail, the engine goes on
                self.counters["failed_forwards"] += 1
                err = ForwardError(f"forward failed: {type(cause).__name__}: {cause}", cause)
                for live in _unique(w.live for w in works):
                    if self._is_live(live):
                        self._finish(live, "error", err, store=False)
                return
            # Aborts are deferred to the end of the step, so every work's request should still be live; one that
            # is not (ended by a path this engine does not foresee) is skipped rather than failing the others.
            row, greedy_rows = 0, {}
            for w in works:
                live_now = self._is_live(w.live)
                if live_now and w.write:  # a whole hit's last token (no write) has its KV in the matched pages
                    w.branch.manager.commit(w.live.request_id, w.branch.tokens[w.start:w.end])
                    w.branch.computed = w.end
                if w.wants_logits:
                    if live_now:
                        w.branch.logits = logits[row]
                        if w.live.sampling.greedy and CFG not in w.live.branches:
                            greedy_rows[id(w.live)] = row
                    row += 1
            try:
                greedy = greedy_picks(logits, greedy_rows)
            except Exception:  # each request then samples its own row, and a failure there ends that request only
                self.counters["greedy_pick_failures"] += 1
                _log.warning("picking a step's greedy tokens together raised; each request samples its own row",
                             exc_info=True)
                greedy = {}
            for live in _unique(w.live for w in works):
                if self._is_live(live) and all(b.logits is not None for b in live.branches.values()):
                    self._emit_token(live, greedy.get(id(live)))

    def _fail_stuck(self) -> None:
        """Nothing could be scheduled although requests wait: the budget or pool can never fit them."""
        for live in list(self.scheduler.waiting) + list(self.scheduler.running):
            self._finish(live, "error", InvalidRequest("request cannot be scheduled with this engine's limits",
                                                       live.request_id), store=False)

    def _emit_token(self, live: LiveRequest, greedy: int | None = None) -> None:
        """Sample ``live``'s next token (``greedy``: already picked from this step's logits) and emit it."""
        try:
            row = live.branches[MAIN].logits
            if CFG in live.branches:
                row = guided(row, live.branches[CFG].logits, live.request.guidance_scale)
            token = sample(row, live.sampling, live.generator) if greedy is None else greedy
        except Exception as cause:  # e.g. non-finite logits under random sampling: this request ends, not the step
            err = SamplingError(f"sampling failed: {cause}", live.request_id)
            err.__cause__ = cause
            self._finish(live, "error", err, store=False)
            return
        now = time.perf_counter()
        for b in live.branches.values():
            b.tokens.append(token)
            b.logits = None
        live.output_ids.append(token)
        live.token_times.append(now)
        if live.first_token_time is None:
            live.first_token_time = now
        self._emit(live, StreamEvent(live.request_id, token, now, False, None, None, live.key))
        reason = None
        if token in live.eos_ids:
            reason = "eos"
        elif token in live.sampling.stop_token_ids:
            reason = "stop"
        elif len(live.output_ids) >= live.sampling.max_tokens:
            reason = "length"
        elif any(len(b.tokens) >= live.max_len for b in live.branches.values()):
            reason = "length"
        if reason is not None:
            self._finish(live, reason, None, store=True)

    def _finish(self, live: LiveRequest, reason: str, error: MmcacheError | None, store: bool) -> None:
        self.scheduler.remove(live)
        Scheduler.release(live, store)
        _release_media(live.request)
        live.finish_reason, live.error = reason, error
        self._live.pop(live.request_id, None)
        text = None
        if self.tokenizer is not None and live.output_ids:
            try:
                text = self.tokenizer.decode(live.output_ids)
            except Exception:  # the request has left the pools: it must still get its finished event
                _log.warning("decoding the output of request %r raised; its text is None", live.request_id,
                             exc_info=True)
        out = live.output(text)
        self._emit(live, StreamEvent(live.request_id, None, time.perf_counter(), True, reason, out, live.key))

    @staticmethod
    def _emit(live: LiveRequest, event: StreamEvent) -> None:
        live.sink.append(event)


def _sampling_per_prompt(prompts, sampling) -> list:
    """``sampling`` as one entry per prompt; raises TypeError / ValueError for arguments of the wrong shape."""
    if (prompts is None or isinstance(prompts, (str, bytes, Request, Mapping)) or not hasattr(prompts, "__len__")
            or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int))):
        raise TypeError(f"prompts must be a list of prompts (text, token ids or Request), got "
                        f"{type(prompts).__name__}")
    if sampling is None or isinstance(sampling, SamplingParams):
        return [sampling] * len(prompts)
    if isinstance(sampling, (str, bytes, Mapping)) or not hasattr(sampling, "__len__"):
        raise TypeError(f"sampling must be a SamplingParams, a list of them (one per prompt) or None, got "
                        f"{type(sampling).__name__}")
    if len(sampling) != len(prompts):
        raise ValueError(f"{len(sampling)} sampling params for {len(prompts)} prompts")
    return list(sampling)


def _release_media(req: Request) -> None:
    """End-of-request callback of the request's multimodal input (store leases); the caller calls it once."""
    mm = req.mm
    if isinstance(mm, MultimodalInput) and callable(mm.release):
        try:
            mm.release()
        except Exception:  # the callback must not raise; if it does, the request still ends and is reported
            _log.exception("the release callback of request %r raised", req.request_id)


def _unique(items) -> list:
    seen, out = set(), []
    for x in items:
        if id(x) not in seen:
            seen.add(id(x))
            out.append(x)
    return out


def _safe_len(prompt) -> int:
    try:
        return len(prompt) if not isinstance(prompt, str) else 0
    except TypeError:
        return 0
