"""One engine replica of the Ray Serve application: the chat engine ``build`` makes from the server's config,
with its own store, pools and ``EngineHost`` (as the single-process server has them), answering the ingress.

Rules:

* ``generate`` takes one ``EngineCall`` and streams lists of the host's queue items (``StreamEvent``s, or one
  ``AddFailed``), each list what one engine step posted for the request, so the ingress receives a step's
  events together. An error travels as the response it maps to (``errors.carry``): not every error type a
  request can end with pickles. Its first item is ``Served(replica id)``, sent as soon as the request is submitted, so the
  ingress can pin an abort to this replica before any token.
* However the stream ends before the request's own end (the ingress cancelled it, or went away), the request
  is aborted here: it returns its pages and store leases.
* ``abort`` ends a request this replica holds (harmless for one it does not); ``metrics_text`` is this
  replica's Prometheus registry (its engine, pools and store, and the latencies of the requests it ran).
* ``check_health`` (Ray Serve calls it) fails once the step loop has stopped, so Ray Serve replaces the replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass

from ..server.engine_host import AddFailed, EngineHost
from ..server.errors import carry
from ..server.metrics import ServerMetrics


@dataclass(frozen=True)
class Served:
    """The first item of a replica's stream: which replica holds the request."""

    replica: str


@dataclass(frozen=True)
class Description:
    """What the ingress needs of the served model, sent once by a replica: the tokenizer, the context length,
    whether it is a VLM and its chat template (None for a text model), and the engine's page size."""

    tokenizer: object
    max_model_len: int
    is_vlm: bool
    template: object
    page_size: int


class EngineReplica:
    """The engine deployment's class (``build(config)`` returns the ``Models`` whose chat engine it serves)."""

    def __init__(self, config, build):
        from ray import serve

        self.config = config
        engine = build(config).engine
        self.host = EngineHost(engine, max_waiting=config.max_waiting)
        self.metrics = ServerMetrics(self.host, config.chat_model_name, getattr(engine, "store", None))
        self.host.observe = self.metrics.observe
        self.host.start()
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    def describe(self) -> Description:
        core = self.host.core
        template = self.host.engine.builder.template if self.host.is_vlm else None
        return Description(core.tokenizer, core.max_model_len, self.host.is_vlm, template,
                           core.config.page_size)

    async def generate(self, call):
        request = call.request
        if getattr(request, "arrival_time", None) is not None:  # this process's clock: the same age
            request = dataclasses.replace(request, arrival_time=time.perf_counter() - call.age_s)
        rid = request.request_id
        queue = self.host.submit(request, call.owner)
        ended = False
        try:
            yield Served(self.replica_id)
            while not ended:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                ended = any(isinstance(item, AddFailed) or item.finished for item in items)
                yield [_carried(item) for item in items]
        finally:
            if not ended:
                self.host.abort(rid)

    def abort(self, rid, reason: str | None = None, replica: str | None = None) -> None:
        """``replica`` pins the call to this replica (the routers read it); it is not used here."""
        self.host.abort(rid, reason)

    async def metrics_text(self, replica: str | None = None) -> tuple[str, bytes]:
        """This replica's id and exposition, rendered off the event loop (reading the engine's counts waits for
        the step under way, and the loop streams every request's events)."""
        return self.replica_id, await asyncio.to_thread(self.metrics.render)

    def check_health(self) -> None:
        if not self.host.alive:
            raise RuntimeError("the engine's step loop is not running")

    def __del__(self):
        host = getattr(self, "host", None)
        if host is not None:
            host.stop()



def _carried(item):
    """``item`` with its error, if any, made a ``CarriedError``."""
    if isinstance(item, AddFailed):
        return AddFailed(item.request_id, carry(item.error))
    if item.finished and item.output is not None and item.output.error is not None:
        return dataclasses.replace(item, output=dataclasses.replace(item.output, error=carry(item.output.error)))
    return item
