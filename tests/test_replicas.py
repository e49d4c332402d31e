"""``mmcache serve --replicas 2`` on a local Ray instance started by the test (the tiny LLaVA preset, two API
keys, mmcache's router): a chat with an image stays on one replica and its second turn hits the cache; distinct
chats spread over both replicas; two tenants never share pages; /metrics shows both replicas' series; a
replica killed mid-stream ends that stream with a retryable error object, and later requests succeed; nothing
is held afterwards. Without Ray, ``--replicas`` names the extra. The router's own rules (no per-prefix state)
are tested in test_router.py and test_replica_routing.py."""

import importlib.util
import time

import httpx
import openai
import pytest

from mmcache.engine.config import EngineConfig
from mmcache.presets.serving import build_models
from mmcache.replicas.launch import ReplicaOptions, start_replicas
from mmcache.server import ServerConfig
from server_helpers import data_url, metric, scrape

MODEL = "tiny-llava"
KEYS = ("key-alpha", "key-beta")
REPLICA = "x-mmcache-replica"


@pytest.fixture(scope="module")
def app():
    config = ServerConfig(preset=MODEL, api_keys=KEYS, engine_config=EngineConfig(page_size=16, num_pages=512),
                          body_timeout_s=2.0)
    with start_replicas(config, ReplicaOptions(replicas=2), build_models) as srv:
        yield srv


@pytest.fixture(scope="module")
def photos(datasets_dir):
    return [data_url((datasets_dir / "images" / f"{name}.png").read_bytes())
            for name in ("astronaut", "chelsea", "coffee")]


def _client(app, key=KEYS[0]):
    return openai.OpenAI(base_url=app.base_url, api_key=key, max_retries=0, timeout=120)


def _chat(client, messages, max_tokens=4):
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                                          temperature=0, extra_body={"return_token_ids": True})
    return raw.headers[REPLICA], raw.parse()


def _held(app) -> float:
    """KV pages live over every replica (after their requests ended)."""
    samples = scrape(app.url)
    return sum(s.value for s in samples if s.name == "mmcache:kv_pages_live")


def test_one_chat_with_an_image_stays_on_one_replica_and_hits(app, photos):
    client = _client(app)
    turn = [{"role": "user", "content": [{"type": "text", "text": "What is in this photo?"},
                                         {"type": "image_url", "image_url": {"url": photos[0]}}]}]
    first, out = _chat(client, turn)
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    answer = {"role": "assistant", "content": out.choices[0].message.content,
              "token_ids": out.choices[0].token_ids}
    turn2 = turn + [answer, {"role": "user", "content": "And its colours?"}]
    second, out2 = _chat(client, turn2)
    assert second == first
    assert out2.usage.prompt_tokens_details.cached_tokens > 0
    turn3 = turn2 + [{"role": "assistant", "content": out2.choices[0].message.content,
                      "token_ids": out2.choices[0].token_ids}, {"role": "user", "content": "Thanks."}]
    third, out3 = _chat(client, turn3)
    assert third == first
    assert out3.usage.prompt_tokens_details.cached_tokens > out2.usage.prompt_tokens_details.cached_tokens


def test_distinct_chats_spread_over_both_replicas(app, photos):
    client = _client(app)
    seen = []
    for i in range(40):
        text = f"Chat number {i}: describe the picture in {i % 7 + 2} words, please, with care."
        replica, _ = _chat(client, [{"role": "user", "content": [
            {"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": photos[i % 3]}}]}],
            max_tokens=1)
        seen.append(replica)
    counts = {r: seen.count(r) for r in set(seen)}
    assert len(counts) == 2, counts
    assert max(counts.values()) <= 30, counts  # neither takes more than 75%


def test_two_tenants_never_share_pages(app):
    prompt = [{"role": "user", "content": "A question both tenants ask, long enough to fill pages: " * 3}]
    _, alpha1 = _chat(_client(app, KEYS[0]), prompt)
    _, alpha2 = _chat(_client(app, KEYS[0]), prompt)
    _, beta = _chat(_client(app, KEYS[1]), prompt)
    assert alpha1.usage.prompt_tokens_details.cached_tokens == 0
    assert alpha2.usage.prompt_tokens_details.cached_tokens > 0
    assert beta.usage.prompt_tokens_details.cached_tokens == 0


def test_metrics_show_every_replica_and_nothing_is_held(app):
    deadline = time.monotonic() + 30
    while True:
        samples = scrape(app.url)
        replicas = {s.labels.get("replica") for s in samples if s.name == "mmcache:kv_pages_free"}
        if len(replicas) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(replicas) == 2 and None not in replicas
    assert metric(samples, "mmcache:prefix_cache_hits_total", replica=sorted(replicas)[0]) >= 0
    assert _held(app) == 0


def test_models_health_and_errors_are_the_servers(app):
    assert httpx.get(app.url + "/health").status_code == 200
    assert [m.id for m in _client(app).models.list().data] == [MODEL]
    with pytest.raises(openai.AuthenticationError):
        _client(app, "wrong").models.list()
    r = httpx.post(app.base_url + "/chat/completions", headers={"Authorization": f"Bearer {KEYS[0]}"},
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


@pytest.mark.parametrize("content, code", [
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}], "invalid_image"),
    ([{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}], "invalid_image_url"),
])
def test_bad_input_gets_the_single_servers_error_through_a_replica(app, content, code):
    for stream in (False, True):
        r = httpx.post(app.base_url + "/chat/completions", headers={"Authorization": f"Bearer {KEYS[0]}"},
                       timeout=60, json={"model": MODEL, "messages": [{"role": "user", "content": content}],
                                         "stream": stream})
        assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text
    bad_answer = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", "token_ids": [10**9]},
                  {"role": "user", "content": "again"}]
    r = httpx.post(app.base_url + "/chat/completions", headers={"Authorization": f"Bearer {KEYS[0]}"},
                   timeout=60, json={"model": MODEL, "messages": bad_answer})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert metric(scrape(app.url), "mmcache:request_errors_total", error_type="internal_error") == 0


def test_a_body_that_stalls_is_answered_not_held(app):
    """Ray's proxy has no body deadline: the ingress gives up on a body that pauses past ``--body-timeout``."""
    import socket

    host, port = app.url.split("//")[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + KEYS[0].encode() + b"\r\nContent-Length: 1000\r\n\r\n{")
        answer = s.recv(200)  # a socket.timeout here (60 s) is the failure: the body held forever
    assert answer.startswith(b"HTTP/1.1 4"), answer


def test_a_stop_string_ends_the_request_on_its_replica(app):
    client = _client(app)
    messages = [{"role": "user", "content": "Say something for the stop test."}]
    _, whole = _chat(client, messages, max_tokens=24)
    text = whole.choices[0].message.content
    stop = next((text[i:i + 2] for i in range(4, len(text) - 2) if text[i:i + 2].strip() and
                 text.find(text[i:i + 2]) == i), None)
    if stop is None:
        pytest.skip(f"the answer {text!r} has no unique two-character stop string")
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0, stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content == text[:text.find(stop)]
    _wait_nothing_held(app)


def test_a_client_that_goes_away_mid_stream_frees_what_its_request_held(app):
    with httpx.stream("POST", app.base_url + "/chat/completions", timeout=60,
                      headers={"Authorization": f"Bearer {KEYS[0]}"},
                      json={"model": MODEL, "messages": [{"role": "user", "content": "A long answer, please."}],
                            "max_tokens": 400, "ignore_eos": True, "stream": True}) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    # the connection is closed here, mid-stream: the request is aborted on its replica (not an error)
    _wait_nothing_held(app)
    assert metric(scrape(app.url), "mmcache:request_errors_total", error_type="internal_error") == 0


def _wait_nothing_held(app, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _held(app) != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _held(app) == 0


def test_a_replica_killed_mid_stream_ends_the_stream_with_an_error_then_requests_succeed(app):
    import ray

    client = _client(app)
    with client.chat.completions.with_streaming_response.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell me a very long story."}], max_tokens=400,
            temperature=0, stream=True, extra_body={"ignore_eos": True}) as response:
        replica = response.headers[REPLICA]
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        (name,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["namespace"] == "serve" and a["name"].endswith(replica)]
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        rest = [line for line in lines if line.startswith("data: ")]
    errors = [line for line in rest if '"error"' in line]
    assert errors and '"replica_unavailable"' in errors[0], rest[-3:]
    assert rest[-1] == "data: [DONE]"
    for i in range(4):  # the living replica (or its replacement) answers
        _, out = _chat(client, [{"role": "user", "content": f"after the kill {i}"}], max_tokens=2)
        assert out.choices[0].finish_reason in ("length", "stop")
    deadline = time.monotonic() + 90  # Ray Serve replaces the dead replica
    while time.monotonic() < deadline:
        replicas = {s.labels.get("replica") for s in scrape(app.url) if s.name == "mmcache:kv_pages_free"}
        if len(replicas) == 2 and replica not in replicas:
            break
        time.sleep(1)
    assert len(replicas) == 2 and replica not in replicas, replicas


def test_replicas_without_ray_names_the_extra(monkeypatch, capsys):
    from mmcache.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name.startswith("ray") else
                        real(name, *a))
    assert main(["serve", "--preset", "tiny", "--replicas", "2"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'mmcache[ray]'" in err

