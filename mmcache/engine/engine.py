"""The reference engine: continuous batching over a transformers model with its KV in the core's page pools.

One ``AllocationManager`` per label (``main``; ``cfg`` for classifier-free-guidance branches, created on
first use), each with its own pool tensor and prefix index. A step asks the scheduler for works, runs one
forward, commits what was written, samples where every branch of a request has logits, and finishes
requests. Invariants:

* Every request added ends with exactly one finished event carrying its ``RequestOutput``; bad input ends it
  at once with a typed error (``finish_reason == "error"``) and touches no pool.
* A finished request's pages go back through ``teardown`` (mode ``on`` stores its full pages); a failed one
  through ``abort``. After any sequence of steps, aborts and failures, ``check_invariants`` holds: every
  page is free, owned by the index, or held by a live admitted request.
* An exception raised inside a forward fails exactly the requests of that forward (``ForwardError``, cause
  attached); their pages return and the other requests go on.
* The engine is single-threaded by design; ``step`` and ``abort`` serialise on one lock, so ``abort`` may
  be called from another thread or between streamed events.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from ..errors import DuplicateRequest, InvalidRequest, MmcacheError
from ..eviction import evict
from ..manager import AllocationManager, CacheConfig
from ..names import Fingerprint, MediaItem, as_token_array
from ..pool import KVSpec
from .adapter import adapter_for
from .attention import ATTENTION_BACKEND
from .config import EngineConfig
from .models import build_model, load_model, model_digest
from .request import MultimodalInput, Request, RequestOutput, SamplingParams, StreamEvent
from .runner import ModelRunner
from .sampling import guided, sample
from .scheduler import Scheduler, SchedulerLimits
from .sequence import CFG, MAIN, Branch, LiveRequest


class ForwardError(MmcacheError, RuntimeError):
    """The model's forward raised; every request of that forward ends with this error (cause attached)."""


class Engine:
    def __init__(self, model: torch.nn.Module, tokenizer=None, config: EngineConfig | None = None,
                 digest: str | None = None):
        self.config = config = config or EngineConfig()
        self.model = model
        self.tokenizer = tokenizer
        self.adapter = adapter_for(model)
        self.adapter.attach()
        a = self.adapter
        self.max_model_len = min(config.max_model_len or a.max_model_len, a.max_model_len)
        self.kv_dtype = a.dtype
        self.fingerprint = Fingerprint(model_digest=digest or model_digest(model),
                                       kv_dtype=str(a.dtype).removeprefix("torch."),
                                       attention_backend=ATTENTION_BACKEND, page_size=config.page_size)
        elem = torch.empty(0, dtype=a.dtype).element_size()
        self.page_bytes = 2 * a.num_layers * a.num_kv_heads * a.head_dim * config.page_size * elem
        self.num_pages = config.pages_for(self.page_bytes, self.max_model_len)
        self.managers: dict[str, AllocationManager] = {MAIN: self._new_manager(self.num_pages)}
        self.scheduler = Scheduler(SchedulerLimits(config.page_size, config.max_num_seqs, config.max_tokens_per_step,
                                                   config.prefill_chunk_tokens, config.schedule == "serial"))
        self.runner = ModelRunner(a, config.page_size)
        self.eos_ids = self._eos_ids()
        self._live: dict[object, LiveRequest] = {}
        self._events: list[StreamEvent] = []  # events of requests added with add_request
        self._seeds = np.random.default_rng(config.seed)
        self._next_id = 0
        self._lock = threading.RLock()
        self.counters = {"steps": 0, "forwards": 0, "forward_tokens": 0, "failed_forwards": 0, "preemptions": 0}

    # ---- construction ------------------------------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str, dtype="float32", config: EngineConfig | None = None) -> "Engine":
        model, tokenizer = build_model(name, dtype)
        return cls(model, tokenizer, config)

    @classmethod
    def from_pretrained(cls, path, dtype="bfloat16", config: EngineConfig | None = None) -> "Engine":
        model, tokenizer = load_model(path, dtype)
        return cls(model, tokenizer, config)

    def _new_manager(self, num_pages: int) -> AllocationManager:
        a = self.adapter
        spec = KVSpec(a.num_layers, a.num_kv_heads, a.head_dim, a.dtype, a.device)
        cache = CacheConfig(num_pages=num_pages, page_size=self.config.page_size, mode=self.config.cache_mode,
                            store_at=self.config.store_at)
        return AllocationManager(cache, self.fingerprint, kv_spec=spec)

    def _manager(self, label: str) -> AllocationManager:
        if label not in self.managers:
            self.managers[label] = self._new_manager(self.config.cfg_num_pages or self.num_pages)
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
        for ev in self._stream(prompts, sampling, order):
            if ev.finished:
                outputs[ev.key] = ev.output
        return [outputs[k] for k in order]

    def stream(self, prompts: Sequence, sampling: SamplingParams | Sequence[SamplingParams] | None = None
               ) -> Iterator[StreamEvent]:
        """Like ``generate``, yielding a ``StreamEvent`` per token and one ``finished`` event per request
        (its ``output`` attached) as the steps produce them."""
        yield from self._stream(prompts, sampling, [])

    def add_request(self, prompt, sampling: SamplingParams | None = None, request_id=None) -> object:
        """Queue one request for ``step``; its events (including a bad-input error) come out of ``step``."""
        req = prompt if isinstance(prompt, Request) else Request(prompt, sampling or SamplingParams(), request_id)
        return self._add(req, self._events).request_id

    def step(self) -> list[StreamEvent]:
        """Run one scheduling step; returns the events of requests queued with ``add_request``."""
        self._step()
        events, self._events = self._events, []
        return events

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def abort(self, request_id) -> bool:
        """End a live request now (its computed full pages are stored); False if it is not live."""
        with self._lock:
            live = self._live.get(request_id)
            if live is None:
                return False
            self._finish(live, "abort", None, store=True)
            return True

    def metrics(self) -> dict:
        """Per label the core's ``CacheMetrics`` (plus ``shadow`` in shadow mode), and engine counters."""
        out: dict = {}
        for label, m in self.managers.items():
            d = m.metrics.as_dict()
            d["num_pages"] = m.pool.num_pages
            d["free_pages"] = m.pool.num_free
            d["cached_pages"] = m.index.size
            if m.shadow is not None:
                d["shadow"] = m.shadow.metrics.as_dict()
                d["shadow_failures"] = m.shadow_failures
            out[label] = d
        out["engine"] = dict(self.counters, preemptions=self.scheduler.preemptions)
        return out

    def clear_cache(self) -> int:
        """Drop every cached page no live request holds (for cold measurements); returns how many."""
        freed = 0
        with self._lock:
            for m in self.managers.values():
                for mgr in (m, m.shadow):
                    if mgr is not None:
                        # The manager has no public "drop the cache" call; eviction of every evictable run under
                        # its lock is exactly that.
                        with mgr._lock:
                            freed += evict(mgr.index, mgr.pool, mgr.pool.num_pages)[0]
        return freed

    def check_invariants(self) -> None:
        """The managers' invariants, and agreement between them and the engine's live requests."""
        with self._lock:
            for label, m in self.managers.items():
                m.check_invariants()
                admitted = [lv for lv in self._live.values() if label in lv.branches and lv.branches[label].admitted]
                if m.num_requests != len(admitted):
                    raise AssertionError(f"{label}: manager holds {m.num_requests} requests, engine {len(admitted)}")
                for lv in admitted:
                    if m.state(lv.request_id).seq_len != lv.branches[label].computed:
                        raise AssertionError(f"{label}: request {lv.request_id!r} written length disagrees")

    # ---- adding ------------------------------------------------------------------------------------
    def _stream(self, prompts, sampling, order: list) -> Iterator[StreamEvent]:
        if isinstance(prompts, (str, Request)) or (isinstance(prompts, Sequence) and prompts
                                                   and isinstance(prompts[0], int)):
            raise TypeError("prompts must be a list of prompts (text, token ids or Request)")
        if sampling is None or isinstance(sampling, SamplingParams):
            sampling = [sampling] * len(prompts)
        if len(sampling) != len(prompts):
            raise ValueError(f"{len(sampling)} sampling params for {len(prompts)} prompts")
        sink: list[StreamEvent] = []
        pending = set()
        for prompt, sp in zip(prompts, sampling):
            req = prompt if isinstance(prompt, Request) else Request(prompt, sp or SamplingParams())
            key = object()
            order.append(key)
            live = self._add(req, sink, key)
            if live is not None:
                pending.add(key)
        while True:
            while sink:
                ev = sink.pop(0)
                if ev.finished:
                    pending.discard(ev.key)
                yield ev
            if not pending:
                return
            self._step()

    def _add(self, req: Request, sink: list, key: object = None) -> LiveRequest | None:
        arrival = time.perf_counter()
        rid = req.request_id
        if rid is None:
            with self._lock:
                rid = f"req-{self._next_id}"
                self._next_id += 1
        try:
            live = self._validate(req, rid, arrival)
        except MmcacheError as err:
            out = RequestOutput(rid, _safe_len(req.prompt), [], 0, "error", err, arrival, None, [])
            sink.append(StreamEvent(rid, None, time.perf_counter(), True, "error", out, key))
            return None
        live.sink, live.key = sink, key
        with self._lock:
            if rid in self._live:
                err = DuplicateRequest(rid)
                out = RequestOutput(rid, live.prompt_len, [], 0, "error", err, arrival, None, [])
                sink.append(StreamEvent(rid, None, time.perf_counter(), True, "error", out, key))
                return None
            self._live[rid] = live
            self.scheduler.add(live)
        return live

    def _validate(self, req: Request, rid, arrival: float) -> LiveRequest:
        if not isinstance(req.sampling, SamplingParams):
            raise InvalidRequest(f"sampling must be SamplingParams, got {type(req.sampling).__name__}", rid)
        req.sampling.validate(rid)
        ids = self._token_ids(req.prompt, rid, "prompt")
        mm = req.mm
        media: tuple[MediaItem, ...] = ()
        if mm is not None:
            media = self._check_mm(mm, len(ids), rid)
        branches = {MAIN: Branch(MAIN, self.managers[MAIN], ids.tolist(), len(ids), req.salt, media, mm)}
        if req.negative_prompt is not None:
            scale = req.guidance_scale
            if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
                raise InvalidRequest(f"guidance_scale must be a finite number, got {scale!r}", rid)
            neg = self._token_ids(req.negative_prompt, rid, "negative prompt")
            branches[CFG] = Branch(CFG, self._manager(CFG), neg.tolist(), len(neg), req.salt)
        for b in branches.values():
            b.prepare(rid)  # page names, computed before any lock is taken
        seed = req.sampling.seed
        generator = None
        if not req.sampling.greedy:
            if seed is None:
                seed = int(self._seeds.integers(0, 2**63 - 1))
            generator = torch.Generator().manual_seed(seed)
        return LiveRequest(rid, req, req.sampling, branches, generator, arrival, len(ids), self.max_model_len,
                           frozenset() if req.sampling.ignore_eos else self.eos_ids)

    def _token_ids(self, prompt, rid, what: str) -> np.ndarray:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest(f"{what} is text but the engine has no tokenizer", rid)
            prompt = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ids = as_token_array(prompt, rid)
        if len(ids) == 0:
            raise InvalidRequest(f"empty {what}", rid)
        if int(ids.max()) >= self.adapter.vocab_size:
            raise InvalidRequest(f"{what} has ids outside the vocabulary (size {self.adapter.vocab_size})", rid)
        if len(ids) >= self.max_model_len:
            raise InvalidRequest(f"{what} of {len(ids)} tokens leaves no room under max_model_len "
                                 f"{self.max_model_len}", rid)
        pages = -(-(len(ids) + 1) // self.config.page_size)
        if pages > self.num_pages:
            raise InvalidRequest(f"{what} needs {pages} pages, the pool has {self.num_pages}", rid)
        return ids

    def _check_mm(self, mm: MultimodalInput, prompt_len: int, rid) -> tuple[MediaItem, ...]:
        if not isinstance(mm, MultimodalInput):
            raise InvalidRequest(f"mm must be MultimodalInput, got {type(mm).__name__}", rid)
        for item in mm.media:
            if not isinstance(item, MediaItem) or item.position >= prompt_len:
                raise InvalidRequest(f"media item {item!r} is not a MediaItem inside the prompt", rid)
        for start, t in mm.embeds:
            if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[1] != self.adapter.hidden_size:
                raise InvalidRequest(f"embeds must be tensors [n, {self.adapter.hidden_size}]", rid)
            if not isinstance(start, int) or start < 0 or start + t.shape[0] > prompt_len:
                raise InvalidRequest(f"embeds at {start} (+{t.shape[0]}) outside the prompt", rid)
        if mm.mrope_positions is not None:
            if self.adapter.position_dims != 3:
                raise InvalidRequest("mrope_positions given for a model with 1-D positions", rid)
            if tuple(mm.mrope_positions.shape) != (3, prompt_len):
                raise InvalidRequest(f"mrope_positions must have shape (3, {prompt_len})", rid)
        return tuple(mm.media)

    # ---- stepping ----------------------------------------------------------------------------------
    def _step(self) -> None:
        with self._lock:
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
            try:
                logits = self.runner.run(works)
            except Exception as cause:  # any failure inside the model: its requests fail, the engine goes on
                self.counters["failed_forwards"] += 1
                err = ForwardError(f"forward failed: {type(cause).__name__}: {cause}")
                err.__cause__ = cause
                for live in _unique(w.live for w in works):
                    self._finish(live, "error", err, store=False)
                return
            row = 0
            for w in works:
                w.branch.manager.commit(w.live.request_id, w.branch.tokens[w.start:w.end])
                w.branch.computed = w.end
                if w.wants_logits:
                    w.branch.logits = logits[row]
                    row += 1
            for live in _unique(w.live for w in works):
                if all(b.logits is not None for b in live.branches.values()):
                    self._emit_token(live)

    def _fail_stuck(self) -> None:
        """Nothing could be scheduled although requests wait: the budget or pool can never fit them."""
        for live in list(self.scheduler.waiting) + list(self.scheduler.running):
            self._finish(live, "error", InvalidRequest("request cannot be scheduled with this engine's limits",
                                                       live.request_id), store=False)

    def _emit_token(self, live: LiveRequest) -> None:
        main = live.branches[MAIN]
        row = main.logits
        if CFG in live.branches:
            row = guided(row, live.branches[CFG].logits, live.request.guidance_scale)
        token = sample(row, live.sampling, live.generator)
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
        live.finish_reason, live.error = reason, error
        self._live.pop(live.request_id, None)
        text = None
        if self.tokenizer is not None and live.output_ids:
            text = self.tokenizer.decode(live.output_ids)
        out = live.output(text)
        self._emit(live, StreamEvent(live.request_id, None, time.perf_counter(), True, reason, out, live.key))

    @staticmethod
    def _emit(live: LiveRequest, event: StreamEvent) -> None:
        live.sink.append(event)


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
