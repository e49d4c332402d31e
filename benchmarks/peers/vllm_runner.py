"""Plays prefix-benchmark workloads through vLLM's CPU build; run by the interpreter in ``VLLM_PEER_PYTHON``.

usage: $VLLM_PEER_PYTHON vllm_runner.py --model DIR --workloads IN.json (--out OUT.json | --serve)
          --max-num-batched-tokens N --max-num-seqs N [--dtype bfloat16] [--block-size 128]
          [--max-model-len 8192] [--eager]

IN.json:  {"warmup": WORKLOAD, "workloads": [WORKLOAD, ...]} in ``protocol.workload_to_json`` form.
OUT.json: {"engine": "vllm_cpu", "version", "init_s", "settings", "results": [ROUNDS, ...]}, one
          ``protocol.results_to_json`` list per workload, in the order given.
--serve:  after the warm-up, one line on stdout starting with ``SERVE_MARK`` carries {"version", "init_s",
          "settings"}; then each line read from stdin is a workload, played at once and answered by one
          ``SERVE_MARK`` line with its rounds; an empty line or the end of stdin ends the process. Lines
          without the mark (vLLM's own output) are to be ignored by the reader. This lets the benchmark
          interleave vLLM with the in-process engines, so that they are measured minutes apart at most.

One ``LLM`` (prefix caching on) is started once and serves every workload, so the cache carries over between
rounds and workloads as it would in a server. Each round's requests are added to the engine together and the
engine is stepped until they finish; every step's outputs are stamped with ``perf_counter`` here, so a token's
time is when this process received it (``RequestOutputKind.CUMULATIVE`` returns each new token at the step that
produced it). ``num_cached_tokens`` is vLLM's own count of prompt tokens served by its prefix cache.

The per-step token budget and sequence cap have no defaults here: the benchmark passes mmcache's (its
``StepBudget``), so that every engine schedules under the same limits. A budget below ``max_model_len`` is
accepted because vLLM V1 chunks long prefills (its CPU platform turns chunking off only for MLA models).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.peers.protocol import (Record, dump, load, play, results_to_json,  # noqa: E402
                                       workload_from_json)


SERVE_MARK = "@@mmcache-vllm-runner "


def make_round_runner(llm):
    """``protocol.play``'s ``run_round`` on ``llm``: a round's requests added together (each stamped on arrival),
    then the engine stepped until they finish."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    counter = itertools.count()

    def run_round(ids, prompts, max_tokens):
        keys, arrival = [], {}
        for rid, prompt, n in zip(ids, prompts, max_tokens):
            key = f"{next(counter)}:{rid}"
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                    output_kind=RequestOutputKind.CUMULATIVE)
            arrival[key] = time.perf_counter()
            engine.add_request(key, TokensPrompt(prompt_token_ids=prompt), params)
            keys.append(key)
        stamps, outputs, cached = _step_until_finished(engine, keys)
        return [Record(rid, len(p), outputs[k], arrival[k], stamps[k][0], stamps[k], cached[k])
                for rid, p, k in zip(ids, prompts, keys)]

    return run_round


def _step_until_finished(engine, keys: list[str]) -> tuple[dict, dict, dict]:
    """Steps ``engine`` until ``keys`` finished: per request its token times, tokens, cached tokens."""
    stamps, outputs, cached = {key: [] for key in keys}, {}, {}
    finished = set()
    while len(finished) < len(keys):
        if not engine.has_unfinished_requests():
            raise RuntimeError(f"vLLM stopped with {len(keys) - len(finished)} requests unfinished")
        for out in engine.step():
            now = time.perf_counter()
            if out.request_id not in stamps:
                continue
            toks = list(out.outputs[0].token_ids)
            stamps[out.request_id] += [now] * (len(toks) - len(stamps[out.request_id]))
            outputs[out.request_id] = toks
            cached[out.request_id] = out.num_cached_tokens or 0
            if out.finished:
                finished.add(out.request_id)
    return stamps, outputs, cached


def parser() -> argparse.ArgumentParser:
    """The command line of the module docstring's usage."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--workloads", required=True)
    out = p.add_mutually_exclusive_group(required=True)
    out.add_argument("--out")
    out.add_argument("--serve", action="store_true", help="play workloads read from stdin (see above)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--block-size", type=int, default=128, help="the CPU backend takes multiples of 32")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--max-num-batched-tokens", type=int, required=True, help="tokens one engine step may hold")
    p.add_argument("--max-num-seqs", type=int, required=True, help="sequences one engine step may hold")
    p.add_argument("--eager", action="store_true", help="skip torch.compile: starts in seconds, prefills slower")
    return p


def main() -> int:
    a = parser().parse_args()

    import vllm
    from vllm import LLM

    spec = load(a.workloads)
    warmup = workload_from_json(spec["warmup"])
    workloads = [workload_from_json(w) for w in spec["workloads"]]
    t0 = time.perf_counter()
    llm = LLM(model=a.model, tokenizer=a.model, dtype=a.dtype, max_model_len=a.max_model_len,
              block_size=a.block_size, enable_prefix_caching=True, enforce_eager=a.eager,
              max_num_batched_tokens=a.max_num_batched_tokens, max_num_seqs=a.max_num_seqs, seed=0)
    init_s = time.perf_counter() - t0
    run_round = make_round_runner(llm)
    play(warmup, run_round)
    settings = {k: v for k, v in vars(a).items() if k not in ("workloads", "out", "model", "serve")}
    started = {"version": vllm.__version__, "init_s": init_s, "settings": settings}
    if a.serve:
        return serve(run_round, started)
    results = []
    for w in workloads:
        print(f"vllm_runner: {w.name} ({w.num_requests} requests)", file=sys.stderr, flush=True)
        results.append(results_to_json(play(w, run_round)))
    dump({"engine": "vllm_cpu", **started, "results": results}, a.out)
    return 0


def serve(run_round, started: dict) -> int:
    """``--serve``: ``started`` on a marked line, then a marked answer to each workload line of stdin."""
    print(SERVE_MARK + json.dumps(started), flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        rounds = play(workload_from_json(json.loads(line)), run_round)
        print(SERVE_MARK + json.dumps(results_to_json(rounds)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
