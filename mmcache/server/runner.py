"""The engine host: one engine, one step loop in its own thread, and asyncio queues to the request handlers.

Rules and invariants:

* Only the step thread calls ``step``. Handlers submit from the event loop: the engine's ``add_request`` (which
  for a VLM reads and encodes the images) runs in a worker thread, never on the event loop, and its events
  come back to the handler's ``asyncio.Queue`` through ``loop.call_soon_threadsafe``.
* A handler registers its request id before the request is added, so no event can arrive unrouted; the
  subscription is dropped with the request's finished event, which is always the last one.
* ``abort`` never waits for the engine: it queues the id and wakes the step thread, which aborts between steps
  (the engine returns the request's pages and store leases at once). A handler cancelled while its request
  is still being added aborts it as soon as the add returns.
* ``waiting`` counts requests submitted that have had no event yet; a submission beyond ``max_waiting`` raises
  ``QueueFull`` before anything is built. ``running`` counts those with a token and no finished event.
* ``stop`` ends the thread and aborts every request still live, so nothing stays held.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass

from ..errors import MmcacheError

_log = logging.getLogger("mmcache.server")


class QueueFull(MmcacheError, RuntimeError):
    """The waiting queue is full; the client should retry later."""


@dataclass
class _Subscription:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    started: bool = False
    cancelled: bool = False
    stop_reason: str | None = None  # set when the server ends the request itself (a stop string)


class EngineHost:
    """Serves ``engine`` (an ``Engine`` or a ``VLMEngine``) to asyncio handlers; ``observe`` (optional) is
    called on the step thread with each finished event and the reason the server records for it."""

    def __init__(self, engine, max_waiting: int = 256, observe=None):
        self.engine = engine
        self.max_waiting = max_waiting
        self.observe = observe
        self._subs: dict[object, _Subscription] = {}
        self._lock = threading.Lock()  # guards _subs, the counts and _holds
        self._aborts: deque = deque()
        self._wake = threading.Event()
        self._stopping = False
        self._holds = 0
        self.waiting = 0
        self.running = 0
        self._thread = threading.Thread(target=self._loop, name="mmcache-step-loop", daemon=True)

    @property
    def core(self):
        """The text ``Engine`` (a VLM front end's own engine)."""
        return self.engine.engine if self.is_vlm else self.engine

    @property
    def is_vlm(self) -> bool:
        return hasattr(self.engine, "builder")

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def start(self) -> "EngineHost":
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the step loop and abort every request still live (their handlers get the abort events). Called
        again, it aborts those submitted since."""
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()
        with self._lock:
            live = list(self._subs)
        for rid in live:
            self.engine.abort(rid)
        self._dispatch(self.engine.step())

    # ---- handlers' side (event loop) -------------------------------------------------------------------
    async def submit(self, request) -> asyncio.Queue:
        """Add ``request`` (its ``request_id`` set); returns the queue its ``StreamEvent``s arrive on."""
        rid = request.request_id
        sub = _Subscription(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if self.waiting >= self.max_waiting:
                raise QueueFull(f"{self.waiting} requests are waiting (the limit is {self.max_waiting})")
            if rid in self._subs:
                raise MmcacheError(f"request id {rid!r} is in use")
            self._subs[rid] = sub
            self.waiting += 1
        try:
            await asyncio.to_thread(self._add, request, sub)
        except asyncio.CancelledError:
            sub.cancelled = True
            self.abort(rid)
            raise
        except BaseException:
            self._forget(rid)
            raise
        return sub.queue

    def _add(self, request, sub: _Subscription) -> None:
        self.engine.add_request(request)
        self._wake.set()
        if sub.cancelled:  # the handler went away while the request was being built
            self.abort(request.request_id)

    def _forget(self, rid) -> None:
        with self._lock:
            sub = self._subs.pop(rid, None)
            if sub is not None:
                self._uncount(sub)

    def _uncount(self, sub: _Subscription) -> None:
        if sub.started:
            self.running -= 1
        else:
            self.waiting -= 1

    def abort(self, rid, reason: str | None = None) -> None:
        """Ask the step thread to end ``rid``; ``reason`` ("stop": a stop string matched) is what the server
        records for it instead of ``abort``. Never waits; harmless for a request that has ended."""
        with self._lock:
            sub = self._subs.get(rid)
            if sub is not None and reason is not None:
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
        for ev in events:
            with self._lock:
                sub = self._subs.get(ev.request_id)
                if sub is None:
                    continue
                if not sub.started:
                    sub.started = True
                    self.waiting -= 1
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
            try:
                sub.loop.call_soon_threadsafe(sub.queue.put_nowait, ev)
            except RuntimeError:  # the handler's loop has closed: nobody is left to read it
                pass
