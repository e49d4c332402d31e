"""``benchmarks.serve_process``: the benchmark's server in its own process serves the OpenAI API, reports what it
holds once idle (nothing, invariants checked in the child) and ends with the block; a server that cannot start
raises ``ServerProcessError`` with the child's error."""

import socket

import httpx
import pytest

from benchmarks.serve_process import ServerProcess, ServerProcessError
from mmcache.engine.config import EngineConfig
from mmcache.server import ServerConfig


def _config(**changes) -> ServerConfig:
    return ServerConfig(preset="tiny-llava", engine_config=EngineConfig(page_size=16, num_pages=64), **changes)


def test_a_server_in_its_own_process_serves_then_holds_nothing():
    with ServerProcess(_config(), threads=1) as srv:
        assert srv.base_url == srv.url + "/v1"
        body = {"model": "tiny-llava", "messages": [{"role": "user", "content": "Say something."}],
                "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        r = httpx.post(srv.base_url + "/chat/completions", json=body, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert srv.check_idle() == {"requests": 0, "pages": 0, "store_leases": 0, "requests_holding_leases": 0}
        process = srv._proc
    assert not process.is_alive() and process.exitcode == 0


def test_a_server_that_cannot_start_raises_its_error():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        with pytest.raises(ServerProcessError, match="OSError"):
            with ServerProcess(_config(port=taken.getsockname()[1])):
                pass
    finally:
        taken.close()
