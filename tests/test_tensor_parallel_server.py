"""``mmcache serve --tensor-parallel-size 2``: the VLM chat served by two ranks, and what a lost rank does."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
from PIL import Image

ENV = {**os.environ, "MMCACHE_OPENMP": "system", "OMP_NUM_THREADS": "1"}


def _serve(*extra: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "mmcache.cli", "serve", "--preset", "tiny-llava", "--port", "0",
                             "--served-model-name", "demo", *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)
    line = proc.stdout.readline()
    found = re.search(r"at (http://127\.0\.0\.1:\d+) ", line)
    if not found:
        proc.kill()
        raise AssertionError((line, proc.communicate()[1][-3000:]))
    return proc, found.group(1)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for p in _followers(proc.pid):
        os.kill(p, signal.SIGKILL)


def _followers(parent: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(parent), "-f", "mmcache.presets.ranks"], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def _image_url() -> str:
    img = Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _two_turns(url: str) -> list[dict]:
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _image_url()}},
                                         {"type": "text", "text": "What is in this picture?"}]}]
    out = []
    for follow_up in ("And the colours?", None):
        r = httpx.post(url + "/v1/chat/completions", timeout=60,
                       json={"model": "demo", "messages": msgs, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        out.append(r.json())
        if follow_up:
            msgs = msgs + [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                           {"role": "user", "content": follow_up}]
    return out


def test_two_ranks_answer_a_chat_with_an_image_as_one_process_does_and_reuse_its_pages():
    single, url = _serve()
    try:
        expected = _two_turns(url)
    finally:
        single.send_signal(signal.SIGTERM)
        single.wait(timeout=30)
    proc, url = _serve("--tensor-parallel-size", "2")
    try:
        assert len(_followers(proc.pid)) == 1
        got = _two_turns(url)
        assert [g["choices"][0]["message"]["content"] for g in got] == \
            [e["choices"][0]["message"]["content"] for e in expected]
        assert got[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert got[1]["usage"] == expected[1]["usage"]
        text = httpx.get(url + "/metrics").text
        assert 'mmcache:tensor_parallel_size{model_name="demo"} 2.0' in text
        assert re.search(r'mmcache:tensor_parallel_agreements_total\{model_name="demo"\} [1-9]', text), text[-2000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        deadline = time.monotonic() + 10
        while _followers(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        _stop(proc)


def test_a_lost_rank_ends_the_stream_with_503_and_the_server_exits_non_zero():
    proc, url = _serve("--tensor-parallel-size", "2", "--tensor-parallel-timeout", "10")
    try:
        [follower] = _followers(proc.pid)
        body = {"model": "demo", "stream": True, "max_tokens": 100000, "ignore_eos": True,
                "messages": [{"role": "user", "content": "count"}]}
        errors = []
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    errors.append(chunk["error"])
                    break
                if follower is not None:
                    os.kill(follower, signal.SIGKILL)
                    follower = None
        assert errors and errors[0]["code"] == "tensor_parallel_group_failed", errors
        assert errors[0]["type"] == "service_unavailable"
        assert proc.wait(timeout=30) == 1
        assert "the tensor-parallel group failed" in proc.stderr.read()
    finally:
        _stop(proc)


def test_a_model_that_does_not_split_fails_the_start_with_a_reason():
    proc = subprocess.run([sys.executable, "-m", "mmcache.cli", "serve", "--preset", "tiny-llava", "--port", "0",
                           "--tensor-parallel-size", "3"], capture_output=True, text=True, env=ENV, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "do not split over 3" in proc.stderr


@pytest.mark.parametrize("args,message", [
    (["--preset", "tiny-llava", "--tensor-parallel-size", "2", "--replicas", "2"], "not supported"),
    (["--diffusion", "tiny-sd3", "--tensor-parallel-size", "2"], "splits a chat model"),
])
def test_a_group_that_cannot_serve_is_refused_before_anything_starts(args, message, capsys):
    from mmcache.cli import build_parser
    from mmcache.server.cli import serve_main

    assert serve_main(build_parser().parse_args(["serve", "--port", "0", *args])) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["--tensor-parallel-size", "0"], "at least 1"),
    (["--tensor-parallel-size", "2", "--tensor-parallel-timeout", "0.5"], "between 1 and 3600 seconds"),
])
def test_tensor_parallel_options_are_bounded(args, message, capsys):
    from mmcache.cli import build_parser

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--preset", "tiny", *args])
    assert exc.value.code == 2 and message in capsys.readouterr().err
