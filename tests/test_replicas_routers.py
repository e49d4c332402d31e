"""Ray's own routers behind ``--replicas`` (in a module of its own: one Ray instance a module): Ray Serve LLM's
prefix-text router routes completions from token ids and chats, and the ingress's scrape finds both replicas."""

import time

import openai

from mmcache.engine.config import EngineConfig
from mmcache.presets.serving import build_models
from mmcache.replicas.launch import ReplicaOptions, start_replicas
from mmcache.server import ServerConfig
from server_helpers import scrape


def test_the_prefix_text_router_routes_text_prompts_and_chats():
    """It reads a call's ``messages`` (a chat's, or a text prompt's text) whatever else the call holds."""
    config = ServerConfig(preset="tiny", engine_config=EngineConfig(page_size=16, num_pages=256))
    with start_replicas(config, ReplicaOptions(replicas=2, router="prefix-text"), build_models) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=60)
        for i in range(3):
            out = client.completions.create(model="tiny", prompt=[5, 6, 7, 8, 9 + i] * 8, max_tokens=2)
            assert out.choices[0].finish_reason == "length"
            chat = client.chat.completions.create(model="tiny", max_tokens=2,
                                                  messages=[{"role": "user", "content": f"hello {i} " * 10}])
            assert chat.choices[0].finish_reason == "length"
        deadline = time.monotonic() + 30  # a replica slow to answer (a loaded machine) is left out of one scrape
        while True:
            replicas = {s.labels.get("replica") for s in scrape(srv.url) if s.name == "mmcache:kv_pages_free"}
            if len(replicas) == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert len(replicas) == 2 and None not in replicas
