"""The server against hostile clients, over HTTP: each case does what an attacker would and checks that the
work it causes is bounded before it is done (the answer's status and code), and that an unrelated request on
another connection is answered in the same test. Every loop here is bounded in count and time, and traffic goes
to the loopback address only."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest

from mmcache.presets import serve
from mmcache.server import ServerConfig
from benchmarks.hostile import bomb_png
from server_helpers import data_url, error_of, metric, wait_quiet

pytestmark = pytest.mark.usefixtures("one_thread")

KEYS = ("key-a", "key-b")
A = {"Authorization": "Bearer key-a"}
B = {"Authorization": "Bearer key-b"}
METRICS_KEY = "scrape-key"


@pytest.fixture(scope="module")
def text_server(one_thread):
    config = ServerConfig(preset="tiny", api_keys=KEYS, max_waiting=4, header_timeout_s=0.5, body_timeout_s=0.5,
                          max_connections=24, metrics_key=METRICS_KEY)
    with serve(config) as srv:
        yield srv
    srv.host.engine.check_invariants()


def _host_port(srv) -> tuple[str, int]:
    host, port = srv.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


async def _beside(srv, hostile, unrelated=None):
    """Run the coroutine ``hostile(client)`` and, once it has started, an unrelated request on another
    connection: (hostile's result, the unrelated response)."""
    async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c1, \
            httpx.AsyncClient(base_url=srv.url, timeout=60) as c2:
        task = asyncio.ensure_future(hostile(c1))
        await asyncio.sleep(0.05)
        other = await (unrelated(c2) if unrelated else c2.get("/health"))
        return await task, other


def _metrics(srv) -> list:
    """Every sample of /metrics, scraped with the metrics key."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {METRICS_KEY}"}).text
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


# ---- 1. text is refused by its length before any tokenizer runs, and tokenized off the event loop --------------
def test_a_huge_prompt_is_refused_before_tokenizing(text_server, monkeypatch):
    prompts = text_server.app.state.api.chat.prompts
    built = []
    monkeypatch.setattr(prompts, "completion", lambda *a: built.append(a))
    monkeypatch.setattr(prompts, "chat", lambda *a: built.append(a))
    huge = "a kite " * (4 * 2**20 // 7)

    async def hostile(c):
        return [await c.post("/v1/completions", headers=A, json={"model": "tiny", "prompt": huge}),
                await c.post("/v1/chat/completions", headers=A,
                             json={"model": "tiny", "messages": [{"role": "user", "content": huge}]})]

    (completion, chat), health = asyncio.run(_beside(text_server, hostile))
    for response, param in ((completion, "prompt"), (chat, "messages")):
        assert response.status_code == 400
        err = error_of(response)
        assert err["code"] == "context_length_exceeded" and err["param"] == param
    assert built == [] and health.status_code == 200


def test_prompts_are_tokenized_on_the_prompt_thread(text_server, monkeypatch):
    prompts = text_server.app.state.api.chat.prompts
    threads = []
    encode = type(prompts.encoder).__call__

    def recording(self, *args, **kwargs):
        threads.append(threading.current_thread().name)
        return encode(self, *args, **kwargs)

    monkeypatch.setattr(type(prompts.encoder), "__call__", recording)
    r = httpx.post(text_server.url + "/v1/completions", headers=A, timeout=60,
                   json={"model": "tiny", "prompt": "a red kite", "max_tokens": 2})
    assert r.status_code == 200
    assert threads and all(name.startswith("mmcache-prompts") for name in threads)


# ---- 2. stop strings: bounded in length, checked incrementally ------------------------------------------------
def test_long_stop_strings_are_refused(text_server):
    body = {"model": "tiny", "prompt": "a red kite", "max_tokens": 4, "stop": ["x" * 8000] * 8}
    r = httpx.post(text_server.url + "/v1/completions", headers=A, json=body, timeout=60)
    assert r.status_code == 400 and error_of(r)["param"] == "stop"
    body["stop"] = ["x" * text_server.config.max_stop_chars] * 8
    r = httpx.post(text_server.url + "/v1/completions", headers=A, json=body, timeout=60)
    assert r.status_code == 200


# ---- 4. idle and partial connections are timed out; connections are capped ------------------------------------
def _closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """Whether the server closes ``sock`` (EOF or reset) within ``within_s`` seconds."""
    sock.settimeout(within_s)
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_half_sent_headers_and_bodies_are_cut(text_server):
    addr = _host_port(text_server)
    half_header = socket.create_connection(addr)
    half_header.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
    half_body = socket.create_connection(addr)
    half_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer key-a\r\n"
                      b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\": \"tiny\", ")
    try:
        assert _closed_by_server(half_header, within_s=20)
        assert _closed_by_server(half_body, within_s=20)
    finally:
        half_header.close()
        half_body.close()
    assert httpx.get(text_server.url + "/health").status_code == 200
    samples = _metrics(text_server)
    assert metric(samples, "mmcache:connection_timeouts_total", phase="header") >= 1
    assert metric(samples, "mmcache:connection_timeouts_total", phase="body") >= 1
    wait_quiet(text_server.host)  # the cut body submitted nothing
    text_server.host.engine.check_invariants()


def test_connections_beyond_the_cap_get_503_and_the_server_recovers(text_server):
    addr = _host_port(text_server)
    cap = text_server.config.max_connections
    held = []
    try:
        for _ in range(cap):
            held.append(socket.create_connection(addr))
        extra = socket.create_connection(addr)
        extra.settimeout(20)
        answer = b""
        while chunk := extra.recv(4096):
            answer += chunk
        extra.close()
        assert answer.startswith(b"HTTP/1.1 503") and b"too_many_connections" in answer
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 20
    while True:  # the held connections close; the server answers again
        try:
            if httpx.get(text_server.url + "/health").status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.05)


# ---- fairness: each tenant has its share of the waiting queue ---------------------------------------------------
def test_one_tenant_cannot_fill_the_waiting_queue(text_server):
    host = text_server.host
    share = host.owner_share
    assert share == 2  # max_waiting 4 over two keys
    body = {"model": "tiny", "prompt": "a cup of tea", "max_tokens": 2}

    async def scenario():
        async with httpx.AsyncClient(base_url=text_server.url, timeout=60) as c:
            with host.hold():
                queued = [asyncio.ensure_future(c.post("/v1/completions", headers=A, json=body))
                          for _ in range(share)]
                while host.waiting < share:
                    await asyncio.sleep(0.01)
                refused = await c.post("/v1/completions", headers=A, json=body)
                other = asyncio.ensure_future(c.post("/v1/completions", headers=B, json=body))
                while host.waiting < share + 1 and not other.done():
                    await asyncio.sleep(0.01)
            return refused, await other, await asyncio.gather(*queued)

    refused, other, served = asyncio.run(scenario())
    assert refused.status_code == 503 and error_of(refused)["code"] == "queue_full"
    assert "tenant" in error_of(refused)["message"]
    assert other.status_code == 200 and [r.status_code for r in served] == [200] * share
    wait_quiet(host)


# ---- /metrics behind its own key when one is set --------------------------------------------------------------
def test_metrics_can_be_put_behind_a_key(text_server):
    assert httpx.get(text_server.url + "/metrics").status_code == 401
    assert httpx.get(text_server.url + "/metrics", headers=A).status_code == 401  # a tenant's key is not it
    r = httpx.get(text_server.url + "/metrics", headers={"Authorization": f"Bearer {METRICS_KEY}"})
    assert r.status_code == 200 and "mmcache:request_errors_total" in r.text


# ---- 3, 5, 6, 7, 8: the media and generation routes ---------------------------------------------------------------
@pytest.fixture(scope="module")
def media_server(one_thread):
    config = ServerConfig(preset="tiny-llava", diffusion=("tiny-sd3", "tiny-wan"), tts="tiny-csm", api_keys=KEYS,
                          store_bytes=64 * 2**20, image_sizes=("16x16",))
    with serve(config) as srv:
        yield srv
    srv.host.engine.check_invariants()


def test_image_bombs_are_refused_from_their_headers(media_server):
    content = [{"type": "image_url", "image_url": {"url": data_url(bomb_png(7071, mark))}} for mark in range(2)]
    body = {"model": "tiny-llava", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
    before = media_server.host.engine.metrics()["encoder"]

    async def hostile(c):
        return await c.post("/v1/chat/completions", headers=A, json=body)

    bombed, health = asyncio.run(_beside(media_server, hostile))
    assert bombed.status_code == 413 and health.status_code == 200
    after = media_server.host.engine.metrics()["encoder"]
    assert after["computes"] == before["computes"] and after["inserts"] == before["inserts"]  # no tower ran
    assert after["requests_holding"] == 0
    wait_quiet(media_server.host)


def test_a_long_ref_text_is_refused_before_the_clip_is_decoded(media_server):
    import base64
    import io

    import numpy as np
    import soundfile

    buf = io.BytesIO()
    soundfile.write(buf, np.zeros(8000, dtype=np.float32), 16000, format="WAV")
    body = {"model": "tiny-csm", "input": "Hello there.", "ref_text": "word " * 200_000,
            "ref_audio": "data:audio/wav;base64," + base64.b64encode(buf.getvalue()).decode()}

    async def hostile(c):
        return await c.post("/v1/audio/speech", headers=A, json=body)

    refused, health = asyncio.run(_beside(media_server, hostile))
    assert refused.status_code == 400 and error_of(refused)["param"] == "ref_text"
    assert health.status_code == 200 and media_server.services["speech"].queue.waiting == 0


@pytest.mark.parametrize("route, body, param", [
    ("/v1/images/generations", {"prompt": "a kite " * 600_000}, "prompt"),
    ("/v1/images/generations", {"prompt": "a kite", "negative_prompt": "blur " * 10_000}, "negative_prompt"),
    ("/v1/videos", {"prompt": "a kite " * 150_000}, "prompt"),
    ("/v1/images/generations", {"prompt": "a kite", "guidance_scale": 1e308}, "guidance_scale"),
    ("/v1/videos", {"prompt": "a kite", "guidance_scale": 1e308}, "guidance_scale"),
])
def test_generation_prompts_and_numbers_are_bounded(media_server, route, body, param):
    async def hostile(c):
        return await c.post(route, headers=A, json=body)

    refused, health = asyncio.run(_beside(media_server, hostile))
    assert refused.status_code == 400 and error_of(refused)["param"] == param
    assert health.status_code == 200
    assert httpx.get(media_server.url + "/v1/videos", headers=A).json()["data"] == []  # no job was made


def test_deeply_nested_json_is_400_on_every_route(media_server):
    nested = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    routes = ("/v1/videos", "/v1/videos/sync", "/v1/images/generations", "/v1/audio/speech",
              "/v1/chat/completions", "/v1/completions")

    async def hostile(c):
        return [await c.post(route, headers={**A, "Content-Type": "application/json"}, content=nested)
                for route in routes]

    answers, health = asyncio.run(_beside(media_server, hostile))
    assert [r.status_code for r in answers] == [400] * len(routes)
    assert {error_of(r)["code"] for r in answers} == {"invalid_json"} and health.status_code == 200


# ---- the options ------------------------------------------------------------------------------------------------
def test_the_hardening_options_reach_the_config_and_are_checked():
    from mmcache.cli import build_parser
    from mmcache.server.cli import config_from_args
    from mmcache.server.config import ServerConfigError

    args = build_parser().parse_args([
        "serve", "--preset", "tiny", "--max-waiting-per-tenant", "3", "--max-prompt-chars", "5000",
        "--max-stop-chars", "64", "--header-timeout", "2.5", "--body-timeout", "4", "--max-connections", "100",
        "--metrics-key", "k"])
    config = config_from_args(args)
    assert (config.max_waiting_per_tenant, config.max_prompt_chars, config.max_stop_chars) == (3, 5000, 64)
    assert (config.header_timeout_s, config.body_timeout_s, config.max_connections) == (2.5, 4.0, 100)
    assert config.metrics_key == "k"
    for bad in (dict(header_timeout_s=0), dict(body_timeout_s=float("inf")), dict(max_connections=0),
                dict(max_stop_chars=0), dict(max_prompt_chars=0), dict(max_waiting_per_tenant=-1),
                dict(metrics_key="")):
        with pytest.raises(ServerConfigError):
            ServerConfig(preset="tiny", **bad)
    for option in ("--header-timeout", "--max-connections", "--max-stop-chars"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--preset", "tiny", option, "0"])


def test_a_full_queue_refuses_before_the_prompt_is_built(text_server, monkeypatch):
    host, prompts = text_server.host, text_server.app.state.api.chat.prompts
    built = []
    completion = prompts.completion
    monkeypatch.setattr(prompts, "completion", lambda *a: built.append(1) or completion(*a))
    body = {"model": "tiny", "prompt": "a cup of tea", "max_tokens": 2}

    async def scenario():
        async with httpx.AsyncClient(base_url=text_server.url, timeout=60) as c:
            with host.hold():
                queued = [asyncio.ensure_future(c.post("/v1/completions", headers=A, json=body))
                          for _ in range(host.owner_share)]
                while host.waiting < host.owner_share:
                    await asyncio.sleep(0.01)
                refused = await c.post("/v1/completions", headers=A, json=body)
                built_when_refused = len(built)
            return refused, built_when_refused, await asyncio.gather(*queued)

    refused, built_when_refused, served = asyncio.run(scenario())
    assert refused.status_code == 503 and built_when_refused == host.owner_share  # the refused one built nothing
    assert [r.status_code for r in served] == [200] * host.owner_share
    # a request refused while its prompt is built gives its place back
    bad = {"model": "tiny", "messages": [{"role": "user", "content": "hi", "token_ids": [1, 2]}]}
    r = httpx.post(text_server.url + "/v1/chat/completions", headers=A, json=bad, timeout=60)
    assert r.status_code == 400 and error_of(r)["param"] == "messages.0.token_ids"
    wait_quiet(host)
    assert host.waiting == 0 and host._queue._by_owner == {}
