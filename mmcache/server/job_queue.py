"""A generation queue: one worker thread that runs a pipeline's jobs in order, off the event loop.

A diffusers or transformers pipeline keeps per-call state (a scheduler's timesteps, the sampler's RNG), so two
calls on one pipeline never overlap: each pipeline gets its own queue and one worker thread.

Rules and invariants:

* ``submit`` raises ``QueueFull`` (the server answers 503 with Retry-After) when ``max_waiting`` jobs wait
  already, or when ``owner_share`` jobs of the same owner (a tenant's name) wait already; otherwise the job waits
  its turn. With shares that add up to at most ``max_waiting`` (``Tenants.share``), an owner within its share is
  never refused because of another's jobs. ``waiting`` counts jobs queued and not started, ``running`` is 0 or 1.
  ``check_room`` raises the same ``QueueFull`` without queuing anything: an early check that saves a caller's
  preparation, not a reservation (``submit`` checks again).
* A job cancelled before it starts never runs (its future is cancelled). A running job sees ``job.cancelled``
  set: the work checks it between steps (``check``) and stops by raising ``JobCancelled``; whatever the work
  leased is released by the work's own ``finally`` blocks, in the worker thread.
* The work runs in a copy of the submitter's context (``contextvars``), as ``asyncio.to_thread`` would.
* ``close`` fails what waits with ``JobCancelled``, stops the running job at its next step, and joins the thread.

``QueuedService`` is what the image and speech services share: a name, their queue, ``alive`` and ``close``.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import threading
from collections import deque
from typing import Callable

from ..errors import MmcacheError
from .engine_host import QueueFull


class JobCancelled(MmcacheError):
    """The job's client went away (or the server is closing) before the job ended."""


class Job:
    """One submitted piece of work: ``future`` holds its result; ``cancel`` asks it to stop."""

    def __init__(self, work: Callable[["Job"], object], owner: str | None = None):
        self.work = work
        self.owner = owner
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.cancelled = threading.Event()
        self.context = contextvars.copy_context()

    def cancel(self) -> None:
        self.cancelled.set()
        self.future.cancel()  # only succeeds while the job waits

    def check(self) -> None:
        """Raise ``JobCancelled`` if the job was cancelled (called by the work between its steps)."""
        if self.cancelled.is_set():
            raise JobCancelled("the request was cancelled")


class QueuedService:
    """A pipeline served as ``name`` whose requests run on a ``GenerationQueue`` of its own, named ``task``
    (``images``, ``speech``: also the task /v1/models shows); alive while the queue's worker runs. A subclass
    builds what may fail first and calls this ``__init__`` last, so that a failed build leaves no thread."""

    task: str

    def __init__(self, name: str, config, owner_share: int | None = None):
        self.name = name
        self.config = config
        self.queue = GenerationQueue(self.task, config.max_generation_waiting, owner_share)

    @property
    def alive(self) -> bool:
        return self.queue.alive

    def close(self) -> None:
        self.queue.close()


class GenerationQueue:
    """Jobs for one pipeline, run one at a time by one worker thread, at most ``max_waiting`` waiting and at most
    ``owner_share`` of one owner (None: no per-owner bound)."""

    def __init__(self, name: str, max_waiting: int, owner_share: int | None = None):
        self.name = name
        self.max_waiting = max_waiting
        self.owner_share = owner_share
        self._jobs: deque[Job] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._running: list[Job] = []
        self._thread = threading.Thread(target=self._loop, name=f"mmcache-{name}", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        with self._cond:
            return sum(1 for job in self._jobs if not job.future.cancelled())

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closing

    def submit(self, work: Callable[[Job], object], owner: str | None = None) -> Job:
        """Queue ``work(job)`` for ``owner``; ``QueueFull`` when ``max_waiting`` jobs wait already, or
        ``owner_share`` of ``owner``'s."""
        job = Job(work, owner)
        with self._cond:
            self._jobs = deque(j for j in self._jobs if not j.future.cancelled())
            self._refuse_if_full(owner)
            self._jobs.append(job)
            self._cond.notify()
        return job

    def check_room(self, owner: str | None = None) -> None:
        """Raise ``QueueFull`` when ``submit(work, owner)`` would be refused now (the queue or ``owner``'s share
        full), so that a caller can refuse before costly preparation (a speech request's clip is decoded only
        after this). The check saves that work and guarantees nothing: another submit may take the place before
        this caller's, and ``submit`` checks again."""
        with self._cond:
            self._refuse_if_full(owner)

    def _refuse_if_full(self, owner: str | None) -> None:
        """Under the condition's lock: ``QueueFull`` when closing, or when the live jobs waiting fill the queue
        or ``owner``'s share of it."""
        if self._closing:
            raise QueueFull(f"the {self.name} queue is closing")
        live = [j for j in self._jobs if not j.future.cancelled()]
        if len(live) >= self.max_waiting:
            raise QueueFull(f"{len(live)} {self.name} requests are waiting (the limit is {self.max_waiting})")
        mine = sum(1 for j in live if j.owner == owner)
        if self.owner_share is not None and mine >= self.owner_share:
            raise QueueFull(f"{mine} {self.name} requests of this tenant are waiting (its share is "
                            f"{self.owner_share})")

    def close(self) -> None:
        """Fail what waits (``JobCancelled``), stop the running job at its next step, join the thread."""
        with self._cond:
            self._closing = True
            for job in self._jobs:
                job.cancelled.set()
                if job.future.set_running_or_notify_cancel():
                    job.future.set_exception(JobCancelled("the server is stopping"))
            self._jobs.clear()
            for job in self._running:
                job.cancelled.set()
            self._cond.notify()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closing:
                    self._cond.wait()
                if self._closing and not self._jobs:
                    return
                job = self._jobs.popleft()
                if not job.future.set_running_or_notify_cancel():
                    continue  # cancelled while it waited: never runs
                self._running.append(job)
            try:
                job.future.set_result(job.context.run(job.work, job))
            except BaseException as e:  # the handler maps it to a response; the worker keeps serving
                job.future.set_exception(e)
            finally:
                with self._cond:
                    self._running.remove(job)
