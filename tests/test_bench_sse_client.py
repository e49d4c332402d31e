"""The low-load measurement's lean client (``benchmarks.sse_client``): against ``mmcache serve`` on the tiny text
preset it records what the ``openai`` client records (the same answer, usage and cached tokens); an error status
is recorded with the error object's type; and against a stub server on the loopback address, an error event, a
stream without ``[DONE]``, a body that is not an error object and a connection closed mid-stream each end as
``error``, never as ``ok``."""

import asyncio
import time

import aiohttp
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from benchmarks import loadgen, sse_client
from mmcache.engine.config import EngineConfig
from mmcache.presets import serve
from mmcache.server import ServerConfig

pytestmark = pytest.mark.usefixtures("one_thread")

KEY = "key-lean"
MESSAGES = [{"role": "system", "content": "You describe photos."},
            {"role": "user", "content": "A quiet harbour at dawn with three fishing boats and a lighthouse"}]


@pytest.fixture(scope="module")
def server(one_thread):
    with serve(ServerConfig(preset="tiny", api_keys=(KEY,), engine_config=EngineConfig(page_size=16))) as srv:
        yield srv
    srv.host.engine.check_invariants()


def _record() -> loadgen.Record:
    return loadgen.Record(0, 0, "", time.perf_counter())


async def _lean(url: str, body: dict, key: str = KEY) -> loadgen.Record:
    async with aiohttp.ClientSession() as session:
        return await sse_client.stream_chat(session, url, body, _record(), key)


async def _official(base_url: str, body: dict) -> loadgen.Record:
    api = openai.AsyncOpenAI(base_url=base_url, api_key=KEY, max_retries=0)
    try:
        extra = {k: body.pop(k) for k in ("cache_salt", "ignore_eos")}
        return await loadgen.stream_chat(api, dict(body, extra_body=extra), _record())
    finally:
        await api.close()


def _body(salt: str) -> dict:
    return {"model": "tiny", "messages": MESSAGES, "max_tokens": 5, "temperature": 0.0, "cache_salt": salt,
            "ignore_eos": True}


def test_the_lean_client_records_what_the_openai_client_records(server):
    url = server.base_url + "/chat/completions"
    lean = asyncio.run(_lean(url, _body("lean")))
    official = asyncio.run(_official(server.base_url, _body("official")))
    assert lean.outcome == official.outcome == "ok"
    assert lean.text == official.text and lean.text
    assert lean.prompt_tokens == official.prompt_tokens > 0
    assert lean.output_tokens == official.output_tokens == 5
    assert lean.cached_tokens == official.cached_tokens == 0  # each salt's first request
    assert lean.send < lean.first_chunk <= lean.first_token <= lean.token_times[-1] <= lean.end
    assert len(lean.token_times) == len(official.token_times)
    again = asyncio.run(_lean(url, _body("lean")))
    assert again.outcome == "ok" and again.text == lean.text
    assert again.cached_tokens > 0 and again.cached_tokens == asyncio.run(
        _official(server.base_url, _body("official"))).cached_tokens


def test_an_error_status_is_recorded_with_the_error_objects_type(server):
    url = server.base_url + "/chat/completions"
    wrong_key = asyncio.run(_lean(url, _body("x"), key="not-a-key"))
    assert (wrong_key.outcome, wrong_key.status, wrong_key.error) == ("error", 401, "authentication_error")
    bad = asyncio.run(_lean(url, dict(_body("x"), max_tokens=-1)))
    assert (bad.outcome, bad.status, bad.error) == ("error", 400, "invalid_request_error")
    assert bad.first_token is None and bad.ttft is None and bad.end is not None


# ---- a stub server: streams that end badly ---------------------------------------------------------------
CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'


def _stub_app() -> web.Application:
    async def error_event(request):
        return await _stream(request, [CHUNK, b'data: {"error":{"type":"internal_error","message":"boom"}}\n\n'])

    async def no_done(request):
        return await _stream(request, [CHUNK])

    async def cut(request):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        await response.write(CHUNK)
        request.transport.close()  # mid-stream, without the last chunk of the chunked body
        return response

    async def not_json(request):
        return web.Response(status=502, text="<html>bad gateway</html>")

    app = web.Application()
    for name, handler in (("error_event", error_event), ("no_done", no_done), ("cut", cut),
                          ("not_json", not_json)):
        app.router.add_post(f"/{name}", handler)
    return app


async def _stream(request, events: list[bytes]):
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for event in events:
        await response.write(event)
    await response.write_eof()
    return response


async def _against_stub(path: str) -> loadgen.Record:
    server = TestServer(_stub_app(), host="127.0.0.1")  # a free port on the loopback address
    await server.start_server()
    try:
        return await _lean(str(server.make_url(path)), {"model": "m", "messages": MESSAGES})
    finally:
        await server.close()


@pytest.mark.parametrize("path,error", [("/error_event", "internal_error"),
                                        ("/no_done", "stream ended without [DONE]"),
                                        ("/cut", "stream cut"), ("/not_json", "not an error object")])
def test_a_stream_that_ends_badly_is_an_error(path, error):
    record = asyncio.run(_against_stub(path))
    assert record.outcome == "error" and record.error.startswith(error), record.error
    if path != "/not_json":
        assert record.text == "hi" and record.output_tokens == 1  # what came before the end is kept
