"""The engine host: one engine, one step loop in its own thread, intake threads that add requests, and asyncio
queues to the request handlers.

Rules and invariants:

* Only the step thread calls ``step``. ``submit`` never waits: it registers the request and hands it to an
  intake thread, which runs the engine's ``add_request`` (for a VLM it reads and encodes the images) and wakes
  the step thread. Events come back to the handler's ``asyncio.Queue`` through ``loop.call_soon_threadsafe``;
  the only wake-up of the event loop between a submission and its first token is that token's own (awaiting
  the add in a worker thread would add one more, which then competes for the GIL with the step thread, already
  prefilling, and can hold the first token back).
* A handler registers its request id before the request is added, so no event can arrive unrouted; the
  subscription is dropped with the request's finished event, which is always the last one. An ``add_request``
  that raises drops it too, and its queue gets one ``AddFailed`` carrying the error.
* ``abort`` never waits for the engine: it queues the id and wakes the step thread, which aborts between steps
  (the engine returns the request's pages and store leases at once). An abort that arrives while its request
  is still being added is applied again as soon as the add returns.
* ``waiting`` counts requests reserved or submitted that have had no event yet; a reservation or submission
  beyond ``max_waiting``, beyond ``owner_share`` waiting requests of the same owner (a tenant's name), or once
  the host is stopping, raises ``QueueFull``. A handler reserves before it builds the engine request, so a full
  queue refuses before any tokenizing. ``running`` counts those with a token and
  no finished event.
* ``stop`` ends the thread, lets the adds under way finish, and aborts every request still live, so nothing
  stays held.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

from ..errors import MmcacheError

_log = logging.getLogger("mmcache.server")
INTAKE_THREADS = min(32, (os.cpu_count() or 1) + 4)  # asyncio's default executor's size: adds of requests at once


class QueueFull(MmcacheError, RuntimeError):
    """The waiting queue is full (or the host is stopping); the client should retry later."""


@dataclass(frozen=True)
class AddFailed:
    """The one item on a request's queue when the engine's ``add_request`` raised ``error``."""

    request_id: object
    error: BaseException


@dataclass
class _Subscription:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    started: bool = False
    cancelled: bool = False
    stop_reason: str | None = None  # set when the server ends the request itself (a stop string)
    owner: str | None = None  # the tenant's name, for its share of the waiting queue


class WaitingQueue:
    """The counts behind a bounded waiting queue: requests accepted with no event yet, in all and per owner (a
    tenant's name). Not locked itself: its host calls it under the host's lock."""

    def __init__(self, max_waiting: int, owner_share: int | None = None):
        self.max_waiting = max_waiting
        self.owner_share = owner_share
        self.waiting = 0
        self._by_owner: dict[str | None, int] = {}

    def refuse_if_full(self, owner: str | None) -> None:
        """``QueueFull`` when the queue or ``owner``'s share of it is full."""
        if self.waiting >= self.max_waiting:
            raise QueueFull(f"{self.waiting} requests are waiting (the limit is {self.max_waiting})")
        mine = self._by_owner.get(owner, 0)
        if self.owner_share is not None and mine >= self.owner_share:
            raise QueueFull(f"{mine} requests of this tenant are waiting (its share is {self.owner_share})")

    def count(self, owner: str | None, change: int) -> None:
        """``waiting`` and ``owner``'s part of it moved by ``change``."""
        self.waiting += change
        left = self._by_owner.get(owner, 0) + change
        if left:
            self._by_owner[owner] = left
        else:
            self._by_owner.pop(owner, None)


class EngineHost:
    """Serves ``engine`` (an ``Engine`` or a ``VLMEngine``) to asyncio handlers; ``observe`` (optional) is
    called on the step thread with each finished event and the reason the server records for it."""

    def __init__(self, engine, max_waiting: int = 256, observe=None, owner_share: int | None = None):
        self.engine = engine
        self._queue = WaitingQueue(max_waiting, owner_share)
        self.observe = observe
        self._subs: dict[object, _Subscription] = {}
        self._lock = threading.Lock()  # guards _subs, the counts and _holds
        self._aborts: deque = deque()
        self._wake = threading.Event()
        self._stopping = False
        self._holds = 0
        self.running = 0
        self._thread = threading.Thread(target=self._loop, name="mmcache-step-loop", daemon=True)
        self._intake = ThreadPoolExecutor(INTAKE_THREADS, thread_name_prefix="mmcache-intake")

    @property
    def core(self):
        """The text ``Engine`` (a VLM front end's own engine)."""
        return self.engine.engine if self.is_vlm else self.engine

    @property
    def is_vlm(self) -> bool:
        return hasattr(self.engine, "builder")

    @property
    def alive(self) -> bool:
        """The step loop runs and the engine can serve (its tensor-parallel group, where it has one, has not
        failed)."""
        return self._thread.is_alive() and not self._stopping and getattr(self.core, "fatal", None) is None

    def start(self) -> "EngineHost":
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the step loop, let the adds under way finish, and abort every request still live (their handlers
        get the abort events). Called again, it aborts those submitted since."""
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()
        self._intake.shutdown(wait=True)
        with self._lock:
            live = list(self._subs)
        for rid in live:
            self.engine.abort(rid)
        self._dispatch(self.engine.step())

    # ---- handlers' side (event loop) -------------------------------------------------------------------
    def reserve(self, owner: str | None = None) -> None:
        """Take a place in the waiting queue for a request of ``owner`` whose engine request is still to be built
        (``QueueFull`` when there is none), so that building it (tokenizing) is admitted by the same bounds as the
        request itself; ``submit(request, owner, reserved=True)`` then fills the place, ``unreserve`` gives it
        back. Called on the handler's event loop."""
        with self._lock:
            self._refuse_if_full(owner)
            self._count_waiting(owner, +1)

    def unreserve(self, owner: str | None = None) -> None:
        with self._lock:
            self._count_waiting(owner, -1)

    def submit(self, request, owner: str | None = None, reserved: bool = False, source=None) -> asyncio.Queue:
        """Queue ``request`` (its ``request_id`` set) of the tenant ``owner`` to be added, without waiting, in the
        place ``reserve`` took when ``reserved`` (given back if the submission fails); returns the queue its
        ``StreamEvent``s (or one ``AddFailed``) arrive on. ``source`` (the API request it was built from) is for
        a host of replicas, which routes by it; one engine has no use for it. Called on the handler's event
        loop."""
        rid = request.request_id
        sub = _Subscription(asyncio.get_running_loop(), asyncio.Queue(), owner=owner)
        with self._lock:
            try:
                if not reserved:
                    self._refuse_if_full(owner)
                elif self._stopping:
                    raise QueueFull("the server is stopping")
                if rid in self._subs:
                    raise MmcacheError(f"request id {rid!r} is in use")
            except MmcacheError:
                if reserved:
                    self._count_waiting(owner, -1)
                raise
            self._subs[rid] = sub
            if not reserved:
                self._count_waiting(owner, +1)
        try:
            self._intake.submit(self._add, request, sub)
        except RuntimeError:  # stop() shut the intake down after the check above
            self._forget(rid)
            raise QueueFull("the server is stopping") from None
        return sub.queue

    def _refuse_if_full(self, owner: str | None) -> None:
        """Under the lock: ``QueueFull`` when stopping, or when the waiting queue or ``owner``'s share is full."""
        if self._stopping:
            raise QueueFull("the server is stopping")
        self._queue.refuse_if_full(owner)

    def _add(self, request, sub: _Subscription) -> None:
        """On an intake thread: add ``request``; an error goes to its queue as ``AddFailed``."""
        rid = request.request_id
        try:
            self.engine.add_request(request)
        except BaseException as e:
            self._forget(rid)
            self._post(sub, AddFailed(rid, e))
            return
        self._wake.set()
        if sub.cancelled:  # aborted while it was being added: that abort may have found nothing to end
            self.abort(rid)

    def _forget(self, rid) -> None:
        with self._lock:
            sub = self._subs.pop(rid, None)
            if sub is not None:
                self._uncount(sub)

    def _uncount(self, sub: _Subscription) -> None:
        if sub.started:
            self.running -= 1
        else:
            self._count_waiting(sub.owner, -1)

    def _count_waiting(self, owner, change: int) -> None:
        """Under the lock: ``waiting`` and ``owner``'s part of it moved by ``change``."""
        self._queue.count(owner, change)

    @property
    def waiting(self) -> int:
        return self._queue.waiting

    @property
    def max_waiting(self) -> int:
        return self._queue.max_waiting

    @max_waiting.setter
    def max_waiting(self, value: int) -> None:
        self._queue.max_waiting = value

    @property
    def owner_share(self) -> int | None:
        return self._queue.owner_share

    def headers(self, rid) -> dict:
        """Response headers that say where ``rid`` ran: none for one engine (a host of replicas names one)."""
        return {}

    async def merge_metrics(self, text: bytes) -> bytes:
        """The server's exposition as /metrics sends it: ``text`` itself (a host of replicas adds theirs)."""
        return text

    def abort(self, rid, reason: str | None = None) -> None:
        """Ask the step thread to end ``rid``; ``reason`` ("stop": a stop string matched) is what the server
        records for it instead of ``abort``. Never waits; harmless for a request that has ended."""
        with self._lock:
            sub = self._subs.get(rid)
            if sub is not None:
                sub.cancelled = True
                if reason is not None:
                    sub.stop_reason = reason
        self._aborts.append(rid)
        self._wake.set()

    @contextmanager
    def hold(self):
        """No step runs inside the block (requests are still accepted and aborted): to fill the waiting queue
        deterministically, or to pause the engine while reading its state."""
        with self._lock:
            self._holds += 1
        try:
            yield
        finally:
            with self._lock:
                self._holds -= 1
            self._wake.set()

    # ---- the step thread ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            self._wake.clear()
            if self._stopping:
                return
            self._apply_aborts()
            if self._holds:
                self._wake.wait()
                continue
            try:
                events = self.engine.step()
            except Exception:  # the engine fails requests itself; a raising step is a bug: log, keep serving
                _log.exception("an engine step raised")
                self._wake.wait(0.05)
                continue
            self._dispatch(events)
            if not events and not self.engine.has_unfinished() and not self._aborts:
                self._wake.wait()

    def _apply_aborts(self) -> None:
        while self._aborts:
            rid = self._aborts.popleft()
            try:
                self.engine.abort(rid)
            except Exception:
                _log.exception("aborting request %r raised", rid)

    def _dispatch(self, events) -> None:
        posts: dict[int, tuple[_Subscription, list]] = {}  # one post per request per step: see _post
        for ev in events:
            with self._lock:
                sub = self._subs.get(ev.request_id)
                if sub is None:
                    continue
                if not sub.started:
                    sub.started = True
                    self._count_waiting(sub.owner, -1)
                    self.running += 1
                if ev.finished:
                    del self._subs[ev.request_id]
                    self.running -= 1
            if ev.finished and self.observe is not None:
                try:
                    self.observe(ev, sub.stop_reason if ev.finish_reason == "abort" and sub.stop_reason else
                                 ev.finish_reason)
                except Exception:
                    _log.exception("recording the metrics of request %r raised", ev.request_id)
            posts.setdefault(id(sub), (sub, []))[1].append(ev)
        for sub, items in posts.values():
            self._post(sub, *items)

    @staticmethod
    def _post(sub: _Subscription, *items) -> None:
        """Queue ``items`` for ``sub``'s handler in one callback, so a handler that reads the first (a request's
        last token) finds the rest (its end) queued already."""
        try:
            sub.loop.call_soon_threadsafe(_put_all, sub.queue, items)
        except RuntimeError:  # the handler's loop has closed: nobody is left to read it
            pass


def _put_all(queue, items) -> None:
    for item in items:
        queue.put_nowait(item)
