"""The ingress's host: what the chat routes need of an ``EngineHost`` (reserve, submit, abort, the tokenizer and
the context length), served by the engine deployment's replicas through a Ray Serve handle.

Rules and invariants:

* The waiting queue is bounded here, at the ingress, by the same ``WaitingQueue`` as one engine's host
  (``max_waiting``, each tenant's share), so a full deployment refuses before any prompt is built. A request
  counts as waiting until its first event arrives, then as running until its end.
* ``submit`` returns at once the queue the replica's events will arrive on (each engine step's events in one go,
  as ``EngineHost`` posts them); the routing key (``routing.RoutingKey``) is computed on the host's own thread,
  off the event loop, and then one ``EngineCall`` is sent.
* ``abort`` is pinned to the replica that holds the request (``Served``); before that is known, the stream is
  cancelled, which the replica turns into an abort. Either way the request's end still arrives on its queue:
  the replica's own abort event, or one made here for a stream cancelled before its replica answered.
* A replica that dies or stops answering ends its requests: one with no event yet fails with a 503
  (``ReplicaLost``, raised from the handler as ``AddFailed``), one under way ends with an error event carrying
  ``ReplicaLost``, so a stream ends with a retryable error object. Nothing is held here after either.
* A replica's refusal of a request (its ``AddFailed``, the error carried as its response: ``errors.carry``)
  arrives as the request's error end, so the handler answers it as one engine's refusal (400, 413, 503).
* ``merge_metrics`` adds every live replica's series, labelled ``replica``, to the ingress's own (``metrics``);
  ``headers`` names the replica that served a request (``x-mmcache-replica``).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import SimpleNamespace

from ..engine.request import RequestOutput, StreamEvent
from ..errors import MmcacheError
from ..server.engine_host import AddFailed, QueueFull, WaitingQueue
from ..server.errors import APIError, ReplicaLost, overloaded
from .engine_replica import Description, Served
from .metrics import merge_expositions
from .routing import EngineCall, RoutingKey, live_replicas

_log = logging.getLogger("mmcache.replicas")
ENDED_KEPT = 4096
"""Ended requests whose replica ``headers`` can still name (their handlers ask right after the first event)."""
SCRAPE_TIMEOUT_S = 3.0
"""How long ``/metrics`` waits for one replica's registry before leaving it out."""


@dataclass
class _Call:
    queue: asyncio.Queue
    owner: str | None
    stream: object = None  # the handle's response generator
    replica: str | None = None
    started: bool = False
    cancelled: bool = False
    reason: str | None = None
    output_ids: list = field(default_factory=list)


class RemoteHost:
    """Serves the chat routes from ``handle`` (the engine deployment's ``DeploymentHandle``) for the model
    ``description`` gives; ``text_prompts``: send each prompt's text too (for the prefix-text router)."""

    def __init__(self, handle, description: Description, deployment: str, config, key: RoutingKey,
                 owner_share: int | None = None, text_prompts: bool = False):
        self.handle = handle
        self.deployment = deployment
        self.key = key
        self.is_vlm = description.is_vlm
        self.core = SimpleNamespace(tokenizer=description.tokenizer, max_model_len=description.max_model_len)
        self.engine = SimpleNamespace(builder=SimpleNamespace(template=description.template))
        self._decoder = copy.deepcopy(description.tokenizer) if text_prompts else None
        self._queue = WaitingQueue(config.max_waiting, owner_share)
        self._lock = threading.Lock()  # the counts; every other state is the event loop's alone
        self._calls: dict[object, _Call] = {}
        self._tasks: set[asyncio.Task] = set()
        # computes routing keys off the event loop (tokenizing, rendering, hashing images), one at a time: a
        # Hugging Face tokenizer refuses two threads at once
        self._keys = ThreadPoolExecutor(1, thread_name_prefix="mmcache-routing")
        # where requests that ended before their handler asked (``headers``) ran; the oldest are dropped
        self._ended: OrderedDict = OrderedDict()
        self.running = 0
        self._stopping = False

    @property
    def waiting(self) -> int:
        return self._queue.waiting

    @property
    def alive(self) -> bool:
        return not self._stopping

    def headers(self, rid) -> dict:
        """``x-mmcache-replica``: the replica that holds (or held) ``rid``, once it has answered."""
        call = self._calls.get(rid)
        replica = call.replica if call is not None else self._ended.pop(rid, None)
        return {"x-mmcache-replica": replica} if replica else {}

    # ---- what EngineHost offers the routes ---------------------------------------------------------------
    def reserve(self, owner: str | None = None) -> None:
        with self._lock:
            self._refuse_if_full(owner)
            self._queue.count(owner, +1)

    def unreserve(self, owner: str | None = None) -> None:
        with self._lock:
            self._queue.count(owner, -1)

    def _refuse_if_full(self, owner) -> None:
        if self._stopping:
            raise QueueFull("the server is stopping")
        self._queue.refuse_if_full(owner)

    def submit(self, request, owner: str | None = None, reserved: bool = False, source=None) -> asyncio.Queue:
        rid = request.request_id
        with self._lock:
            if not reserved:
                self._refuse_if_full(owner)
            if rid in self._calls:
                if reserved:
                    self._queue.count(owner, -1)
                raise MmcacheError(f"request id {rid!r} is in use")
            if not reserved:
                self._queue.count(owner, +1)
        call = _Call(asyncio.Queue(), owner)
        self._calls[rid] = call
        task = asyncio.get_running_loop().create_task(
            self._pump(rid, call, request, getattr(source, "messages", None)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return call.queue

    def _engine_call(self, request, owner, messages) -> EngineCall:
        arrival = getattr(request, "arrival_time", None)
        age = 0.0 if arrival is None else max(0.0, time.perf_counter() - arrival)
        text = None
        if self._decoder is not None:
            text = getattr(request, "messages", None)
            if text is None:
                ids = getattr(request, "prompt", None)
                ids = ids if ids is not None else getattr(request, "token_ids", [])
                try:
                    text = ids if isinstance(ids, str) else self._decoder.decode(list(ids))
                except (OverflowError, TypeError, ValueError):  # ids no tokenizer holds: the replica refuses them
                    text = None
        try:
            name, overflow = self.key.of(request, messages)
        except MmcacheError:  # a prompt the replica will refuse, with the error it answers: routed by load
            name = overflow = None
        return EngineCall(request, owner, name, age, text, overflow)

    def abort(self, rid, reason: str | None = None) -> None:
        call = self._calls.get(rid)
        if call is None or call.cancelled:
            return
        call.cancelled, call.reason = True, reason
        if call.replica is None:
            if call.stream is not None:  # not sent yet: the pump sees ``cancelled`` before sending
                call.stream.cancel()
        else:
            self._abort_at_replica(rid, call)

    def _abort_at_replica(self, rid, call: _Call) -> None:
        """The abort, pinned to the replica holding ``rid``, sent without waiting for its answer."""
        response = self.handle.abort.remote(rid, call.reason, replica=call.replica)
        task = asyncio.get_running_loop().create_task(_settle(response))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _pump(self, rid, call: _Call, request, messages) -> None:
        from ray.serve.exceptions import RequestCancelledError

        ended = False
        try:
            engine_call = await asyncio.get_running_loop().run_in_executor(
                self._keys, self._engine_call, request, call.owner, messages)
            if call.cancelled:  # aborted while its key was computed: never sent
                self._finish(rid, call, "abort", None)
                ended = True
                return
            call.stream = self.handle.options(stream=True).generate.remote(engine_call)
            async for items in call.stream:
                if isinstance(items, Served):
                    call.replica = items.replica
                    if call.cancelled:  # aborted while its replica was not known: the cancel may come late
                        self._abort_at_replica(rid, call)
                    continue
                ended = self._deliver(rid, call, items)
                if ended:
                    break
        except asyncio.CancelledError:
            if call.stream is not None:
                call.stream.cancel()
            raise
        except RequestCancelledError:
            if not ended:
                self._finish(rid, call, "abort", None)
                ended = True
        except QueueFull as e:  # the replica's own queue was full
            call.queue.put_nowait(AddFailed(rid, overloaded(f"{e}", 1)))
            ended = True
        except Exception as e:  # the replica died, or its call failed
            _log.warning("request %s: its engine replica %s failed: %s: %s", rid, call.replica, type(e).__name__, e)
            lost = ReplicaLost(f"{type(e).__name__}")
            if call.started:
                self._finish(rid, call, "error", lost)
            else:
                call.queue.put_nowait(AddFailed(rid, _unavailable(lost)))
            ended = True
        finally:
            if not ended:  # the stream ended without the request's end: the replica went away
                self._finish(rid, call, "error", ReplicaLost("the stream ended early"))
            self._end(rid, call)

    def _deliver(self, rid, call: _Call, items: list) -> bool:
        """Put one step's items on the request's queue (in one go); True when they end it."""
        ended = False
        for item in items:
            if isinstance(item, StreamEvent):
                if not call.started:
                    call.started = True
                    with self._lock:
                        self._queue.count(call.owner, -1)
                        self.running += 1
                if item.token_id is not None:
                    call.output_ids.append(item.token_id)
                ended = ended or item.finished
            else:  # AddFailed, its error carried: answered as the engine's refusal of the request
                self._finish(rid, call, "error", item.error)
                return True
            call.queue.put_nowait(item)
        return ended

    def _finish(self, rid, call: _Call, reason: str, error) -> None:
        """Put an end made here on the queue (the replica sent none)."""
        now = time.perf_counter()
        output = RequestOutput(rid, 0, list(call.output_ids), 0, reason, error, now, None, [])
        call.queue.put_nowait(StreamEvent(rid, None, now, True, reason, output))

    def _end(self, rid, call: _Call) -> None:
        with self._lock:
            if self._calls.get(rid) is call:
                del self._calls[rid]
                if call.replica:
                    self._ended[rid] = call.replica
                    while len(self._ended) > ENDED_KEPT:
                        self._ended.popitem(last=False)
            if call.started:
                self.running -= 1
            else:
                self._queue.count(call.owner, -1)

    # ---- metrics and shutdown ----------------------------------------------------------------------------
    async def merge_metrics(self, own: bytes) -> bytes:
        """The ingress's exposition ``own`` with every live replica's series added, labelled ``replica``."""
        texts = {}
        # One replica at a time: the calls one handler makes share Ray Serve's internal request id, and a router
        # without Ray's FIFO matching (the prefix-text one) cannot tell two of them apart while both wait.
        for replica in live_replicas(self.deployment):
            try:
                got_id, text = await asyncio.wait_for(_settle(self.handle.metrics_text.remote(replica=replica)),
                                                      SCRAPE_TIMEOUT_S)
            except Exception as e:  # a replica dying or too slow: left out of this scrape
                _log.warning("metrics of replica %s left out: %s", replica, type(e).__name__)
                continue
            texts[got_id] = text
        return merge_expositions(own, texts)

    def stop(self) -> None:
        self._stopping = True
        for rid, call in list(self._calls.items()):
            self.abort(rid)
        self._keys.shutdown(wait=False, cancel_futures=True)


async def _settle(response):
    return await response


def _unavailable(err: ReplicaLost) -> APIError:
    from ..server.errors import from_engine_error

    return from_engine_error(err)
