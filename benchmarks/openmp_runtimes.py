"""GNU against Intel OpenMP under the reference engine, in alternating processes.

    python -m benchmarks.openmp_runtimes --pairs 10 --json openmp.json

A process keeps the OpenMP library it started with, so each measurement is a fresh child process: the pair's
two children (torch's GNU runtime, then Intel's preloaded, the order alternating between pairs) run one after
the other, and each ratio is taken within its pair (GNU over Intel) before the median over pairs, because
this machine's speed moves between minutes. A child builds the preset, warms up on unrelated tokens, and
times: a cold prompt of ``--prompt-len`` tokens and the same prompt again (each the median of ``--repeats``
fresh prompts), and the median inter-token latency of ``--decodes`` requests decoded together.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from mmcache.cli import positive_int, writable
from mmcache.launcher.openmp import ENV_CHOICE, find_intel_openmp, loaded_runtime

from .kernel_harness import order, timed, write_json


FIGURES = ("cold_s", "hit_s", "itl_s")


def measure(args) -> dict:
    """One child's figures, on whatever runtime this process started with."""
    import numpy as np

    from mmcache.engine import SamplingParams
    from mmcache.presets import engine_from_preset

    eng = engine_from_preset(args.preset, dtype=args.dtype)
    rng = np.random.default_rng(args.seed)

    def prompt(n: int) -> list[int]:
        return [int(x) for x in rng.integers(10, 8000, n)]

    def call(p: list[int]) -> float:
        return timed(eng.generate, [p], SamplingParams(max_tokens=1))

    call(prompt(args.prompt_len))
    cold, hit = [], []
    for _ in range(args.repeats):
        p = prompt(args.prompt_len)
        cold.append(call(p))
        hit.append(call(p))
    outs = eng.generate([prompt(256) for _ in range(args.decodes)], SamplingParams(max_tokens=24))
    itl = statistics.median(b - a for o in outs for a, b in zip(o.token_times, o.token_times[1:]))
    return {"cold_s": statistics.median(cold), "hit_s": statistics.median(hit), "itl_s": itl,
            "openmp": loaded_runtime()}


def child_env(runtime: str, lib: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env[ENV_CHOICE] = "system"
    if runtime == "intel":
        env["LD_PRELOAD"] = lib
    return env


def run(args) -> dict:
    lib = find_intel_openmp()
    if lib is None:
        raise SystemExit("intel-openmp is not installed beside this interpreter (pip install intel-openmp)")
    child_args = [sys.executable, "-m", "benchmarks.openmp_runtimes", "--child", "--preset", args.preset,
                  "--dtype", args.dtype, "--prompt-len", str(args.prompt_len), "--repeats", str(args.repeats),
                  "--decodes", str(args.decodes)]
    pairs = []
    for i in range(args.pairs):
        pair = {}
        for runtime in order(("gnu", "intel"), i):
            out = subprocess.run(child_args + ["--seed", str(args.seed + i)], env=child_env(runtime, lib),
                                 capture_output=True, text=True, check=True)
            pair[runtime] = json.loads(out.stdout.strip().splitlines()[-1])
            if pair[runtime]["openmp"] != runtime:
                raise RuntimeError(f"child meant for {runtime} ran on {pair[runtime]['openmp']}")
        pairs.append(pair)
        print(f"pair {i + 1}: " + "  ".join(f"{f} gnu/intel {pair['gnu'][f] / pair['intel'][f]:.2f}"
                                           for f in FIGURES), file=sys.stderr, flush=True)
    ratios = {f: [p["gnu"][f] / p["intel"][f] for p in pairs] for f in FIGURES}
    return {"pairs": pairs, "gnu_over_intel": {f: statistics.median(r) for f, r in ratios.items()},
            "gnu_over_intel_per_pair": ratios, "intel_lib": lib, "config": vars(args),
            "loadavg_end": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.openmp_runtimes", description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=positive_int, default=10)
    p.add_argument("--preset", default="qwen2.5-0.5b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt-len", type=positive_int, default=2048)
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--decodes", type=positive_int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args)))
        return 0
    if not writable(args.json, p.prog):
        return 2
    result = run(args)
    write_json(args.json, result)
    print(json.dumps(result["gnu_over_intel"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
