"""vLLM's CPU build as a peer of the prefix benchmark: runs ``vllm_runner.py`` in the interpreter named by the
``VLLM_PEER_PYTHON`` environment variable and reads its answer back.

vLLM is a measuring instrument here, never a dependency: its interpreter is prepared once per machine by the
setup script the README names, whose ``env.sh`` sets ``VLLM_PEER_PYTHON`` and vLLM's CPU settings (threads bound
to the cores, KV space, offline mode). This module passes the environment through unchanged.

Invariants: vLLM's per-step token budget (``max_num_batched_tokens``) and sequence cap (``max_num_seqs``) default
to mmcache's ``EngineConfig`` defaults, the benchmark's one source of them (vLLM's own default budget is
``max_model_len``); one vLLM process per call (``run``) or per ``VllmServer`` serves every workload given, in order;
the answer holds one list of rounds per workload; a failed or silent run raises ``VllmUnavailable`` with the
tail of vLLM's log.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from mmcache.engine.config import EngineConfig
from mmcache.errors import MmcacheError

from .protocol import RoundResult, Workload, dump, load, results_from_json, workload_to_json

ENV_VAR = "VLLM_PEER_PYTHON"
RUNNER = Path(__file__).resolve().with_name("vllm_runner.py")
SERVE_MARK = "@@mmcache-vllm-runner "  # as in vllm_runner.py, which cannot import this module


class VllmUnavailable(MmcacheError, RuntimeError):
    """vLLM's interpreter is not configured, or its run failed."""


@dataclass
class VllmRun:
    results: list[list[RoundResult]]  # per workload, per round
    version: str
    init_s: float
    settings: dict


def interpreter() -> str:
    """The vLLM interpreter from ``VLLM_PEER_PYTHON``; raises ``VllmUnavailable`` when unset or missing."""
    path = os.environ.get(ENV_VAR)
    if not path:
        raise VllmUnavailable(f"--peers needs {ENV_VAR}: run the vLLM peer's setup.sh once, then `source env.sh DIR`")
    if not os.access(path, os.X_OK):
        raise VllmUnavailable(f"{ENV_VAR}={path} is not an executable interpreter")
    return path


def _command(python: str, model_dir: str, spec: str, dtype: str, block_size: int, max_model_len: int,
             max_num_batched_tokens: int, max_num_seqs: int, eager: bool) -> list[str]:
    return [python, str(RUNNER), "--model", model_dir, "--workloads", spec, "--dtype", dtype,
            "--block-size", str(block_size), "--max-model-len", str(max_model_len), "--max-num-batched-tokens",
            str(max_num_batched_tokens), "--max-num-seqs", str(max_num_seqs)] + (["--eager"] if eager else [])


class VllmServer:
    """One vLLM process that plays workloads on request (``play``), warmed up once; ``close`` ends it.

    Between calls the process waits on its input, so the in-process engines can run in between: the benchmark
    interleaves engines this way. Usable as a context manager.
    """

    def __init__(self, model_dir: str, warmup: Workload, workdir: str, dtype: str = "bfloat16",
                 block_size: int = 128, max_model_len: int = 8192,
                 max_num_batched_tokens: int = EngineConfig.max_tokens_per_step,
                 max_num_seqs: int = EngineConfig.max_num_seqs, eager: bool = False):
        python = interpreter()
        spec = os.path.join(workdir, "vllm_serve_in.json")
        self.log = os.path.join(workdir, "vllm.log")
        dump({"warmup": workload_to_json(warmup), "workloads": []}, spec)
        cmd = _command(python, model_dir, spec, dtype, block_size, max_model_len, max_num_batched_tokens,
                       max_num_seqs, eager) + ["--serve"]
        print(f"[prefix] vllm_cpu: starting vLLM ({'eager' if eager else 'torch.compile'}); log {self.log}",
              file=sys.stderr, flush=True)
        self._log = open(self.log, "w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True)
        hello = self._answer()
        self.version, self.init_s, self.settings = hello["version"], hello["init_s"], hello["settings"]

    def _answer(self):
        for line in self.proc.stdout:
            if line.startswith(SERVE_MARK):
                return json.loads(line[len(SERVE_MARK):])
            self._log.write(line)  # vLLM's own output
        self.proc.wait()
        self._log.flush()
        raise VllmUnavailable(f"vLLM runner exited with {self.proc.returncode}; log tail:\n{_tail(self.log)}")

    def play(self, workload: Workload) -> list[RoundResult]:
        try:
            self.proc.stdin.write(json.dumps(workload_to_json(workload)) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError as e:
            raise VllmUnavailable(f"vLLM runner is gone; log tail:\n{_tail(self.log)}") from e
        return results_from_json(self._answer())

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=120)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> "VllmServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run(model_dir: str, warmup: Workload, workloads: list[Workload], workdir: str, dtype: str = "bfloat16",
        block_size: int = 128, max_model_len: int = 8192,
        max_num_batched_tokens: int = EngineConfig.max_tokens_per_step, max_num_seqs: int = EngineConfig.max_num_seqs,
        eager: bool = False, timeout_s: float = 3600.0) -> VllmRun:
    python = interpreter()
    spec, out, log = (os.path.join(workdir, n) for n in ("vllm_in.json", "vllm_out.json", "vllm.log"))
    dump({"warmup": workload_to_json(warmup), "workloads": [workload_to_json(w) for w in workloads]}, spec)
    cmd = _command(python, model_dir, spec, dtype, block_size, max_model_len, max_num_batched_tokens, max_num_seqs,
                   eager) + ["--out", out]
    print(f"[prefix] vllm_cpu: starting vLLM ({'eager' if eager else 'torch.compile'}); log {log}",
          file=sys.stderr, flush=True)
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired as e:
            raise VllmUnavailable(f"vLLM did not finish within {timeout_s:.0f} s; log tail:\n{_tail(log)}") from e
    if rc != 0 or not os.path.exists(out):
        raise VllmUnavailable(f"vLLM runner exited with {rc}; log tail:\n{_tail(log)}")
    answer = load(out)
    results = [results_from_json(rounds) for rounds in answer["results"]]
    if len(results) != len(workloads):
        raise VllmUnavailable(f"vLLM answered {len(results)} workloads of {len(workloads)}")
    return VllmRun(results, answer["version"], answer["init_s"], answer["settings"])


def _tail(path: str, lines: int = 30) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])
