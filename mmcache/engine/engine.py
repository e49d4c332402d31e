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
* Aborts and threads. ``step``, ``add_request`` and ``abort`` are changes to the engine's state; they
  serialise on one lock (``add_request`` validates and names a prompt before taking it), so any thread may
  call them and every event they cause reaches ``step``. Every abort goes through one thread-safe inbox,
  drained at the start and the end of every change, so a request never leaves in the middle of one (between a
  forward and its commit): it ends ``"abort"`` then, its computed full pages stored, its other pages and its
  store leases (``MultimodalInput.release``) returned, unless it finished in that change. ``abort`` from
  outside a change waits for the running one and returns with the request ended; from inside a change on
  its own thread (a model hook, a release callback, a stream collected during a forward) it returns True at
  once and the request ends when that change ends (for a step, before ``step`` returns its events: the abort
  event is in them). A stream closed or collected aborts its own unfinished requests only, never a later
  request that took one's id, and never waits for the lock (its finaliser may run on a thread holding a lock
  a step is about to take): it leaves them in the inbox and drains it only if the lock is free. Every change
  looks at the inbox again after releasing the lock, so no abort is left behind, and drains it at its start,
  so no forward is computed for a closed stream's request.
* A request added without an id gets ``req-N``, N counting up per engine and skipping ids live or handed out
  to a request still being added; a caller adding such an id meanwhile gets ``DuplicateRequest``, as for a
  live one, so two requests never share an id.
* Decoding an output's text never prevents its finished event: a tokenizer whose ``decode`` raises leaves
  ``text`` None and logs why.
* Tensor parallelism (``EngineConfig.tensor_parallel_size > 1``): the model is cut to this rank's slice
  (``tensor_parallel``) before it is set up, the fingerprint names the slice, and every pool runs under the
  group's agreement on matched lengths (``tp_group``). Rank 0's engine takes requests and plans every step;
  another rank's engine only ``follow``s it. A collective that fails ends every live request with
  ``GroupFailed``, and every later step does the same (``fatal``): the group cannot go on.
"""

from __future__ import annotations

import logging
import traceback
import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch

from ..agreement import GroupMinimum
from ..errors import DuplicateRequest, GroupFailed, InvalidRequest, MmcacheError
from ..manager import AllocationManager, CacheConfig
from ..names import Fingerprint
from ..pool import KVSpec
from ..shadow import ShadowedManager, make_manager
from ..tier import TierConfig, Tiers
from . import memory
from .adapter import adapter_for
from .compute import ComputePath
from .compute.path import size_text
from .config import EngineConfig, EngineConfigError
from .models import load_model, model_digest
from .request import MultimodalInput, Request, RequestOutput, SamplingParams, StreamEvent
from .intake import Intake
from .runner import ModelRunner
from .sampling import greedy_picks, guided, sample
from .scheduler import Scheduler, SchedulerLimits
from .sequence import CFG, MAIN, LiveRequest
from . import tensor_parallel, tp_group


_log = logging.getLogger("mmcache.engine")
READ_IN_WAIT_S = 0.05
"""How long a step with nothing to compute waits for a read-in before it returns (the caller steps again)."""
_SETTING_UP = threading.Lock()
"""Held while an engine sets up its model (routes its attention, claims or replaces its modules, names its
compute path), so engines built at once on one model object from several threads neither both replace the
modules nor one name its backend from a half-replaced model. Building an engine is rare; serving never takes it."""


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
    backend and, on CPU, its compute path is set up: ``EngineConfig.compute``, ``compute.ComputePath``). Every
    engine on one model object computes with the same modules: one asking for other ``packed_linears``,
    ``row_products`` or ``layer_kernels`` than the first raises ``ComputeConfigError`` (give it a copy of the
    model).
    ``digest`` overrides the model digest of the fingerprint.

    ``generate`` / ``stream`` run a list of prompts to completion; ``add_request`` / ``step`` drive the engine
    one step at a time; ``abort``, ``metrics``, ``clear_cache`` and ``check_invariants`` complete the API.
    """

    def __init__(self, model: torch.nn.Module, tokenizer=None, config: EngineConfig | None = None,
                 digest: str | None = None):
        self.config = config = config or EngineConfig()
        self._lock = threading.Lock()  # held by the thread inside a change to the state (see _change)
        self.model = model
        self.tokenizer = tokenizer
        #: This engine's place in a tensor-parallel group (``tp_group``), or None; rank 0 leads (``leader``).
        self.group = tp_group.join(config.tensor_parallel_size, config.tensor_parallel_timeout_s) \
            if config.tensor_parallel_size > 1 else None
        self.leader = tp_group.Leader(self.group) if self.group is not None and self.group.leads else None
        self._follower = tp_group.Follower(self, self.group) if self.group is not None and not self.leader else None
        with _SETTING_UP:  # see _SETTING_UP
            self._set_up_model(config, digest)
        a = self.adapter
        self.managers: dict[str, AllocationManager] = {MAIN: self._new_manager(MAIN, self.num_pages, self._tiers())}
        self.scheduler = Scheduler(SchedulerLimits(config.page_size, config.max_num_seqs, config.max_tokens_per_step,
                                                   config.prefill_chunk_tokens, config.schedule == "serial",
                                                   config.defer_shared_prefill, self.whole_hits,
                                                   config.mixed_prefill_tokens))
        if getattr(self.managers[MAIN], "tiers", None) is not None:  # the readiness gate (see scheduler)
            self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mmcache-read-in")
            self.scheduler.start_read_in = lambda manager, rid: self._reader.submit(manager.read_pending, rid)
        self.runner = ModelRunner(a, config.page_size, self.compute.decode_kernel)
        if self.leader is not None:
            self.runner = self.leader.runner(self.runner)
        self.eos_ids = self._eos_ids()
        self.intake = Intake(a, tokenizer, self.max_model_len, config.page_size, self.num_pages, self.eos_ids,
                             self._manager, config.seed, config.cfg_num_pages)
        self._live: dict[object, LiveRequest] = {}
        self._inbox: deque[LiveRequest] = deque()  # aborts not applied yet; any thread appends (see _change)
        self._owner: int | None = None  # the thread inside a change (holding the lock), or None
        self._events: list[StreamEvent] = []  # events of requests added with add_request
        self._next_id = 0
        self._naming: set = set()  # automatic ids handed out whose requests are not registered yet
        # prompt_tokens: tokens of forwards at prompt positions (negative prompts included), hits excluded.
        self.counters = {"steps": 0, "forwards": 0, "forward_tokens": 0, "prompt_tokens": 0, "failed_forwards": 0,
                         "greedy_pick_failures": 0}

    # ---- construction ------------------------------------------------------------------------------
    def _set_up_model(self, config: EngineConfig, digest: str | None) -> None:
        """Route the model's attention to the paged backend, size the KV pool, set up the compute path and name
        the fingerprint (under ``_SETTING_UP``)."""
        g = self.group
        head_slice = None
        if g is not None:
            if config.cache_mode == "shadow" or config.host_tier_bytes or config.disk_tier_bytes \
                    or config.preempt_tier_bytes:
                raise EngineConfigError("a tensor-parallel engine runs cache mode on or off, without a second tier")
            digest = digest or model_digest(self.model)  # the whole model's; the fingerprint adds the slice
            head_slice = tensor_parallel.shard(self.model, g.rank, g.size)
        self.adapter = a = adapter_for(self.model)
        a.attach()
        self.max_model_len = self._max_model_len(config.max_model_len)
        self.kv_dtype = a.dtype
        digest = digest or model_digest(self.model)  # before packing: the digest is over the model's own weights
        elem = torch.empty(0, dtype=a.dtype).element_size()
        self.page_bytes = 2 * a.num_layers * a.num_kv_heads * a.head_dim * config.page_size * elem
        self.num_pages = config.pages_for(self.page_bytes, self.max_model_len)
        self._check_pool_fits(self.num_pages, "num_pages")  # before anything is set up on the model
        #: What the model computes with (``compute.ComputePath``): chosen once, here; the choices that change a
        #: result's last bits are named in ``backend``, and so in the fingerprint.
        self.compute = ComputePath(a, config.compute)
        self.compute.set_up(self.page_bytes * self.num_pages)
        self.backend = self.compute.backend
        self.fingerprint = Fingerprint(model_digest=digest, kv_dtype=str(a.dtype).removeprefix("torch."),
                                       attention_backend=self.backend, page_size=config.page_size,
                                       tp_rank=g.rank if g else 0, tp_size=g.size if g else 1, head_slice=head_slice)
        if g is not None:  # after the compute path replaced what it replaces: the sums go on the modules that run
            tensor_parallel.install_reductions(self.model, g.group)
        #: Whether a prompt held whole in the cache is matched to its end and only its last token computed again
        #: (``ComputeConfig.whole_hits``, where this model's forward allows it; see ``scheduler``), and why not
        #: where it was asked for (``ComputePath.whole_hit_blocker``), or None.
        self.whole_hits, self.whole_hits_skipped = self.compute.whole_hits(config.page_size,
                                                                           config.cache_mode == "on")

    def _max_model_len(self, asked: int | None) -> int:
        a = self.adapter
        if asked and asked > a.max_model_len:
            _log.warning("max_model_len %d is more than this model serves; using %d (%s)", asked, a.max_model_len,
                         a.max_model_len_reason)
        return min(asked or a.max_model_len, a.max_model_len)

    @property
    def packing_skipped(self) -> str | None:
        """Why the linears were left unpacked although ``packed_linears`` asked for them (not enough memory for
        the packed copy beside the KV pool), or None."""
        return self.compute.packing_skipped

    @property
    def row_products_skipped(self) -> str | None:
        """Why the row kernel's copies of the weights were left out although ``row_products`` asked for them
        (they did not fit beside the packed copy and the KV pool; the packed copy alone did), or None."""
        return self.compute.row_products_skipped

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
            raise EngineConfigError(f"a KV pool of {num_pages} pages needs {size_text(pool)}, but only "
                                    f"{size_text(have)} is available; ask for fewer pages ({setting})")

    def _new_manager(self, label: str, num_pages: int, tiers: Tiers | None = None
                     ) -> AllocationManager | ShadowedManager:
        a = self.adapter
        spec = KVSpec(a.num_layers, a.num_kv_heads, a.head_dim, a.dtype, a.device)
        cache = CacheConfig(num_pages=num_pages, page_size=self.config.page_size, mode=self.config.cache_mode,
                            store_at=self.config.store_at)
        if self.group is not None:  # each rank its own pool and index; the group agrees on every match
            agreement = (self.leader.agreement(label, a.device) if self.leader
                         else GroupMinimum(self.group.group, announce=self._follower.mark, device=a.device))
            manager = AllocationManager(cache, self.fingerprint, spec, agreement=agreement)
            return self.leader.wrap(manager, label) if self.leader else manager
        if tiers is not None:
            return AllocationManager(cache, self.fingerprint, spec, tiers=tiers)
        return make_manager(cache, self.fingerprint, kv_spec=spec)

    def _tiers(self) -> Tiers | None:
        """The second tier of the main pool (``EngineConfig.host_tier_bytes``, ``disk_tier_bytes``), or None."""
        c, a = self.config, self.adapter
        tier = TierConfig(host_pages=c.host_tier_bytes // self.page_bytes,
                          disk_pages=c.disk_tier_bytes // self.page_bytes, disk_dir=c.disk_tier_dir,
                          preempt_pages=c.preempt_tier_bytes // self.page_bytes)
        if c.cache_mode != "on" or not tier.enabled:
            return None
        host = (tier.host_pages + tier.preempt_pages) * self.page_bytes
        if host and a.device.type == "cpu":
            have = memory.available_bytes()
            if have is not None and host > have:
                raise EngineConfigError(f"a host tier of {size_text(host)} does not fit in the {size_text(have)} "
                                        f"available; ask for less (host_tier_bytes, preempt_tier_bytes)")
        shape = (a.num_layers, 2, a.num_kv_heads, c.page_size, a.head_dim)
        return Tiers(tier, c.page_size, shape, a.dtype, pin=a.device.type == "cuda")

    def _manager(self, label: str) -> AllocationManager | ShadowedManager:
        """The label's manager; the CFG pool is allocated on its first request."""
        with self._change():
            if label not in self.managers:
                pages = self.config.cfg_num_pages or self.num_pages
                self._check_pool_fits(pages, "cfg_num_pages")  # fails this request with the reason, not the engine
                self.managers[label] = self._new_manager(label, pages)
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
        with self._change():  # events are appended in changes only: none lands between copy and clear
            self._step()
            failure = self._drain()  # aborts that re-entered the step: their events belong to its copy
            if failure is not None:
                raise failure
            events = list(self._events)
            self._events.clear()  # cleared in place: live requests hold this list as their sink
        return events

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def abort(self, request_id) -> bool:
        """End a live request (its computed full pages are stored); False if none is live under this id (an id
        that cannot be hashed names none: ``add_request`` refuses those). It ends at once, or, called on the
        thread of a running change (a model hook, a stream collected by the garbage collector), when that
        change ends: for a step, before the step returns its events (see the module docstring)."""
        with self._change():
            live = self._live_of(request_id)
            if live is None:
                return False
            self._inbox.append(live)  # applied at this change's end (or the running one's, on its thread)
            return True

    def is_live(self, request_id) -> bool:
        """Whether a request with this id is live (added, not yet finished)."""
        with self._change():
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
        """Per label the core's ``CacheMetrics`` (plus ``shadow`` in shadow mode), the mode the pool runs in and
        why reuse is off where a gate turned it off (``reuse_off``, else None), and engine counters."""
        out: dict = {}
        for label, m in list(self.managers.items()):  # a copy: adding a first CFG request inserts a label
            d = m.metrics.as_dict()
            d["mode"], d["reuse_off"] = m.mode, m.reuse_off
            d["num_pages"] = m.pool.num_pages
            d["free_pages"] = m.pool.num_free
            d["cached_pages"] = m.index.size
            if getattr(m, "tiers", None) is not None:
                d["tiers"] = m.tiers.metrics()
            if isinstance(m, ShadowedManager):
                d["shadow"] = m.shadow.metrics.as_dict()
                d["shadow_failures"] = m.shadow_failures
            out[label] = d
        out["engine"] = dict(self.counters, preemptions=self.scheduler.preemptions, deferrals=self.scheduler.deferrals)
        if self.leader is not None:
            agreements = [a.summary() for a in self.leader.agreements.values()]
            out["tensor_parallel"] = {"size": self.group.size, "agreements": sum(a["calls"] for a in agreements),
                                      "agreement_seconds": sum(a["seconds"] for a in agreements)}
        return out

    def clear_cache(self, demote: bool = False) -> int:
        """Drop every cached page no live request holds (for cold measurements; the tiers are emptied too);
        returns how many pool pages. ``demote`` moves them down to the main pool's tiers instead."""
        with self._change():
            return sum(m.clear_cache(demote) if getattr(m, "tiers", None) is not None else m.clear_cache()
                       for m in self.managers.values())

    def check_invariants(self) -> None:
        """The managers' invariants, and agreement between them and the engine's live requests."""
        with self._change():  # reads only; but an abort re-entering mid-check must wait for its end
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
                with self._change():
                    self._step()
        finally:
            # A consumer that stops iterating early (or an exception) must not leave requests holding pages. By
            # their live state, not their ids: one that ended unread may have given its id to a new request.
            self._abort_without_waiting(list(pending.values()))

    def _abort_without_waiting(self, lives: list[LiveRequest]) -> None:
        """Queue the aborts of ``lives`` and apply them now if the lock is free; never waits for it (a stream's
        finaliser calls it; see the module docstring)."""
        self._inbox.extend(lives)  # deque.extend is atomic
        failure = self._drain_if_free()
        if failure is not None:
            raise failure

    @contextmanager
    def _change(self):
        """Hold the engine for a change to its state: the lock, with the inbox of aborts drained at the start and
        the end, and looked at again once the lock is released (``_drain_if_free``). On the thread already inside
        a change (a hook, a callback, a finaliser) it only runs the body: that change drains what it queued. A
        failure of a drained abort is raised after the change, the other aborts still applied."""
        me = threading.get_ident()
        if self._owner == me:
            yield
            return
        failure = None
        try:
            with self._lock:
                self._owner = me
                try:
                    failure = self._drain()  # streams closed meanwhile: before this change's work
                    yield
                finally:
                    end = self._drain()  # an abort applied here may itself queue more: drained in the same loop
                    failure = failure or end
                    self._owner = None
        finally:
            late = self._drain_if_free()
        if failure or late:
            raise failure or late

    def _drain(self) -> Exception | None:
        """Inside a change: end every request in the inbox that is still live as aborted; the others still end
        when one fails, and the first failure is returned."""
        failure = None
        while self._inbox:
            live = self._inbox.popleft()
            try:
                if self._is_live(live):
                    self._finish(live, "abort", None, store=True)
            except Exception as e:
                failure = failure or e
        return failure

    def _drain_if_free(self) -> Exception | None:
        """Drain the inbox if the lock is free; never waits. The lock is not reentrant: on the thread inside a
        change this finds it taken and leaves the inbox to that change's end."""
        failure = None
        while self._inbox and self._lock.acquire(blocking=False):
            try:
                self._owner = threading.get_ident()
                drained = self._drain()
                failure = failure or drained
            finally:
                self._owner = None
                self._lock.release()
        return failure

    def _add(self, req: Request, sink: list, key: object = None) -> tuple[LiveRequest | None, object]:
        """Take ``req`` (its live state and its id), or refuse it with an error event in ``sink`` (None, its id)."""
        if self.group is not None and not self.group.leads:
            raise EngineConfigError(f"rank {self.group.rank} of a tensor-parallel group takes no requests: they go "
                                    f"to rank 0")
        arrival = time.perf_counter()
        rid, named = req.request_id, req.request_id is None
        if named:
            rid = self._new_id()
        try:
            live = self.intake.live(req, rid, arrival)
        except MmcacheError as err:
            _release_media(req)
            out = RequestOutput(rid, _safe_len(req.prompt), [], 0, "error", err, arrival, None, [])
            with self._change():  # step copies and clears the event list under it
                if named:
                    self._naming.discard(rid)
                sink.append(StreamEvent(rid, None, time.perf_counter(), True, "error", out, key))
            return None, rid
        except BaseException:
            if named:
                with self._change():
                    self._naming.discard(rid)
            raise
        live.sink, live.key = sink, key
        with self._change():
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

    def _new_id(self) -> str:
        """A fresh ``req-N`` id for a request added without one, held in ``_naming`` until it is taken or refused."""
        with self._change():  # skips ids live or being added ("req-0" is an id like any other), and holds it
            while (rid := f"req-{self._next_id}") in self._live or rid in self._naming:
                self._next_id += 1
            self._next_id += 1
            self._naming.add(rid)
        return rid

    # ---- stepping ----------------------------------------------------------------------------------
    def _is_live(self, live: LiveRequest) -> bool:
        return self._live.get(live.request_id) is live

    def _step(self) -> None:
        """One scheduling step, inside a change: aborts re-entering during it are applied when the change ends.
        In a tensor-parallel group whose collective failed, every live request fails with the group's error."""
        if self.group is not None and not self.group.leads:
            raise EngineConfigError(f"rank {self.group.rank} of a tensor-parallel group follows rank 0 (follow); "
                                    f"requests go to rank 0")
        try:
            if self.fatal is None:
                self._step_once()
        except GroupFailed as e:
            self.leader.channel.fail(str(e))
        if self.fatal is not None:
            for live in list(self._live.values()):
                self._finish(live, "error", self.fatal, store=False)

    @property
    def fatal(self) -> GroupFailed | None:
        """Why this engine cannot serve any more (its tensor-parallel group failed), or None."""
        return self.leader.broken if self.leader is not None else None

    def follow(self) -> None:
        """On a follower rank of a tensor-parallel group: replay what rank 0 does until rank 0 stops the group
        (``stop_group``); raises ``GroupFailed`` when the group fails."""
        if self.group is None or self.group.leads:
            raise EngineConfigError("follow runs on the ranks after rank 0 of a tensor-parallel group")
        self._follower.run()

    def stop_group(self) -> None:
        """On rank 0: end the followers' ``follow`` (once); nothing without a group."""
        if self.leader is not None:
            self.leader.stop()

    def _step_once(self) -> None:
        self.counters["steps"] += 1
        plan = self.scheduler.schedule()
        for live, err in plan.failed:
            self._finish(live, "error", err, store=False)
        if not plan.works:
            reading = self.scheduler.pending_read_ins()
            if reading:  # nothing else can run: wait behind the gate for a read-in (bounded), then step again
                wait(reading, timeout=READ_IN_WAIT_S, return_when=FIRST_COMPLETED)
            elif self.scheduler.num_unfinished and not (plan.preempted or plan.failed):
                self._fail_stuck()
            return
        works = self.runner.order(plan.works)
        self._count_forward(works)
        try:
            logits = self.runner.run(works)
        except GroupFailed:
            raise
        except Exception as cause:  # any failure inside the model: its requests fail, the engine goes on
            self._fail_forward(works, cause)
            return
        greedy = self._greedy_picks(logits, self._commit(works, logits))
        for live in _unique(w.live for w in works):
            if self._is_live(live) and all(b.logits is not None for b in live.branches.values()):
                self._emit_token(live, greedy.get(id(live)))

    def _count_forward(self, works: list) -> None:
        """Counts a forward over ``works``: its tokens, and those of them that are prompt tokens."""
        self.counters["forwards"] += 1
        self.counters["forward_tokens"] += sum(w.end - w.start for w in works)
        self.counters["prompt_tokens"] += sum(max(0, min(w.end, w.branch.prompt_len) - w.start) for w in works)

    def _fail_forward(self, works: list, cause: Exception) -> None:
        """Ends every still-live request of a failed forward with a ``ForwardError`` carrying ``cause``."""
        self.counters["failed_forwards"] += 1
        err = ForwardError(f"forward failed: {type(cause).__name__}: {cause}", cause)
        for live in _unique(w.live for w in works):
            if self._is_live(live):
                self._finish(live, "error", err, store=False)

    def _commit(self, works: list, logits: torch.Tensor) -> dict:
        """Commits each live work's written KV and gives its branch its row of ``logits``; returns the rows of
        greedy requests without a CFG branch, by ``id`` of the request, for ``greedy_picks``."""
        # Aborts are deferred to the end of the step, so every work's request should still be live; one that
        # is not (ended by a path this engine does not foresee) is skipped rather than failing the others.
        row, greedy_rows = 0, {}
        for w in works:
            live_now = self._is_live(w.live)
            if not live_now and w.write and self.leader is not None:  # the followers commit every written work
                raise GroupFailed(f"request {w.live.request_id!r} ended inside its forward; the followers committed "
                                  f"its work")
            if live_now and w.write:  # a whole hit's last token (no write) has its KV in the matched pages
                w.branch.manager.commit(w.live.request_id, w.branch.tokens[w.start:w.end])
                w.branch.computed = w.end
            if w.wants_logits:
                if live_now:
                    w.branch.logits = logits[row]
                    if w.live.sampling.greedy and CFG not in w.live.branches:
                        greedy_rows[id(w.live)] = row
                row += 1
        return greedy_rows

    def _greedy_picks(self, logits: torch.Tensor, greedy_rows: dict) -> dict:
        """``greedy_picks`` of the step's greedy rows, or none where that raises (each request then samples its
        own row, so a failure there ends that request only)."""
        try:
            return greedy_picks(logits, greedy_rows)
        except Exception:
            self.counters["greedy_pick_failures"] += 1
            _log.warning("picking a step's greedy tokens together raised; each request samples its own row",
                         exc_info=True)
            return {}

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
        live.timing.token_sampled(now)
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
