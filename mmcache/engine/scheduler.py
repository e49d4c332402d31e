"""Continuous batching: which branches compute which tokens in the next forward.

Each step has a token budget (``max_tokens_per_step``). Running requests come first, decodes before prefill
chunks, then waiting requests are admitted in arrival order while the budget, ``max_num_seqs`` and the pool
allow. A step that decodes computes at most ``mixed_prefill_tokens`` prompt tokens besides (all requests
together): a decoding request waits for the prefill work of every step it shares, so this bounds the time a
prompt adds to each of its output tokens, while a step with nothing to decode prefills whole chunks. Invariants:

* Admission seeds from the index: names are computed outside any lock (``Branch.prepare``), then
  ``AllocationManager.admit`` probes, verifies and takes the matched pages; prefill starts at the match.
* Chunk boundaries fall on page boundaries: a chunk that does not finish its branch ends at a multiple of
  ``page_size`` and is at most ``prefill_chunk_tokens`` long (a multiple of ``page_size``). Since matches are
  whole pages, a cache-off run and a cache-on run cut the tokens after the match at the same positions.
* Before a forward every scheduled branch has reserved its pages. When a reservation fails after eviction
  (``AllocationFailed``) the newest running request not yet scheduled this step that holds pages of the
  short pool (label) is preempted: each of its branches is suspended (``AllocationManager.suspend``) and it
  waits at the head of the queue, still known to its managers. A request with no pages in that pool is never
  preempted for it (that frees nothing there). With no such request the requester itself is preempted while
  another request holds pages of that pool (they are returned when it ends), and otherwise it fails with the
  allocation error. A step that preempted admits nothing: the room it made is the running requests' (the
  preempted request, resumed at once, would take it back and be preempted again).
* Suspension keeps shared pages: pages a suspended branch shares (with the index or another request) keep
  their other owners, and pages it owns alone are freed, or, where the pool has tiers, copied into the tiers'
  share for preempted requests first (``preempt_tier_bytes``, ``mmcache.tier``: the offload budget's part
  that cold cache pages cannot take; ``host_tier_bytes`` is the cache's part). Its admission at the head of the
  queue resumes it (``AllocationManager.resume``, counted as a re-admission's lookup): re-seeded from the index
  over everything it had written, then from the tiers (read in behind the readiness gate), and the rest is
  computed again from there (a resumed request whose first chunk finds no room is given back, as any
  admission, and admitted afresh later). Every call on a manager without tiers is a plain method call with plain arguments
  (``suspend(rid)``, ``resume(rid, readmission=True)``), which a tensor-parallel rank can replay by name.
* A whole hit: with ``whole_hits`` (the engine sets it only where its forward gives each row the same bits in
  any company), admission may match a prompt that ends on a page boundary to its end. The branch then holds
  every prompt token's KV (``computed == len(tokens)``) but no logits; its next work computes the last token
  again (``start = len - 1``), as a prefill chunk of one row that writes no KV (``Work.write`` False, nothing
  reserved), so a repeated prompt costs one row's forward, and its logits equal the exact schedule's.
* Shared prefill is computed once (``defer_shared_prefill``, for labels that publish at prefill): a waiting
  request whose next unmatched prompt page (``AllocationManager.peek``: after what the index holds now) is a
  page some running request has yet to write is *deferred*: it stays in its place in the queue and is
  admitted in a later step, once that page is published, seeding from it. Requests admitted earlier in the
  same step count as running. Each deferred request keeps a seat: a later request is admitted only while
  ``running + deferred ahead of it < max_num_seqs``, so a deferred request is never crowded out by the
  requests that overtook it, and one step looks past at most ``max_num_seqs`` deferred requests. Deferral
  ends when the page is written (published, or written but unpublished: then the request computes it
  itself) or its writer leaves the running set (finished, aborted, failed, preempted), so it lasts at most
  the writer's prefill of those pages: no request starves. Labels that publish at teardown defer nothing
  (their pages appear only when the writer ends, after its whole generation). Only written pages are ever
  published: indexing a page when its chunk is scheduled (so a request admitted later in the same step
  could read it in the same forward, a step sooner) would leave pages of a failed forward in the index.
* The readiness gate: where a pool has a second tier (``mmcache.tier``) and the host gave ``start_read_in``,
  admission leaves a tier hit's copy to a worker (``AllocationManager.admit(defer_read_in=True)``): the request
  is running and holds its pages, but none of its branches is scheduled until every read-in it started has
  ended, and it is never scheduled in the step that admitted it. The first step after that completes the
  read-in (its pages join the index and the branch's computed tokens) and schedules the rest as a hit's. Other
  requests run meanwhile; a step with nothing else to do waits for a read-in (``pending_read_ins``).
* ``schedule="serial"`` runs one request at a time (admitted when nothing else runs). With
  ``prefill_chunk_tokens == page_size`` this is the *exact* schedule: every prefill forward holds one page of
  one branch of one request (a CFG request's branches take turns), every decode forward one token per branch,
  so a cache-off run computes each shared page in a forward identical to the one that produced the cached page, and every forward after the match is identical in both runs. (CPU GEMMs
  are not row-independent for small row counts, so "same schedule" must mean identical forwards.) This
  covers prompt pages; a matched page holding positions that an earlier request *decoded* is exact only
  against a run that decoded them too, since a cache-off run recomputes them in a prefill forward.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..errors import AllocationFailed, MmcacheError
from .sequence import Branch, LiveRequest


@dataclass(eq=False)
class Work:
    """One segment of the next forward: ``branch`` computes ``tokens[start:end]`` into ``pages``; with ``write``
    False (a whole hit's last token, whose KV its matched pages hold) it computes them without writing their KV."""

    live: LiveRequest
    branch: Branch
    start: int
    end: int
    pages: np.ndarray
    write: bool = True

    @property
    def wants_logits(self) -> bool:
        return self.end == len(self.branch.tokens)


@dataclass
class StepPlan:
    works: list[Work] = field(default_factory=list)
    preempted: list[LiveRequest] = field(default_factory=list)
    failed: list[tuple[LiveRequest, MmcacheError]] = field(default_factory=list)


@dataclass(frozen=True)
class SchedulerLimits:
    page_size: int
    max_num_seqs: int
    max_tokens_per_step: int
    prefill_chunk_tokens: int
    serial: bool
    defer_shared_prefill: bool
    whole_hits: bool = False  # admission may match a prompt to its end (see the module docstring)
    mixed_prefill_tokens: int | None = None  # prompt tokens of a step that decodes; None: no bound beyond chunks


class Scheduler:
    def __init__(self, limits: SchedulerLimits):
        self.limits = limits
        self.waiting: deque[LiveRequest] = deque()
        self.running: list[LiveRequest] = []
        self.preemptions = 0
        self.suspended: set[LiveRequest] = set()  # preempted requests waiting to be resumed (see the docstring)
        self.deferrals = 0  # request-steps spent deferred (see the module docstring)
        #: ``start_read_in(manager, request_id)`` runs ``manager.read_pending(request_id)`` on a worker and returns
        #: its future (the readiness gate, see the module docstring); None: tier hits are read in at admission.
        self.start_read_in = None

    def add(self, live: LiveRequest) -> None:
        self.waiting.append(live)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def remove(self, live: LiveRequest) -> None:
        """Forget a request (finished, aborted or failed) without touching its pages."""
        self.suspended.discard(live)
        if live in self.running:
            self.running.remove(live)
        elif live in self.waiting:
            self.waiting.remove(live)

    # ---- planning ----------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.limits.max_tokens_per_step
        scheduled: set[int] = set()
        decoding = [r for r in self.running if all(b.remaining <= 1 for b in r.branches.values())]
        prefilling = [r for r in self.running if r not in decoding]
        budget = self._schedule_running(decoding, budget, scheduled, plan)
        if scheduled and self.limits.mixed_prefill_tokens is not None:
            budget = min(budget, self.limits.mixed_prefill_tokens)  # a mixed step (see the module docstring)
        budget = self._schedule_running(prefilling, budget, scheduled, plan)
        if not plan.preempted:  # a step that had to preempt has no room to admit (the module docstring)
            self._admit(plan, budget, scheduled)
        return plan

    def _schedule_running(self, lives: list[LiveRequest], budget: int, scheduled: set, plan: StepPlan) -> int:
        """Schedule the next work of each of ``lives`` within ``budget``; the budget left."""
        for live in lives:
            if live not in self.running:
                continue  # preempted earlier in this step
            chunks = self._chunks(live, budget)
            if not chunks:
                continue
            works = self._reserve(live, chunks, scheduled, plan)
            if works:
                plan.works.extend(works)
                scheduled.add(id(live))
                budget -= sum(w.end - w.start for w in works)
        return budget

    def pending_read_ins(self) -> list:
        """The futures of the read-ins running requests wait for (the readiness gate)."""
        return [b.reading for r in self.running for b in r.branches.values() if b.reading is not None]

    def _ready(self, live: LiveRequest) -> bool:
        """Whether every read-in of ``live`` has ended; those that have are completed now."""
        ready = True
        for b in live.branches.values():
            if b.reading is None:
                continue
            if not b.reading.done():
                ready = False
                continue
            b.reading = None
            b.computed = b.matched = b.matched + b.manager.complete_read_in(live.request_id)
            if b.reading_first:
                b.first_matched = b.matched
        return ready

    def _chunks(self, live: LiveRequest, budget: int) -> list[tuple[Branch, int, int]]:
        p = self.limits.page_size
        out = []
        if not self._ready(live):
            return out
        for b in live.branches.values():
            if b.computed == len(b.tokens):  # matched whole: its last token again, for its logits only
                if b.logits is None and budget >= 1:
                    out.append((b, b.computed - 1, b.computed))
                    budget -= 1
                    if self.limits.serial:
                        break
                continue
            n = min(b.remaining, self.limits.prefill_chunk_tokens, budget)
            end = b.computed + n
            if end < len(b.tokens):
                end -= end % p
            if end > b.computed:
                out.append((b, b.computed, end))
                budget -= end - b.computed
                if self.limits.serial:
                    break  # one branch's chunk per forward (see the module docstring)
        return out

    def _reserve(self, live: LiveRequest, chunks, scheduled: set, plan: StepPlan) -> list[Work] | None:
        """Reserve pages for every chunk, preempting as the module docstring says. None: nothing scheduled."""
        works = []
        for branch, start, end in chunks:
            while True:
                try:
                    pages = branch.manager.reserve(live.request_id, _new_tokens(branch, start, end))
                    break
                except AllocationFailed as err:
                    victim = self._victim(live, branch, scheduled)
                    if victim is None:  # no one else can free room: it fails, and gives its pages back now, so a
                        plan.failed.append((live, err))  # request admitted later in this step can use them
                        self.running.remove(live)
                        self.release(live, store=False)
                        return None
                    self.preempt(victim)
                    plan.preempted.append(victim)
                    if victim is live:
                        return None
            works.append(Work(live, branch, start, end, pages, end > branch.computed))
        return works

    def _victim(self, live: LiveRequest, short: Branch, scheduled: set) -> LiveRequest | None:
        """Whom to preempt when ``short`` could not reserve: only a request holding pages of the short pool
        can give it room (a request without a branch there would be recomputed for nothing)."""
        others = [r for r in reversed(self.running) if r is not live]
        for cand in others:
            if id(cand) not in scheduled and _holds_pages(cand, short.manager):
                return cand
        return live if any(_holds_pages(r, short.manager) for r in others) else None

    def _admit(self, plan: StepPlan, budget: int, scheduled: set) -> None:
        lim = self.limits
        unwritten = self._unwritten_pages() if lim.defer_shared_prefill and self.waiting else {}
        seats = 0  # seats kept by deferred requests ahead in the queue
        i = 0
        while i < len(self.waiting) and len(self.running) + seats < lim.max_num_seqs \
                and not (lim.serial and self.running):
            live = self.waiting[i]
            resuming = live in self.suspended  # named already: its managers re-seed it from its written ids
            for b in live.branches.values():
                if b.prepared is None and not resuming:
                    b.prepare(live.request_id)
            if unwritten and not resuming and self._deferred(live, unwritten):
                live.setbacks.deferrals += 1
                self.deferrals += 1
                seats += 1
                i += 1
                continue
            if budget < lim.page_size and any(budget < len(b.tokens) for b in live.branches.values()):
                return  # the first chunk might not fit; the next step has a full budget
            first_admission = self._resume_branches(live) if resuming else self._admit_branches(live)
            del self.waiting[i]
            self.running.append(live)
            reading = any(b.reading is not None for b in live.branches.values())  # never in the admitting step
            works = self._reserve_admission(live, [] if reading else self._chunks(live, budget), plan, i)
            if works is None:
                for b, first in zip(live.branches.values(), first_admission):
                    if first:
                        b.first_matched = None
                return
            plan.works.extend(works)
            scheduled.add(id(live))
            budget -= sum(w.end - w.start for w in works)
            if lim.defer_shared_prefill:
                self._add_unwritten(live, unwritten)

    def _admit_branches(self, live: LiveRequest) -> list[bool]:
        """Admits each of ``live``'s prepared branches to its manager (its matched tokens counted as computed);
        returns, per branch, whether this was its first admission (not one after a preemption)."""
        first_admission = [b.first_matched is None for b in live.branches.values()]
        for b in live.branches.values():
            defer = {"defer_read_in": True} if self.start_read_in and getattr(b.manager, "tiers", None) else {}
            res = b.manager.admit(live.request_id, b.prepared, whole=self.limits.whole_hits,
                                  readmission=b.first_matched is not None, **defer)  # after a preemption
            b.names = b.prepared.names
            b.prepared = None
            b.admitted = True
            b.computed = b.matched = res.matched_tokens
            b.reading_first = b.first_matched is None
            if b.first_matched is None:
                b.first_matched = res.matched_tokens
            if res.pending_tokens:
                b.reading = self.start_read_in(b.manager, live.request_id)
        return first_admission

    def _resume_branches(self, live: LiveRequest) -> list[bool]:
        """Resumes each of a suspended request's branches (see the module docstring); as ``_admit_branches``,
        returns whether each was a first admission (never)."""
        self.suspended.discard(live)
        for b in live.branches.values():
            kw = {"readmission": True}
            if self.start_read_in and getattr(b.manager, "tiers", None) is not None:
                kw["defer_read_in"] = True
            res = b.manager.resume(live.request_id, **kw)
            b.computed = b.matched = res.restored_tokens
            b.reading_first = False
            if res.reading_tokens:
                b.reading = self.start_read_in(b.manager, live.request_id)
        return [False] * len(live.branches)

    def _unwritten_pages(self) -> dict[str, set]:
        """Per label, the names of prompt pages running requests have yet to write (see the docstring)."""
        out: dict[str, set] = {}
        for live in self.running:
            self._add_unwritten(live, out)
        return out

    def _add_unwritten(self, live: LiveRequest, out: dict[str, set]) -> None:
        for b in live.branches.values():
            m = b.manager
            if b.admitted and m.mode == "on" and m.config.store_at == "prefill":
                names = b.names[b.computed // self.limits.page_size:]
                if len(names):
                    out.setdefault(b.label, set()).update(names.tolist())

    def _deferred(self, live: LiveRequest, unwritten: dict[str, set]) -> bool:
        """Whether a branch's next unmatched page (after what the index holds now) is still to be written."""
        p = self.limits.page_size
        for b in live.branches.values():
            pending = unwritten.get(b.label)
            if not pending:
                continue
            prepared, whole = b.prepared, self.limits.whole_hits
            cap = b.manager.match_cap(len(prepared.ids), whole)
            names = prepared.names[:cap].tolist()
            if pending.isdisjoint(names):
                continue  # the cheap test first: peek takes the manager's lock and verifies ids
            k = b.manager.peek(prepared, whole) // p
            if k < cap and names[k] in pending:
                return True
        return False

    def _reserve_admission(self, live: LiveRequest, chunks, plan: StepPlan, position: int) -> list[Work] | None:
        """Reserve a newly admitted request's first chunk; never preempts a running request for it.

        On failure the admission is undone (nothing was computed, nothing is stored) and the request waits
        at its ``position`` in the queue, or fails when nothing else runs that could free pages.
        """
        works = []
        for branch, start, end in chunks:
            try:
                pages = branch.manager.reserve(live.request_id, _new_tokens(branch, start, end))
                works.append(Work(live, branch, start, end, pages, end > branch.computed))
            except AllocationFailed as err:
                self.running.remove(live)
                retry = bool(self.running)
                self.release(live, store=False, requeue=retry)
                if retry:
                    self.waiting.insert(position, live)
                else:
                    plan.failed.append((live, err))
                return None
        return works

    # ---- release -----------------------------------------------------------------------------------
    def preempt(self, live: LiveRequest) -> None:
        """Suspend every branch of a running request (see the module docstring) and queue it first, to be
        resumed. Its branches stay admitted with nothing computed; where the pool has tiers the manager moves
        the pages the branch owns alone into the tiers' share for preempted requests."""
        self.running.remove(live)
        for b in live.branches.values():
            b.manager.suspend(live.request_id)  # a read-in in progress is completed first (the manager's rule)
            b.computed = 0
            b.logits = None
            b.reading = None
        self.suspended.add(live)
        live.setbacks.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(live)

    @staticmethod
    def release(live: LiveRequest, store: bool, requeue: bool = False) -> None:
        """Give back every admitted branch's pages (teardown stores full pages; abort stores nothing; a
        suspended branch holds none and stores nothing). ``requeue``: the request is admitted again later, so
        its lookups are not counted twice."""
        for b in live.branches.values():
            if b.admitted:
                if store:
                    b.manager.teardown(live.request_id)
                else:
                    b.manager.abort(live.request_id, requeue=requeue)
            b.admitted = False
            b.computed = 0
            b.logits = None
            b.reading = None  # the manager completed or cancelled it when the request left


def _new_tokens(branch: Branch, start: int, end: int) -> int:
    """Tokens of ``start .. end`` whose KV the branch has yet to write (a whole hit's last token has it)."""
    return max(0, end - max(start, branch.computed))


def _holds_pages(live: LiveRequest, manager) -> bool:
    return any(b.admitted and b.manager is manager and manager.pages_held(live.request_id)
               for b in live.branches.values())
