"""``mmcache serve`` as a program: it binds loopback, prints its URL (and why its prefix cache is off, when it is),
answers /health and a chat, and exits 0 on SIGTERM."""

import os
import re
import signal
import subprocess
import sys

import httpx
import pytest

from mmcache.cli import build_parser
from mmcache.server.cli import config_from_args


def test_serve_options_build_the_config():
    args = build_parser().parse_args(["serve", "--preset", "tiny-llava", "--api-key", "a", "--api-key", "b",
                                      "--page-size", "32", "--max-waiting", "0", "--store-bytes", "1024"])
    config = config_from_args(args)
    assert config.host == "127.0.0.1" and config.port == 8000 and config.api_keys == ("a", "b")
    assert config.engine_config.page_size == 32 and config.max_waiting == 0 and config.store_bytes == 1024
    assert config.dtype == "float32" and config.model_name == "tiny-llava"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--preset", "tiny", "--model", "x"])


def test_serve_schedule_defaults_bound_a_mixed_steps_prompt_tokens():
    from mmcache.server.config import SERVE_MAX_TOKENS_PER_STEP, SERVE_MIXED_PREFILL_TOKENS, serve_engine_config

    config = config_from_args(build_parser().parse_args(["serve", "--preset", "tiny"])).engine_config
    assert (config.page_size, config.max_tokens_per_step, config.prefill_chunk_tokens, config.mixed_prefill_tokens) \
        == (16, SERVE_MAX_TOKENS_PER_STEP, 2048, SERVE_MIXED_PREFILL_TOKENS)
    assert config == serve_engine_config()
    given = ["--mixed-prefill-tokens", "64", "--prefill-chunk-tokens", "512", "--max-num-batched-tokens", "1024"]
    config = config_from_args(build_parser().parse_args(["serve", "--preset", "tiny"] + given)).engine_config
    assert (config.mixed_prefill_tokens, config.prefill_chunk_tokens, config.max_tokens_per_step) == (64, 512, 1024)
    # the default follows the page size and the chunk: whole pages, at most the chunk
    assert serve_engine_config(page_size=64).mixed_prefill_tokens == 64
    assert serve_engine_config(prefill_chunk_tokens=16).mixed_prefill_tokens == 16


@pytest.mark.parametrize("given, says", [(["--mixed-prefill-tokens", "24"], "mixed_prefill_tokens"),
                                         (["--prefill-chunk-tokens", "20"], "prefill_chunk_tokens"),
                                         (["--prefill-chunk-tokens", "64", "--mixed-prefill-tokens", "128"],
                                          "mixed_prefill_tokens")])
def test_serve_refuses_a_bad_schedule_with_exit_2(given, says, capsys):
    from mmcache.server.cli import serve_main

    assert serve_main(build_parser().parse_args(["serve", "--preset", "tiny"] + given)) == 2
    err = capsys.readouterr().err
    assert err.startswith("mmcache serve: ") and says in err, err


def test_a_server_config_without_an_engine_config_gets_the_servers_schedule():
    from mmcache.presets.serving import build_engine
    from mmcache.server import ServerConfig
    from mmcache.server.config import serve_engine_config

    engine = build_engine(ServerConfig(preset="tiny"))
    assert engine.config == serve_engine_config()
    assert engine.scheduler.limits.mixed_prefill_tokens == serve_engine_config().mixed_prefill_tokens


def test_serve_prints_its_url_and_stops_on_sigterm():
    env = {**os.environ, "MMCACHE_OPENMP": "system", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "mmcache.cli", "serve", "--preset", "tiny", "--port", "0",
                             "--served-model-name", "demo"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        line = proc.stdout.readline()
        found = re.search(r"at (http://127\.0\.0\.1:\d+) ", line)
        assert found, (line, proc.stderr.read() if proc.poll() is not None else "")
        url = found.group(1)
        assert httpx.get(url + "/health").json() == {"status": "ok"}
        r = httpx.post(url + "/v1/chat/completions", json={"model": "demo", "max_tokens": 2,
                                                           "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_says_at_start_that_its_prefix_cache_is_off():
    """float16 KV has not passed the bit-exact gate: the server runs without reuse, and says so."""
    env = {**os.environ, "MMCACHE_OPENMP": "system", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "mmcache.cli", "serve", "--preset", "tiny", "--port", "0",
                             "--dtype", "float16"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        assert "at http://127.0.0.1:" in proc.stdout.readline()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0
        assert "mmcache serve: the prefix cache is off: main pool: KV dtype float16 has not passed" in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_refuses_a_taken_port(capsys):
    import socket

    from mmcache.server.cli import serve_main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        args = build_parser().parse_args(["serve", "--preset", "tiny", "--port", str(port)])
        assert serve_main(args) == 1
    assert f"cannot serve on 127.0.0.1:{port}" in capsys.readouterr().err
