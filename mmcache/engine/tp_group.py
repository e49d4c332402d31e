"""A tensor-parallel group of engines: rank 0 plans every step, the other ranks follow it.

Every rank runs an ``Engine`` over its slice of the model (``tensor_parallel``) with its own page pools and prefix
indexes. Rank 0 alone takes requests, schedules and samples; what it does to its pools and what it computes is
sent to the followers, which do the same to theirs. Messages go over ``torch.distributed`` (one broadcast of a
pickled list of operations); the group's backend (gloo on CPU, NCCL on CUDA) carries the model's all-reduces too.

Invariants:

* Rank 0's managers are wrapped (``RecordedManager``): every call that changes a pool (reserve, teardown, abort,
  suspend, release and clear) is recorded after it succeeded, and the followers replay the records in order, on
  the manager of the same label, before anything that depends on them. A forward's commits are not sent: rank 0
  commits every work that writes KV (its requests stay live through the step: aborts wait for its end), and each
  follower commits the same works right after its forward, at the same time as rank 0. A follower's pools
  therefore hold the same requests with the same lengths as rank 0's.
* Admission: rank 0's lookup announces the request (ids, media, salt) and then joins the agreement
  (``mmcache.agreement.GroupMinimum``) with its matched page count; each follower admits the same request on its
  own index and joins it with its own count, and every rank seeds the minimum. A resume after a preemption
  re-seeds the same way. A follower's names come from its own fingerprint (which names its slice); only lengths
  cross ranks.
* Forward: rank 0 sends each work (request, label, token range, its token ids, whether it writes KV and wants
  logits) before it runs the model; a follower builds the same works over its own page tables and runs the same
  forward, so the model's all-reduces pair up. A request's multimodal embeddings are sent with its first work
  after each admission. Followers compute no logits unless rank 0 asked them to keep a digest of them (the
  ``record_logits`` query, for checks).
* Nothing waits for ever: rank 0 sends an empty message when it has sent nothing for a quarter of the group's
  timeout, and every collective has that timeout. A collective that fails (a rank died, stopped answering) or a
  forward that fails on rank 0 marks the group broken: ``GroupFailed`` from then on, on every call, without
  touching the other ranks again. A follower whose replay or collective fails raises out of ``follow`` (its
  process exits; rank 0's next collective then fails).
* ``stop`` (rank 0) ends every follower's ``follow`` loop; it is sent once.
"""

from __future__ import annotations

import datetime
import logging
import pickle
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, replace

import xxhash

from ..agreement import GroupMinimum
from ..errors import GroupFailed
from .request import MultimodalInput
from .scheduler import Work
from .sequence import Branch

_log = logging.getLogger("mmcache.engine")
_LENGTH = 8  # bytes of a message's length at the head of its frame

RECORDED = ("reserve", "teardown", "abort", "suspend", "release_oldest", "protect_prefix", "clear_cache")
"""The manager calls rank 0 records and the followers replay (every call that changes a pool; an admission and a
resume, which match on the index, are the agreement's own messages, and a forward's commits each follower makes
itself, right after the forward)."""


@dataclass(frozen=True)
class GroupInfo:
    """Where this engine stands in its group: ``rank`` of ``size``, the collectives' ``timeout_s``, the process
    group (None: ``torch.distributed``'s default one)."""

    rank: int
    size: int
    timeout_s: float
    group: object = None

    @property
    def leads(self) -> bool:
        return self.rank == 0


def join(size: int, timeout_s: float) -> GroupInfo:
    """This process's place in a group of ``size`` ranks, from ``torch.distributed``'s default group (started by
    ``torchrun`` or ``mmcache serve --tensor-parallel-size``). ``EngineConfigError`` where there is none or it has
    another size."""
    import torch.distributed as dist

    from .config import EngineConfigError

    if not dist.is_available() or not dist.is_initialized():
        raise EngineConfigError(f"tensor_parallel_size {size} needs torch.distributed's default group: start the "
                                f"ranks with torchrun (then torch.distributed.init_process_group) or with "
                                f"mmcache serve --tensor-parallel-size {size}")
    world = dist.get_world_size()
    if world != size:
        raise EngineConfigError(f"tensor_parallel_size is {size} but the process group has {world} ranks")
    # The engine's own group: every collective of it (messages, agreements, the model's sums) times out after
    # ``timeout_s``, whatever the default group's timeout. Every rank builds its engines in the same order, so
    # they create their groups in the same order, as torch.distributed requires.
    group = dist.new_group(list(range(size)), timeout=datetime.timedelta(seconds=timeout_s))
    return GroupInfo(dist.get_rank(), size, timeout_s, group)


def leave() -> None:
    """Tear down this process's ``torch.distributed`` groups before it exits: a process that exits with its gloo
    groups alive, or with an engine of the group still alive, can abort at exit ("terminate called without an
    active exception"), whatever it returned. Drop every reference to the engines first: this collects them (an
    engine and its leader or follower refer to each other, which only the collector frees), then tears the groups
    down. Nothing when there are none; a group that cannot be torn down is left."""
    import gc

    import torch.distributed as dist

    gc.collect()
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a broken group: the process is on its way out anyway
            _log.debug("tearing the process group down raised", exc_info=True)


class Channel:
    """Rank 0's messages to the followers under one lock (``lock``: a sender that needs the group for more than the
    message, an agreement or a forward, holds it across both). A message is pickled into a frame of ``FRAME``
    bytes (its length first) and sent in one broadcast; one longer than the frame sends the rest in a second."""

    FRAME = 1 << 16

    def __init__(self, info: GroupInfo):
        import torch
        import torch.distributed as dist

        self.info = info
        self.lock = threading.RLock()
        self.broken: GroupFailed | None = None
        self.last_sent = time.monotonic()
        self.messages = 0
        nccl = dist.get_backend(info.group) == "nccl"
        self._device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self._frame = torch.empty(self.FRAME, dtype=torch.uint8, device=self._device)

    def send(self, message: list) -> None:
        import torch

        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        head = len(data).to_bytes(_LENGTH, "little") + data[: self.FRAME - _LENGTH]
        self._frame[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8).to(self._device)
        self._broadcast(self._frame)
        rest = data[self.FRAME - _LENGTH:]
        if rest:
            self._broadcast(torch.frombuffer(bytearray(rest), dtype=torch.uint8).to(self._device))
        self.last_sent = time.monotonic()
        self.messages += 1

    def receive(self) -> list:
        import torch

        self._broadcast(self._frame)
        frame = self._frame.cpu().numpy().tobytes()
        n = int.from_bytes(frame[:_LENGTH], "little")
        data = frame[_LENGTH: _LENGTH + n]
        if n > self.FRAME - _LENGTH:
            rest = torch.empty(n - (self.FRAME - _LENGTH), dtype=torch.uint8, device=self._device)
            self._broadcast(rest)
            data += rest.cpu().numpy().tobytes()
        return pickle.loads(data)  # from rank 0 of this program's own group

    def _broadcast(self, tensor) -> None:
        import torch.distributed as dist

        if self.broken is not None:
            raise self.broken
        try:
            dist.broadcast(tensor, src=0, group=self.info.group)
        except Exception as e:
            raise self.fail(f"a message to the tensor-parallel group failed: {type(e).__name__}: {e}") from e

    def fail(self, why: str) -> GroupFailed:
        """Mark the group broken (the first reason stays) and return the error to raise."""
        if self.broken is None:
            self.broken = GroupFailed(why)
        return self.broken


class Leader:
    """Rank 0's side: records pool changes, announces admissions, sends forwards, keeps the followers awake."""

    def __init__(self, info: GroupInfo):
        self.info = info
        self.channel = Channel(info)
        self._ops: list = []
        self._exchange: tuple | None = None  # the admission or resume whose agreement is under way (its op)
        self._sent_mm: set = set()  # (request, label) whose multimodal input the followers hold
        self.agreements: dict[str, GroupMinimum] = {}
        self.logits = None  # a digest of the logits rank 0 computed, from the ``record_logits`` query on
        self.stopped = False
        self._wake = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="mmcache-tp-heartbeat", daemon=True)
        self._beat.start()

    @property
    def broken(self) -> GroupFailed | None:
        return self.channel.broken

    # ---- what the engine wires in ------------------------------------------------------------------
    def agreement(self, label: str, device) -> GroupMinimum:
        agree = GroupMinimum(self.info.group, announce=lambda k, label=label: self._announce(label, k),
                             device=device)
        self.agreements[label] = agree
        return agree

    def wrap(self, manager, label: str) -> "RecordedManager":
        return RecordedManager(manager, label, self)

    def runner(self, runner) -> "LeaderRunner":
        return LeaderRunner(runner, self)

    def record(self, op: tuple) -> None:
        with self.channel.lock:
            self._ops.append(op)
            if op[0] == "call" and op[2] in ("teardown", "abort"):
                self._sent_mm.discard((op[3][0], op[1]))

    def stop(self) -> None:
        """End the followers' loops (once; nothing is sent to a broken group)."""
        with self.channel.lock:
            if self.stopped:
                return
            self.stopped = True
            self._wake.set()
            if self.channel.broken is None:
                try:
                    self._send([("stop",)])
                except GroupFailed:
                    pass

    def query(self, what: str) -> list:
        """Every follower's answer to ``what`` (``Follower.answer``), in rank order, rank 0's place left None."""
        import torch.distributed as dist

        with self.channel.lock:
            if what == "record_logits":
                self.logits = xxhash.xxh3_128()
            self._send([("query", what)])
            answers = [None] * self.info.size
            try:
                dist.gather_object(None, answers, dst=0, group=self.info.group)
            except Exception as e:
                raise self.channel.fail(f"a query to the tensor-parallel group failed: {type(e).__name__}: {e}")
            if what == "logits_digest" and self.logits is not None:
                answers[0] = self.logits.hexdigest()
            return answers

    # ---- messages ----------------------------------------------------------------------------------
    def _send(self, tail: list) -> None:
        """Send the recorded operations, then ``tail`` (under the channel's lock)."""
        ops, self._ops = self._ops, []
        self.channel.send(ops + tail)

    def _announce(self, label: str, k: int) -> None:
        """Inside rank 0's admission or resume (under its manager's lock, and the channel's, which
        ``RecordedManager`` holds until the agreement's all-reduce is done): the followers do the same and join
        the all-reduce that follows."""
        self._send([self._exchange])

    def _heartbeat(self) -> None:
        period = self.info.timeout_s / 4
        while not self._wake.wait(period / 4):
            with self.channel.lock:
                if self.stopped or self.channel.broken is not None:
                    return
                if time.monotonic() - self.channel.last_sent >= period:
                    try:
                        self._send([])
                    except GroupFailed:
                        return


class RecordedManager:
    """Rank 0's manager of one label: every call goes to ``manager``; the changes are recorded for the followers
    (``RECORDED``), and an admission runs the group's agreement."""

    def __init__(self, manager, label: str, leader: Leader):
        self._manager = manager
        self._label = label
        self._leader = leader

    def __getattr__(self, name):
        attr = getattr(self._manager, name)
        if name not in RECORDED:
            return attr

        def recorded(*args, **kwargs):
            if kwargs.get("offload") is not None:
                raise GroupFailed("a tensor-parallel group cannot replay an offload callable on its followers")
            out = attr(*args, **kwargs)
            self._leader.record(("call", self._label, name, args, kwargs))
            return out

        return recorded

    def admit(self, request_id, prompt, whole: bool = False, readmission: bool = False, **kw):
        op = ("admit", self._label, request_id, prompt.ids, prompt.media, prompt.salt, whole, readmission)
        return self._agreeing(op, self._manager.admit, request_id, prompt, whole=whole, readmission=readmission, **kw)

    def resume(self, request_id, **kw):
        return self._agreeing(("resume", self._label, request_id, kw), self._manager.resume, request_id, **kw)

    def _agreeing(self, op: tuple, call, *args, **kw):
        """``call`` (an admission or a resume, whose lookup runs the agreement; ``op`` replays it on a follower)."""
        if self._leader.broken is not None:
            raise self._leader.broken
        leader, channel = self._leader, self._leader.channel
        with channel.lock:  # the announcement and the all-reduce after it are one exchange with the followers
            leader._exchange = op
            try:
                agreements = leader.agreements[self._label].calls
                result = call(*args, **kw)
                if leader.agreements[self._label].calls == agreements:  # no lookup ran (cache off): replay it
                    leader.record(op)
            except GroupFailed as e:
                channel.fail(str(e))
                raise
            finally:
                leader._exchange = None
        return result


class LeaderRunner:
    """Rank 0's model runner: sends each forward's works to the followers, then runs it; a forward that fails
    breaks the group (the followers may be inside its all-reduces)."""

    def __init__(self, runner, leader: Leader):
        self.inner = runner
        self.leader = leader

    def order(self, works):
        return self.inner.order(works)

    def run(self, works: list[Work]):
        channel = self.leader.channel
        with channel.lock:
            self.leader._send([("forward", [self._describe(w) for w in works])])
            try:
                logits = self.inner.run(works)
            except Exception as e:
                raise channel.fail(f"a tensor-parallel forward failed on rank 0: {type(e).__name__}: {e}") from e
            if self.leader.logits is not None and len(logits):
                self.leader.logits.update(logits.contiguous().numpy().tobytes())
            return logits

    def _describe(self, w: Work) -> tuple:
        b = w.branch
        mm = None
        key = (w.live.request_id, b.label)
        if b.mm is not None and key not in self.leader._sent_mm:
            mm = replace(b.mm, release=None)
            self.leader._sent_mm.add(key)
        return (w.live.request_id, b.label, w.start, w.end, w.write, w.wants_logits, list(b.tokens[w.start:w.end]),
                b.prompt_len, mm)


class _Placed:
    """The token ids of one work at their positions ``start ..``, in a sequence of ``length`` tokens: all that a
    forward reads of a branch's tokens (its slice and its length), without the tokens before ``start``."""

    def __init__(self, start: int, ids: list, length: int):
        self.start, self.ids, self.length = start, ids, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key: slice) -> list:
        if not isinstance(key, slice) or key.step is not None or key.start < self.start:
            raise IndexError(f"a follower's work holds tokens from {self.start} on only, not {key!r}")
        return self.ids[key.start - self.start: key.stop - self.start]


class Follower:
    """A follower rank's loop over its engine (``Engine.follow``): replay what rank 0 sends until it says stop."""

    def __init__(self, engine, info: GroupInfo):
        self.engine = engine
        self.info = info
        self.channel = Channel(info)
        self._mm: dict = {}
        self._received = time.perf_counter()
        self.catchup: deque = deque(maxlen=1024)  # seconds from a message to this rank's agreement (``mark``)
        #: A digest of every logits row this rank computed, once rank 0 asked for them (the ``record_logits``
        #: query: a check that every rank computes what rank 0 does); None: followers compute no logits.
        self.logits = None

    def mark(self, _k: int) -> None:
        """The agreement's first act on a follower (``GroupMinimum.announce``): note how long after the message
        arrived this rank reached it (replaying the changes sent with it, naming and matching the prompt)."""
        self.catchup.append(time.perf_counter() - self._received)

    def run(self) -> None:
        while True:
            message = self.channel.receive()
            self._received = time.perf_counter()
            for op in message:
                if op[0] == "stop":
                    return
                self._apply(op)

    def _apply(self, op: tuple) -> None:
        kind = op[0]
        try:
            if kind == "call":
                _, label, name, args, kwargs = op
                getattr(self.engine._manager(label), name)(*args, **kwargs)
                if name in ("teardown", "abort"):
                    self._mm.pop((args[0], label), None)
            elif kind == "admit":
                _, label, rid, ids, media, salt, whole, readmission = op
                manager = self.engine._manager(label)
                manager.admit(rid, manager.prepare(ids, media, salt, rid), whole=whole, readmission=readmission)
            elif kind == "resume":
                _, label, rid, kw = op
                self.engine._manager(label).resume(rid, **kw)
            elif kind == "forward":
                self._forward(op[1])
            elif kind == "query":
                self._answer(op[1])
            else:
                raise GroupFailed(f"rank {self.info.rank} got an operation it does not know: {kind!r}")
        except GroupFailed:
            raise
        except Exception as e:  # a pool that cannot do what rank 0's did, a forward or collective that failed
            raise GroupFailed(f"rank {self.info.rank} could not follow rank 0 ({kind}): {type(e).__name__}: {e}") \
                from e

    def _forward(self, described: list) -> None:
        works = []
        for rid, label, start, end, write, wants_logits, ids, prompt_len, mm in described:
            manager = self.engine._manager(label)
            if mm is not None:
                self._mm[(rid, label)] = mm
            wanted = wants_logits and self.logits is not None  # else a token past ``end``: no logits here
            tokens = _Placed(start, ids, end if wanted else end + 1)
            branch = Branch(label, manager, tokens, prompt_len, mm=self._mm.get((rid, label)))
            works.append(Work(None, branch, start, end, manager.page_table(rid), write))
        logits = self.engine.runner.run(works)
        if self.logits is not None and len(logits):
            self.logits.update(logits.contiguous().numpy().tobytes())
        for w, (rid, *_rest) in zip(works, described):  # as rank 0's Engine._commit, in the same order
            if w.write:
                w.branch.manager.commit(rid, w.branch.tokens[w.start:w.end])

    def _answer(self, what: str) -> None:
        import torch.distributed as dist

        e = self.engine
        if what == "invariants":  # the pools' own (a follower's engine holds no live requests to compare with)
            try:
                for m in e.managers.values():
                    m.check_invariants()
                answer = None
            except AssertionError as err:
                answer = f"{type(err).__name__}: {err}"
        elif what == "state":
            answer = {label: {"requests": m.num_requests, "free_pages": int(m.pool.num_free),
                              "cached_pages": int(m.index.in_index.sum())} for label, m in e.managers.items()}
        elif what == "agreements":
            answer = {label: m.agreement.summary() for label, m in e.managers.items()
                      if getattr(m, "agreement", None) is not None}
            if self.catchup:
                answer["catchup_median_ms"] = 1e3 * statistics.median(self.catchup)
        elif what == "fingerprint":
            f = e.fingerprint
            answer = (f.tp_rank, f.tp_size, f.head_slice, f.model_digest)
        elif what == "record_logits":
            self.logits = xxhash.xxh3_128()
            answer = None
        elif what == "logits_digest":
            answer = None if self.logits is None else self.logits.hexdigest()
        elif what == "clear_cache":  # a probe: this rank alone drops its cached pages (its index then holds less)
            answer = e.clear_cache()
        else:
            answer = f"unknown query {what!r}"
        dist.gather_object(answer, None, dst=0, group=self.info.group)

