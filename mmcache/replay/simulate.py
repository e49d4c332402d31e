"""Discrete-event replay of a workload through the real allocation manager, one metadata-only pool per replica.

This is the shadow mode's code path (docs/DESIGN.md, "The RFC's phases", phase 1): each replica is an
``AllocationManager`` in mode ``on`` with ``kv_spec=None``, as the mirror a ``ShadowedManager`` holds
(``mmcache.shadow``), driven by the same calls that mirror is given (``admit`` with a ``PreparedPrompt``,
``reserve``, ``commit``, ``teardown``, ``abort``). Names, index, seeding, eviction
and the would-have-matched accounting (``AdmitResult.matched_tokens`` and ``forfeit_tokens``) are the core's;
nothing here keeps an index.

A request's life, at simulated times:

* arrival: its final sequence (prompt and output) is materialised and named once (``prepare``); the
  prompt's ``PreparedPrompt`` takes the leading names, since a chained name depends only on the pages
  before it, and the names are kept for the ceiling. The replica is chosen (rendezvous affinity through
  ``ReplicaRouter``, whose load per replica is its requests running or waiting, with its draws seeded
  by ``seed``; or a seeded uniform draw for ``random``), and it joins that replica's FIFO queue. A request
  whose final sequence needs more pages than the pool has can never run there: it is rejected and counted,
  and scores no hit.
* admission, when it is at the head of the queue: ``admit`` seeds it from the index, ``reserve`` takes pages
  for the rest of its final sequence at once (a scheduler reserving ``max_tokens``, so nothing is preempted
  later), and ``commit`` writes its uncached prompt. When ``reserve`` raises ``AllocationFailed`` the pool
  is full of live requests (the manager evicted every cached page it could first), so the request is
  aborted with ``requeue=True``, which gives back what seeding took and takes its lookup back out of the
  manager's metrics (a request is counted once, at the admission that ran), and waits at the head of the
  queue until a request of that replica ends. A queue wait is counted apart from stalls caused by cached data
  (``alloc_failures_cache_held``), which must stay 0; if a replica with nothing running cannot admit its
  head, only cached data can be in the way and ``ReplayStalled`` is raised rather than waiting forever.
* end, ``CostModel`` seconds later: ``commit`` of the output ids, then ``teardown`` stores every full page.

With ``host_tier_tokens`` each replica's manager has a metadata-only host tier (``mmcache.tier``): evicted
cold tails move there and an admission that walks on into it is seeded from it, at no simulated cost, so the
shares show what a second tier of that size recovers. ``disk_tier_tokens`` adds a metadata-only disk level below
it (or alone), which takes what the host level gives up, as the engine's disk file does; its hits are not
charged either (the tier's cost rule reads every disk run of 128-token pages in).

Events at equal times are ordered ends first, then arrivals, then by creation, so a replay is deterministic.
Prompt pages are committed at admission: the engine writes them in the request's first prefill steps, and
from then on they count as in flight (a later request missing them in the index records a forfeit) or, with
``store_at='prefill'``, as published.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

from ..errors import AllocationFailed, InvalidRequest, MmcacheError
from ..manager import STORE_AT, AdmitResult, AllocationManager, CacheConfig, PreparedPrompt
from ..names import Fingerprint
from ..pool import MAX_PAGES
from ..router import FALLBACKS, ReplicaRouter, RouterConfig
from ..tier import TierConfig, Tiers
from .costmodel import CostModel
from .workload import RequestSpec, Workload

ROUTINGS = ("random", "affinity")
_END, _ARRIVE = 0, 1


def replay_fingerprint(page_size: int) -> Fingerprint:
    """The fingerprint every replayed pool shares: names depend only on tokens, media and page size."""
    return Fingerprint(model_digest="mmcache-replay", kv_dtype="none", attention_backend="none",
                       page_size=page_size)


class ReplayStalled(MmcacheError, RuntimeError):
    """A replica cannot admit the head of its queue although none of its requests is running, so nothing
    will ever free a page: only a stall caused by cached data (or a request larger than the pool, which
    the replay rejects beforehand) can do that. ``stalls`` is the replica's ``alloc_failures_cache_held``."""

    def __init__(self, replica: int, request_id: object, stalls: int):
        super().__init__(f"replica {replica}: request {request_id!r} cannot be admitted with nothing running "
                         f"({stalls} allocation failure(s) while cached data held pages)")
        self.replica = replica
        self.request_id = request_id
        self.stalls = stalls


MAX_REPLICAS = 4096
"""Replicas one replay may simulate (each holds its own pool's metadata and a router seed): far above any
data-parallel deployment, low enough that a mistyped count fails at once instead of building replicas for
hours."""


@dataclass(frozen=True)
class ReplayConfig:
    pool_tokens: int = 262_144  # per replica
    page_size: int = 128
    replicas: int = 1
    routing: str = "affinity"
    store_at: str = "teardown"
    route_depth_tokens: int = 2048  # routes by the name of the page ending here (a shorter prompt: its first)
    # The router's own defaults; load: requests routed to a replica and not ended (running or waiting).
    route_load_factor: float = RouterConfig.load_factor
    route_min_load: float = RouterConfig.min_load
    route_fallback: str = RouterConfig.fallback  # past the threshold (router.FALLBACKS)
    seed: int = 0  # of the random routing draw, and of the affinity router's uniform draws
    cost: CostModel = CostModel()
    check_invariants: bool = False  # check every manager after every event (tests)
    host_tier_tokens: int = 0  # per replica, a second tier in host memory below the pool (mmcache.tier); 0: none
    disk_tier_tokens: int = 0  # per replica, a disk level below the host level (metadata only); 0: none

    def __post_init__(self):
        for name in ("pool_tokens", "page_size", "replicas", "route_depth_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidRequest(f"{name} must be a positive int, got {v!r}")
        if self.replicas > MAX_REPLICAS:
            raise InvalidRequest(f"replicas must be at most {MAX_REPLICAS}, got {self.replicas}")
        if self.pool_tokens < self.page_size:
            raise InvalidRequest(f"pool of {self.pool_tokens} tokens holds no {self.page_size}-token page")
        if self.num_pages > MAX_PAGES:
            raise InvalidRequest(f"pool of {self.pool_tokens} tokens is {self.num_pages} pages of {self.page_size}; "
                                 f"a pool holds at most {MAX_PAGES} pages (page ids are int32)")
        for name in ("host_tier_tokens", "disk_tier_tokens"):
            tier = getattr(self, name)
            if isinstance(tier, bool) or not isinstance(tier, int) or tier < 0:
                raise InvalidRequest(f"{name} must be a non-negative int, got {tier!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise InvalidRequest(f"seed must be a non-negative int, got {self.seed!r}")
        if self.routing not in ROUTINGS:
            raise InvalidRequest(f"routing must be one of {ROUTINGS}, got {self.routing!r}")
        if self.route_fallback not in FALLBACKS:
            raise InvalidRequest(f"route_fallback must be one of {FALLBACKS}, got {self.route_fallback!r}")
        if self.store_at not in STORE_AT:
            raise InvalidRequest(f"store_at must be one of {STORE_AT}, got {self.store_at!r}")
        self.router()  # the router's own checks

    @property
    def num_pages(self) -> int:
        return self.pool_tokens // self.page_size

    def router(self) -> ReplicaRouter:
        return ReplicaRouter(RouterConfig.numbered(self.replicas,
                                                   depth_pages=max(1, self.route_depth_tokens // self.page_size),
                                                   load_factor=self.route_load_factor,
                                                   min_load=self.route_min_load,
                                                   fallback=self.route_fallback, seed=self.seed))


@dataclass
class RunLog:
    """What a replay recorded, one entry per arrived request in arrival order."""

    config: ReplayConfig
    specs: list = field(default_factory=list)
    final_names: list = field(default_factory=list)  # page names of each final sequence (prompt and output)
    replica: list = field(default_factory=list)
    arrival_s: list = field(default_factory=list)
    admit_s: list = field(default_factory=list)  # NaN for a rejected request
    end_s: list = field(default_factory=list)
    prefill_s: list = field(default_factory=list)
    matched: list = field(default_factory=list)  # tokens seeded from the index at the admission that ran
    forfeit: list = field(default_factory=list)  # tokens after the match an in-flight request held
    waited: list = field(default_factory=list)  # whether the request was held for lack of pages
    rejected: list = field(default_factory=list)
    managers: list = field(default_factory=list)

    def array(self, name: str, dtype=None) -> np.ndarray:
        return np.asarray(getattr(self, name), dtype=dtype)


class _Replica:
    def __init__(self, manager: AllocationManager):
        self.manager = manager
        self.queue: deque = deque()  # (arrival index, spec, prepared prompt, output ids), head first
        self.running = 0


def simulate(workload: Workload, config: ReplayConfig) -> RunLog:
    """Replay ``workload`` under ``config`` and return the per-request log (see the module docstring)."""
    return _Replay(workload, config).run()


class _Replay:
    """One replay's state: the replicas, the event heap and the log."""

    def __init__(self, workload: Workload, config: ReplayConfig):
        fp = replay_fingerprint(config.page_size)
        cache = CacheConfig(num_pages=config.num_pages, page_size=config.page_size, mode="on",
                            store_at=config.store_at)
        self.workload = workload
        self.config = config
        self.replicas = [_Replica(AllocationManager(cache, fp, None, tiers=self.tiers(config)))
                         for _ in range(config.replicas)]
        self.namer = self.replicas[0].manager  # every replica shares the fingerprint, so one prepare serves all
        self.router = config.router()
        self.draw = np.random.default_rng(config.seed)
        self.log = RunLog(config, managers=[r.manager for r in self.replicas])
        self.events: list = []  # (time, _END or _ARRIVE, creation order, item): a heap, earliest first
        self.order = itertools.count()

    @staticmethod
    def tiers(config: ReplayConfig) -> Tiers | None:
        """A replica's second tier: metadata only, like its pool (a hit there is read in at no simulated cost)."""
        tier = TierConfig(host_pages=config.host_tier_tokens // config.page_size,
                          disk_pages=config.disk_tier_tokens // config.page_size)
        return Tiers(tier, config.page_size) if tier.enabled else None

    def run(self) -> RunLog:
        """Process every event in heap order; every request must have ended when none is left."""
        for t, spec in self.workload.initial():
            self.schedule(t, _ARRIVE, spec)
        while self.events:
            now, kind, _, item = heapq.heappop(self.events)
            if kind == _END:
                self.end(*item, now)
            else:
                self.arrive(item, now)
            if self.config.check_invariants:
                for rep in self.replicas:
                    rep.manager.check_invariants()
        if any(rep.queue or rep.running for rep in self.replicas):
            raise RuntimeError("replay ended with requests still queued or running")  # a simulator bug
        return self.log

    def schedule(self, t: float, kind: int, item) -> None:
        heapq.heappush(self.events, (t, kind, next(self.order), item))

    # ---- events ------------------------------------------------------------------------------------
    def arrive(self, spec: RequestSpec, now: float) -> None:
        """Name the request's final sequence, route it, log it, and queue it (or reject it as too big)."""
        final, prepared, output = self.prepare(spec)
        r = self.route(prepared)
        too_big = -(-(spec.prompt_len + spec.output_len) // self.config.page_size) > self.config.num_pages
        i = self.log_arrival(spec, final, r, now, too_big)
        if too_big:
            for t, nxt in self.workload.follow_ups(spec, now, served=False):
                self.schedule(t, _ARRIVE, nxt)
            return
        rep = self.replicas[r]
        rep.queue.append((i, spec, prepared, output))
        if len(rep.queue) == 1:  # behind a waiting head nothing can be admitted before a request ends
            self.admit_head(r, now)

    def admit_head(self, r: int, now: float) -> None:
        """Admit replica ``r``'s queue from the head until it is empty or its head must wait for pages."""
        rep = self.replicas[r]
        while rep.queue:
            i, spec, prepared, output = rep.queue[0]
            res = rep.manager.admit(spec.request_id, prepared)
            if not self.reserve_or_wait(r, i, spec, res.matched_tokens):
                return
            rep.manager.commit(spec.request_id, prepared.ids[res.matched_tokens:])
            rep.queue.popleft()
            rep.running += 1
            self.start(i, r, spec, output, res, now)

    def end(self, i: int, r: int, spec: RequestSpec, output: np.ndarray, now: float) -> None:
        """Commit the output, tear the request down (its full pages are stored) and admit what now fits."""
        rep = self.replicas[r]
        rep.manager.commit(spec.request_id, output)
        rep.manager.teardown(spec.request_id)
        rep.running -= 1
        self.log.end_s[i] = now
        for t, nxt in self.workload.follow_ups(spec, now, served=True):
            self.schedule(t, _ARRIVE, nxt)
        self.admit_head(r, now)

    # ---- steps -------------------------------------------------------------------------------------
    def prepare(self, spec: RequestSpec) -> tuple[PreparedPrompt, PreparedPrompt, np.ndarray]:
        """The named final sequence, the prompt's ``PreparedPrompt`` (its leading names) and the output ids."""
        prompt, output = spec.prompt_ids(), spec.output_ids()
        final = self.namer.prepare(np.concatenate([prompt, output]), spec.media(), request_id=spec.request_id)
        prepared = replace(final, ids=final.ids[: len(prompt)],
                           names=final.names[: len(prompt) // self.config.page_size])
        return final, prepared, output

    def route(self, prepared: PreparedPrompt) -> int:
        if self.config.routing == "random":
            return int(self.draw.integers(self.config.replicas))
        return self.router.route(prepared.names, [rep.running + len(rep.queue) for rep in self.replicas])

    def log_arrival(self, spec: RequestSpec, final: PreparedPrompt, r: int, now: float, rejected: bool) -> int:
        """Append the request's entry to every log list, as not yet admitted; returns its index."""
        log = self.log
        i = len(log.specs)
        log.specs.append(spec)
        log.final_names.append(final.names)
        log.replica.append(r)
        log.arrival_s.append(now)
        log.admit_s.append(float("nan"))
        log.end_s.append(float("nan"))
        log.prefill_s.append(0.0)
        log.matched.append(0)
        log.forfeit.append(0)
        log.waited.append(False)
        log.rejected.append(rejected)
        return i

    def reserve_or_wait(self, r: int, i: int, spec: RequestSpec, matched_tokens: int) -> bool:
        """Reserve pages for the rest of the admitted head's final sequence. When the pool is full of live
        requests, abort the admission (it stays at the head, to wait) and return False."""
        rep = self.replicas[r]
        try:
            rep.manager.reserve(spec.request_id, spec.prompt_len - matched_tokens + spec.output_len)
        except AllocationFailed:
            rep.manager.abort(spec.request_id, requeue=True)  # it is admitted again: its lookup counts once
            self.log.waited[i] = True
            if rep.running == 0:
                raise ReplayStalled(r, spec.request_id, rep.manager.metrics.alloc_failures_cache_held) from None
            return False
        return True

    def start(self, i: int, r: int, spec: RequestSpec, output: np.ndarray, res: AdmitResult, now: float) -> None:
        """Log the admission that ran and schedule the request's end after its prefill and decode."""
        cost = self.config.cost
        prefill = cost.prefill_s(spec.prompt_len - res.matched_tokens)
        log = self.log
        log.admit_s[i] = now
        log.prefill_s[i] = prefill
        log.matched[i] = res.matched_tokens
        log.forfeit[i] = res.forfeit_tokens
        self.schedule(now + prefill + cost.decode_s(spec.output_len), _END, (i, r, spec, output))
