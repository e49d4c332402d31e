"""Ray's own routers behind ``--replicas`` (in a module of its own: one Ray instance at a time): Ray Serve LLM's
prefix-text router routes completions from token ids and chats, on a text model and on a VLM; a prompt that has
no text for it (ids outside the vocabulary, a chat of images alone) is routed by load instead of held unrouted
inside Ray (its router divides by the text's length); and the ingress's scrape finds both replicas."""

import time

import httpx
import openai
import pytest

from mmcache.engine.config import EngineConfig
from mmcache.presets.serving import build_models
from mmcache.replicas.launch import ReplicaOptions, start_replicas
from mmcache.server import ServerConfig
from server_helpers import data_url, scrape

TIMEOUT_S = 60  # a request the router never sends waits this long, then fails the test


@pytest.fixture(scope="module", params=["tiny", "tiny-llava"])
def app(request):
    config = ServerConfig(preset=request.param, engine_config=EngineConfig(page_size=16, num_pages=256))
    with start_replicas(config, ReplicaOptions(replicas=2, router="prefix-text"), build_models) as srv:
        yield request.param, srv


def _client(srv):
    return openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=TIMEOUT_S)


def test_the_prefix_text_router_routes_text_prompts_and_chats(app):
    """It reads a call's ``messages`` (a chat's, or a text prompt's text) whatever else the call holds."""
    model, srv = app
    client = _client(srv)
    for i in range(3):
        out = client.completions.create(model=model, prompt=[5, 6, 7, 8, 9 + i] * 8, max_tokens=2)
        assert out.choices[0].finish_reason == "length"
        chat = client.chat.completions.create(model=model, max_tokens=2,
                                              messages=[{"role": "user", "content": f"hello {i} " * 10}])
        assert chat.choices[0].finish_reason == "length"
    deadline = time.monotonic() + 30  # a replica slow to answer (a loaded machine) is left out of one scrape
    while True:
        replicas = {s.labels.get("replica") for s in scrape(srv.url) if s.name == "mmcache:kv_pages_free"}
        if len(replicas) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(replicas) == 2 and None not in replicas


def test_a_prompt_without_text_is_answered_not_held_unrouted(app, datasets_dir):
    """Ids that decode to nothing, or that no tokenizer can decode, get the replica's own refusal (400) through the
    router, and on the VLM a chat of an image alone is answered; each twice, so the second finds whatever the first
    left in the router's tree."""
    model, srv = app
    for ids in ([10**9] * 20, [10**9] * 20, [2**40] * 20, [2**40] * 20):
        r = httpx.post(srv.base_url + "/completions", timeout=TIMEOUT_S,
                       json={"model": model, "prompt": ids, "max_tokens": 2})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "prompt" or "vocabulary" in r.json()["error"]["message"], r.text
    if model != "tiny-llava":
        return
    photo = data_url((datasets_dir / "images" / "chelsea.png").read_bytes())
    for _ in range(2):
        out = _client(srv).chat.completions.create(
            model=model, max_tokens=2,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": photo}}]}])
        assert out.choices[0].finish_reason == "length"
