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


class _FakeRuntime:
    """Intel OpenMP's two blocktime entry points, recording what they were given."""

    def __init__(self):
        self.blocktime, self.calls = 200, []

    def kmp_get_blocktime(self):
        return self.blocktime

    def kmp_set_blocktime(self, value):
        self.calls.append(value.value)
        self.blocktime = value.value


def test_quiet_openmp_stops_the_spin_here_and_in_servers_started_inside_then_restores(monkeypatch):
    import os

    from benchmarks.serve_process import quiet_openmp

    monkeypatch.setenv("KMP_BLOCKTIME", "50")
    runtime = _FakeRuntime()
    with quiet_openmp(runtime):
        assert runtime.blocktime == 0 and os.environ["KMP_BLOCKTIME"] == "0"  # a spawned child reads it at start
    assert runtime.blocktime == 200 and runtime.calls == [0, 200] and os.environ["KMP_BLOCKTIME"] == "50"
    monkeypatch.delenv("KMP_BLOCKTIME")
    with quiet_openmp(object()):  # GNU's runtime: no blocktime calls, the environment only
        assert os.environ["KMP_BLOCKTIME"] == "0"
    assert "KMP_BLOCKTIME" not in os.environ
