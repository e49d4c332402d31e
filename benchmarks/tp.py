"""Tensor parallelism: the prefix probe at tp=1 and tp=2, and what the agreement on matched lengths costs.

    mmcache bench tp --json PATH [--quick] [--preset small] [--dtype float32] [--prompt-tokens 2048]
                     [--repeats 3] [--page-size 16]

Each size runs under torchrun (``python -m torch.distributed.run --standalone --nproc-per-node N -m
benchmarks.tp_rank``), one process a rank over gloo, the ranks splitting the machine's cores. Per size:

* bit-exactness: cache on against cache off under the exact schedule, three prompts that hit (a repeat, a
  shared prefix): rank 0's logits rows equal bit for bit, and every follower's digest of its logits equal;
* the probe: a fresh prompt of ``--prompt-tokens`` served cold, then again, one output token each; the speed-up
  is the median over repeats of cold TTFT over hit TTFT, and the hit must match every full page but the last
  token's (``matched_tokens``);
* the agreement: per admission (the median over the probe's admissions), the time rank 0 spends announcing it
  and in the all-reduce, and the all-reduce alone, on every rank; the all-reduce on rank 0 includes waiting for
  the followers to replay the pool changes sent with the announcement and match the prompt on their indexes,
  which each follower reports (``follower_catchup_ms``: from the message's arrival to its own agreement).
Across sizes: tp=2's output tokens equal tp=1's (greedy). On a 2-core machine tensor parallelism brings no speed
(the ranks share the cores); the figures show that the agreement keeps every hit and costs little.
``--quick``: the tiny preset, 256-token prompts, 2 repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

from .options import count
from .table import Row

DESCRIPTION = "tensor parallelism: the prefix probe at tp=1 and tp=2, bit-exactness, the agreement's cost"
SIZES = (1, 2)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default=None, help="text preset (default small; tiny with --quick)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompt-tokens", type=count(32768), default=None, help="probe prompt (default 2048; 256 quick)")
    p.add_argument("--repeats", type=count(50), default=None, help="probe repeats (default 3; 2 quick)")
    p.add_argument("--page-size", type=count(1024), default=16)


def run(args) -> dict:
    preset = args.preset or ("tiny" if args.quick else "small")
    tokens = args.prompt_tokens or (256 if args.quick else 2048)
    repeats = args.repeats or (2 if args.quick else 3)
    sizes = {}
    with tempfile.TemporaryDirectory(prefix="mmcache-bench-tp-") as work:
        for n in SIZES:
            out = os.path.join(work, f"tp{n}.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", "-m",
                   "benchmarks.tp_rank", "--preset", preset, "--dtype", args.dtype, "--prompt-tokens", str(tokens),
                   "--repeats", str(repeats), "--page-size", str(args.page_size), "--out", out]
            print(f"[tp] tp={n}: {preset}, {tokens}-token prompts, {repeats} repeats", file=sys.stderr, flush=True)
            done = subprocess.run(cmd, capture_output=True, text=True, cwd=_repo_root(),
                                  env=dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // n))))
            if done.returncode != 0:
                raise RuntimeError(f"tp={n} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
            with open(out) as f:
                sizes[str(n)] = json.load(f)
    one, two = sizes["1"], sizes["2"]
    ranks = two["agreement_per_rank"]
    return {
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "sizes": sizes,
        "tokens_equal_across_sizes": one["exactness"]["tokens"] == two["exactness"]["tokens"]
        and one["first_tokens"] == two["first_tokens"],
        "agreement_ms_per_admission": [r["median_ms"] for r in ranks],  # medians over the probe's admissions
        "reduce_ms_per_admission": [r["median_reduce_ms"] for r in ranks],
        "follower_catchup_ms": [r.get("catchup_median_ms") for r in ranks[1:]],
    }


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def table_rows(result: dict) -> list[Row]:
    rows = []
    for n in SIZES:
        s = result["sizes"][str(n)]
        e = s["exactness"]
        exact = e["logits_equal"] and e["tokens_equal"] and e["follower_digests_equal"]
        rows.append(Row("tp", f"tp={n}: {s['prompt_tokens']}-token prompt again, TTFT ({s['preset']}; bit-exact "
                              f"on/off: {'yes' if exact else 'NO'})", s["hit_ttft_median_s"], "s",
                        s["cold_ttft_median_s"], "cold", paired=s["speedup_median"]))
    ms = result["agreement_ms_per_admission"][0]
    rows.append(Row("tp", "tp=2: agreement per admission, rank 0 (announce + all-reduce, median)", ms / 1e3, "s",
                    target="< 1 ms"))
    return rows
