"""Video jobs: a bounded store of asynchronous generation jobs, run by one ``GenerationQueue``.

A job is created ``queued``, becomes ``in_progress`` when the worker takes it, and ends ``completed`` (its MP4
bytes held in memory, in this process: nothing is written to disk) or ``failed`` (an error object). Jobs run one
at a time, in creation order, on the store's ``job_queue.GenerationQueue`` (the same worker as the images' and
speech's): a diffusers pipeline keeps per-call state in its scheduler, so two calls on one pipeline cannot
overlap. A job runs whether or not anyone is still waiting for it. The store admits a job (its bounds below)
before the queue takes it, so the queue's own bounds (the same numbers, over fewer jobs: it counts only those
waiting) never refuse one.

Bounds and the eviction rule (checked by ``check_invariants``):

* At most ``max_pending`` jobs are queued or running (``/sync`` jobs included); creating one more raises
  ``JobsFull`` (the server answers 503 with Retry-After). Queued and running jobs are never evicted.
* At most ``max_jobs`` listed jobs are kept, holding at most ``max_bytes``: a job holds its ``kept_bytes``
  (its prompts and its object, given at creation) from creation, and its MP4 bytes once completed.
* Each owner has a share of each bound (``share(limit)``, ``Tenants.share``: shares add up to at most the
  bound), so one owner never fills the queue or the store for the others. An owner at its pending share gets
  ``JobsFull``. A job that needs room (one more job, its ``kept_bytes``, then its MP4) evicts the owner's own
  finished (completed or failed) jobs, the one that finished longest ago first; when even all of them would not
  make room, nothing is evicted and the job is refused (``JobsFull`` at creation; ``video_too_large`` at
  completion, the video not kept). Another owner's job is evicted only when the shares add up to more than a
  bound (more owners than the bound has units) and the bound itself is reached.
* An evicted or deleted job is gone: its id is unknown afterwards. Deleting a queued job removes it before it
  runs; deleting a running one stops it at its next denoising step (the renderer's progress callback raises
  ``job_queue.JobCancelled``, the queue's own cancellation) and drops its output.
* A job belongs to the tenant (``owner``) that created it; every lookup is by owner, so another tenant's job is
  indistinguishable from a missing one.
* ``/sync`` jobs (``listed=False``) share the queue and the pending bound (and its shares), are never listed,
  never counted in ``max_jobs`` or ``max_bytes``, and hand their bytes only to their waiter.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

from ..checks import positive_int
from ..errors import InvalidRequest, MmcacheError
from .job_queue import GenerationQueue, Job, JobCancelled

QUEUED, IN_PROGRESS, COMPLETED, FAILED = "queued", "in_progress", "completed", "failed"


class JobsFull(MmcacheError):
    """The queue holds ``max_pending`` jobs already."""


@dataclass(eq=False)
class VideoJob:
    id: str
    owner: str  # the tenant's name
    spec: object  # what the renderer renders; opaque to the store
    salt: bytes
    listed: bool = True
    created_at: float = field(default_factory=time.time)
    status: str = QUEUED
    progress: int = 0
    completed_at: float | None = None
    error: dict | None = None  # {"code", "message"} when failed
    content: bytes | None = None
    info: dict = field(default_factory=dict)  # what the renderer reports (e.g. store hits)
    kept_bytes: int = 0  # what the job holds besides its content (its prompts, its object)
    outcome: str | None = None  # completed, failed or cancelled, once finished
    latency_s: float | None = None  # creation to finish
    task: Job | None = None  # its place on the queue, whose ``cancel`` stops it; set when it is queued
    _start: float = field(default_factory=time.perf_counter)
    _callbacks: list = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.outcome is not None

    @property
    def cancelled(self) -> bool:
        return self.task is not None and self.task.cancelled.is_set()

    @property
    def held_bytes(self) -> int:
        return self.kept_bytes + (0 if self.content is None else len(self.content))


Renderer = Callable[[object, bytes, Callable[[float], None]], tuple[bytes, dict]]


class VideoJobs:
    """The job store and its queue. ``render(spec, salt, progress)`` returns ``(mp4 bytes, info)``; it calls
    ``progress(fraction)`` between steps, which raises ``JobCancelled`` when the job is to stop. ``observe(job)``
    is called once per finished job, on the queue's worker thread (or the thread that cancelled a queued job).
    ``share(limit)`` is one owner's part of each bound (None: the whole bound)."""

    def __init__(self, render: Renderer, max_jobs: int = 64, max_pending: int = 8, max_bytes: int = 256 * 2**20,
                 observe: Callable[[VideoJob], None] | None = None, share: Callable[[int], int] | None = None):
        for name, value in (("max_jobs", max_jobs), ("max_pending", max_pending), ("max_bytes", max_bytes)):
            if not positive_int(value):
                raise InvalidRequest(f"{name} must be a positive int, got {value!r}")
        if max_pending > max_jobs:
            raise InvalidRequest(f"max_pending ({max_pending}) must not exceed max_jobs ({max_jobs})")
        self.render = render
        self.max_jobs, self.max_pending, self.max_bytes = max_jobs, max_pending, max_bytes
        share = share or (lambda limit: limit)
        self.owner_jobs, self.owner_pending, self.owner_bytes = share(max_jobs), share(max_pending), share(max_bytes)
        for name, part, limit in (("jobs", self.owner_jobs, max_jobs), ("pending", self.owner_pending, max_pending),
                                  ("bytes", self.owner_bytes, max_bytes)):
            if not positive_int(part) or part > limit:
                raise InvalidRequest(f"an owner's share of {name} must be an int in [1, {limit}], got {part!r}")
        self.observe = observe
        self.evictions = 0
        self.stored_bytes = 0
        self._jobs: dict[str, VideoJob] = {}  # listed jobs, any status; stored_bytes is their held_bytes
        self._finished: OrderedDict[str, VideoJob] = OrderedDict()  # listed finished jobs, oldest finish first
        self._queue: deque[VideoJob] = deque()  # queued jobs, in creation order (the order the queue runs them)
        self._running: VideoJob | None = None
        self._closed = False
        self._cond = threading.Condition()
        self._tasks = GenerationQueue("videos", max_pending, self.owner_pending)

    # ---- the API --------------------------------------------------------------------------------------
    def submit(self, owner: str, spec: object, salt: bytes, listed: bool = True, kept_bytes: int = 0) -> VideoJob:
        """A new queued job of ``owner``, holding ``kept_bytes`` while it is kept (a listed job); ``JobsFull``
        when ``max_pending`` jobs or the owner's share of them wait or run, or when the owner's share of the
        store has no room even with its finished jobs evicted."""
        with self._cond:
            if self._closed:
                raise JobsFull("the server is shutting down")
            if self.pending >= self.max_pending:
                raise JobsFull(f"{self.pending} video jobs are queued or running (the limit is {self.max_pending})")
            mine = self._pending_of(owner)
            if mine >= self.owner_pending:
                raise JobsFull(f"{mine} video jobs of this tenant are queued or running (its share is "
                               f"{self.owner_pending})")
            job = VideoJob(f"video_{uuid.uuid4().hex}", owner, spec, salt, listed,
                           kept_bytes=kept_bytes if listed else 0)
            if listed:
                if not self._make_room(owner, 1, job.kept_bytes):
                    raise JobsFull(f"this tenant's share of the video store ({self.owner_jobs} jobs, "
                                   f"{self.owner_bytes} bytes) is held by its queued and running jobs")
                self._jobs[job.id] = job
                self.stored_bytes += job.kept_bytes
            job.task = self._tasks.submit(lambda task: self._run(job), owner)
            self._queue.append(job)
        return job

    def get(self, owner: str, job_id: str) -> VideoJob | None:
        with self._cond:
            job = self._jobs.get(job_id)
            return job if job is not None and job.owner == owner else None

    def list(self, owner: str) -> list[VideoJob]:
        """The owner's jobs, newest first."""
        with self._cond:
            jobs = [job for job in self._jobs.values() if job.owner == owner]
        return sorted(jobs, key=lambda j: j.created_at, reverse=True)

    def delete(self, owner: str, job_id: str) -> bool:
        """Forget the owner's job (stopping it if queued or running); False when there is none."""
        with self._cond:
            job = self._jobs.get(job_id)
            if job is None or job.owner != owner:
                return False
            self._forget(job)
            queued = self._cancel_locked(job)
        if queued:
            self._notify(job)
        return True

    def cancel(self, job: VideoJob) -> None:
        """Stop a job nobody waits for any more (a ``/sync`` client gone); a finished job is left as it is."""
        with self._cond:
            queued = self._cancel_locked(job)
        if queued:
            self._notify(job)

    def on_done(self, job: VideoJob, callback: Callable[[VideoJob], None]) -> None:
        """Call ``callback(job)`` once the job has finished (at once if it has)."""
        with self._cond:
            if not job.finished:
                job._callbacks.append(callback)
                return
        callback(job)

    @property
    def alive(self) -> bool:
        """Whether the queue's worker runs (False once closed)."""
        return self._tasks.alive

    @property
    def pending(self) -> int:
        return len(self._queue) + (self._running is not None)

    def stats(self) -> dict:
        with self._cond:
            counts = {s: 0 for s in (QUEUED, IN_PROGRESS, COMPLETED, FAILED)}
            for job in self._jobs.values():
                counts[job.status] += 1
            return {"jobs": counts, "pending": self.pending, "stored_bytes": self.stored_bytes,
                    "evictions": self.evictions}

    def close(self) -> None:
        """Stop: queued jobs fail with ``shutdown``, the running one stops at its next step; joins the worker.
        Every stored byte is released."""
        with self._cond:
            self._closed = True
            queued = list(self._queue)
            for job in queued:
                self._cancel_locked(job)
        for job in queued:
            self._notify(job)
        self._tasks.close()  # stops the running job at its next step
        with self._cond:
            for job in list(self._jobs.values()):
                self._forget(job)

    def __enter__(self) -> "VideoJobs":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def check_invariants(self) -> None:
        with self._cond:
            assert len(self._jobs) <= self.max_jobs and self.pending <= self.max_pending
            assert self.stored_bytes == sum(j.held_bytes for j in self._jobs.values())
            assert self.stored_bytes <= self.max_bytes
            for owner in {j.owner for j in self._jobs.values()} | {j.owner for j in self._queue}:
                jobs, held = self._usage(owner)
                assert jobs <= self.owner_jobs and held <= self.owner_bytes
                assert self._pending_of(owner) <= self.owner_pending
            assert all(j.finished for j in self._finished.values())
            assert set(self._finished) == {i for i, j in self._jobs.items() if j.finished}
            assert all(j.status == QUEUED and not j.finished for j in self._queue)

    # ---- bookkeeping (under the lock) ------------------------------------------------------------------
    def _forget(self, job: VideoJob) -> None:
        if self._jobs.pop(job.id, None) is not None:
            self.stored_bytes -= job.held_bytes
        self._finished.pop(job.id, None)
        job.content = None

    def _evict(self, job: VideoJob) -> None:
        self._forget(job)
        self.evictions += 1

    def _cancel_locked(self, job: VideoJob) -> bool:
        """Flag ``job`` to stop; a queued job is finished here (True: its callbacks are to be called)."""
        if job.finished:
            return False
        job.task.cancel()
        if job.status != QUEUED:
            return False  # the worker stops it at its next step
        self._queue.remove(job)
        self._finish(job, FAILED, None, {"code": "cancelled", "message": "the job was cancelled before it ran"})
        job.outcome = "cancelled"
        return True

    def _finish(self, job: VideoJob, status: str, content: bytes | None, error: dict | None) -> None:
        job.status, job.error = status, error
        job.completed_at = time.time()
        job.latency_s = time.perf_counter() - job._start
        job.outcome = status
        if status == COMPLETED:
            job.progress = 100
        if job.listed and job.id in self._jobs:
            if content is not None:  # its room was made (_make_room) before
                self.stored_bytes += len(content)
            self._finished[job.id] = job
        job.content = content

    def _pending_of(self, owner: str) -> int:
        running = self._running is not None and self._running.owner == owner
        return sum(job.owner == owner for job in self._queue) + running

    def _usage(self, owner: str) -> tuple[int, int]:
        """How many listed jobs ``owner`` has, and the bytes they hold."""
        mine = [job for job in self._jobs.values() if job.owner == owner]
        return len(mine), sum(job.held_bytes for job in mine)

    def _make_room(self, owner: str, jobs: int, size: int) -> bool:
        """Evict finished jobs until ``jobs`` more jobs and ``size`` more bytes of ``owner`` fit its share and
        the store's bounds (module docstring); False, with nothing evicted, when they would not fit even with
        every finished job gone."""
        def fits(held_jobs: int, held_bytes: int, max_jobs: int, max_bytes: int) -> bool:
            return held_jobs + jobs <= max_jobs and held_bytes + size <= max_bytes

        finished = list(self._finished.values())
        mine = [job for job in finished if job.owner == owner]
        own_jobs, own_bytes = self._usage(owner)
        if not (fits(own_jobs - len(mine), own_bytes - sum(j.held_bytes for j in mine), self.owner_jobs,
                     self.owner_bytes)
                and fits(len(self._jobs) - len(finished), self.stored_bytes - sum(j.held_bytes for j in finished),
                         self.max_jobs, self.max_bytes)):
            return False
        for old in mine:
            if fits(own_jobs, own_bytes, self.owner_jobs, self.owner_bytes):
                break
            own_jobs, own_bytes = own_jobs - 1, own_bytes - old.held_bytes
            self._evict(old)
        for old in list(self._finished.values()):  # reached only when the shares add up to more than a bound
            if fits(len(self._jobs), self.stored_bytes, self.max_jobs, self.max_bytes):
                break
            self._evict(old)
        return True

    # ---- the work, on the queue's worker thread --------------------------------------------------------------
    def _run(self, job: VideoJob) -> None:
        with self._cond:
            if job.finished:  # cancelled while the queue was handing it over
                return
            self._queue.remove(job)
            job.status = IN_PROGRESS
            self._running = job

        def progress(fraction: float) -> None:
            job.task.check()
            job.progress = max(job.progress, min(99, int(fraction * 100)))

        content, error, info = None, None, {}
        try:
            content, info = self.render(job.spec, job.salt, progress)
        except JobCancelled:
            error = {"code": "cancelled", "message": "the job was cancelled while it ran"}
        except InvalidRequest as e:
            error = {"code": "invalid_request", "message": str(e)}
        except Exception as e:  # a failed job reports its error; the worker goes on with the next
            error = {"code": "generation_failed", "message": f"{type(e).__name__}: {e}"}
        with self._cond:
            self._running = None
            job.info = info
            if error is None and job.cancelled:
                error = {"code": "cancelled", "message": "the job was cancelled while it ran"}
            if error is None and job.listed and not self._make_room(job.owner, 0, len(content)):
                error = {"code": "video_too_large",
                         "message": f"the video of {len(content)} bytes does not fit the {self.owner_bytes} "
                                    f"bytes this tenant's videos may hold, beside its queued and running jobs"}
            if error is None:
                self._finish(job, COMPLETED, content, None)
            else:
                self._finish(job, FAILED, None, error)
                if job.cancelled:
                    job.outcome = "cancelled"
                    self._forget(job)  # deleted meanwhile, or the store closing
        self._notify(job)

    def _notify(self, job: VideoJob) -> None:
        callbacks, job._callbacks = job._callbacks, []
        if self.observe is not None:
            self.observe(job)
        for callback in callbacks:
            callback(job)
