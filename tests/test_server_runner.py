"""The engine host without HTTP, over the tiny text engine: ``submit`` returns before the request is added (the
event loop is not woken by the add, only by the first token), an abort that the step thread applies while the
request is still being added ends it once the add returns, an ``add_request`` that raises reaches the handler
as its error with nothing counted, and ``stop`` lets an add under way finish and then aborts it."""

import asyncio
import threading

import pytest

from mmcache.engine.config import EngineConfig
from mmcache.engine.request import Request, SamplingParams
from mmcache.presets import engine_from_preset
from mmcache.server.text_output import TextOutput
from mmcache.server.engine_host import AddFailed, EngineHost, QueueFull

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_TOKENS = 48


class GatedEngine:
    """The real engine, except that ``add_request`` waits for ``gate`` (and then raises ``fail`` if set, else
    sets ``added`` once added), and ``aborted`` is set once an abort has been applied."""

    def __init__(self, engine):
        self.engine = engine
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.aborted = threading.Event()
        self.added = threading.Event()
        self.fail: BaseException | None = None

    def add_request(self, request):
        self.entered.set()
        self.gate.wait()
        if self.fail is not None:
            raise self.fail
        out = self.engine.add_request(request)
        self.added.set()
        return out

    def abort(self, request_id) -> bool:
        found = self.engine.abort(request_id)
        self.aborted.set()
        return found

    def __getattr__(self, name):
        return getattr(self.engine, name)


@pytest.fixture()
def gated():
    engine = GatedEngine(engine_from_preset("tiny", config=EngineConfig(page_size=16, num_pages=64)))
    yield engine
    engine.gate.set()  # never leave an intake thread waiting
    assert not engine.has_unfinished()
    engine.check_invariants()


def _request(rid: str) -> Request:
    return Request(list(range(3, 40)), SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True), rid)


async def _until_finished(queue: asyncio.Queue) -> list:
    events = [await queue.get()]
    while not events[-1].finished:
        events.append(await queue.get())
    return events


def test_submit_returns_before_the_request_is_added(gated):
    host = EngineHost(gated).start()

    async def scenario():
        queue = host.submit(_request("r1"))
        assert isinstance(queue, asyncio.Queue)  # returned while add_request is still blocked
        await asyncio.to_thread(gated.entered.wait)
        assert host.waiting == 1 and not gated.engine.has_unfinished()
        gated.gate.set()
        return await _until_finished(queue)

    try:
        events = asyncio.run(scenario())
    finally:
        host.stop()
    assert [e.finish_reason for e in events[-1:]] == ["length"] and len(events[-1].output.output_ids) == MAX_TOKENS
    assert host.waiting == 0 and host.running == 0


def test_an_abort_applied_while_adding_ends_the_request_once_added(gated):
    host = EngineHost(gated).start()

    async def scenario():
        queue = host.submit(_request("r2"))
        await asyncio.to_thread(gated.entered.wait)
        host.abort("r2")
        await asyncio.to_thread(gated.aborted.wait)  # the step thread tried to abort it: nothing was live yet
        assert not gated.engine.has_unfinished()
        gated.gate.set()
        return await _until_finished(queue)

    try:
        events = asyncio.run(scenario())
    finally:
        host.stop()
    assert events[-1].finish_reason == "abort" and len(events[-1].output.output_ids) < MAX_TOKENS
    assert host.waiting == 0 and host.running == 0


def test_an_add_that_raises_reaches_the_handler(gated):
    host = EngineHost(gated).start()
    gated.fail = RuntimeError("the engine refused it")
    gated.gate.set()

    async def scenario():
        queue = host.submit(_request("r3"))
        item = await queue.get()
        assert isinstance(item, AddFailed) and item.request_id == "r3"
        queue.put_nowait(item)
        with pytest.raises(RuntimeError, match="refused"):
            await TextOutput(host, "r3", queue, [], None).first()

    try:
        asyncio.run(scenario())
        assert host.waiting == 0 and host.running == 0
        gated.fail = None

        async def again():  # the id is free again and the host still serves
            return await _until_finished(host.submit(_request("r3")))

        assert asyncio.run(again())[-1].finish_reason == "length"
    finally:
        host.stop()


def test_stop_lets_an_add_finish_then_aborts_it(gated):
    host = EngineHost(gated).start()

    async def scenario():
        queue = host.submit(_request("r4"))
        await asyncio.to_thread(gated.entered.wait)
        def stop() -> bool:
            host.stop()
            return gated.added.is_set()

        stopping = asyncio.ensure_future(asyncio.to_thread(stop))
        while host.alive:  # stop has begun: it now waits for the add under way
            await asyncio.sleep(0.001)
        with pytest.raises(QueueFull):
            host.submit(_request("r5"))
        gated.gate.set()
        assert await stopping  # stop returned only once the add under way had finished
        assert not gated.engine.has_unfinished()  # added after the step loop ended, and aborted by stop
        return await _until_finished(queue)

    events = asyncio.run(scenario())
    assert events[-1].finish_reason == "abort"
    assert host.waiting == 0 and host.running == 0
