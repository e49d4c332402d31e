"""The cached-prefix part of a prefill chunk: the compiled prefix kernel against ATen's flash kernel, alternating
within one process.

    python -m benchmarks.prefix_kernel --json prefix_kernel.json      # a few seconds

The shape is a hit's on the Qwen2.5-0.5B shape by default: the last page (128 tokens) of a 2048-token prompt,
14 query heads over 2 KV heads stacked into 896 query rows per KV head, over the 1,920 cached keys, head size
64, bfloat16. Each round times ``--calls`` calls of one side, then of the other (the first side alternates from
round to round); the figures are the medians over rounds of the time per call, and the median of the
per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from mmcache.cli import positive_int


def measure(rows: int, keys: int, kv_heads: int, dim: int, rounds: int, calls: int, seed: int = 0) -> dict:
    import torch

    from mmcache.engine import native

    lib = native.library()
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(kv_heads, rows, dim, generator=g).bfloat16()
    k = torch.randn(kv_heads, keys, dim, generator=g).bfloat16()
    v = torch.randn(kv_heads, keys, dim, generator=g).bfloat16()
    if lib is None or not native.supports_prefix(lib, q, k, v):
        return {"skipped": f"the prefix kernel does not run here ({native.status()})"}
    scale = dim ** -0.5
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    sides = {"kernel": lambda: native.prefix_attention(lib, q, k, v, scale),
             "aten": lambda: flash(q[None], k[None], v[None], scale=scale)}
    for fn in sides.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(rounds):
        for name in (("kernel", "aten") if r % 2 == 0 else ("aten", "kernel")):
            t0 = time.perf_counter()
            for _ in range(calls):
                sides[name]()
            times[name].append((time.perf_counter() - t0) / calls)
    return {"shape": {"kv_heads": kv_heads, "rows_per_kv_head": rows, "keys": keys, "head_dim": dim},
            "threads": torch.get_num_threads(), "rounds": rounds, "calls_per_round": calls,
            "kernel_s": statistics.median(times["kernel"]), "aten_s": statistics.median(times["aten"]),
            "aten_over_kernel": statistics.median(a / b for a, b in zip(times["aten"], times["kernel"])),
            "per_round_s": times}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.prefix_kernel", description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=positive_int, default=896, help="query rows per KV head (heads per KV head x tokens)")
    p.add_argument("--keys", type=positive_int, default=1920, help="cached keys every row attends to")
    p.add_argument("--kv-heads", type=positive_int, default=2)
    p.add_argument("--dim", type=positive_int, default=64, help="head size: 32, 64 or 128")
    p.add_argument("--rounds", type=positive_int, default=15)
    p.add_argument("--calls", type=positive_int, default=5, help="calls per side per round")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    result = measure(args.rows, args.keys, args.kv_heads, args.dim, args.rounds, args.calls)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if "skipped" in result:
        print(result["skipped"])
        return 0
    print(f"prefix part, {args.kv_heads} KV heads x {args.rows} rows over {args.keys} keys, d {args.dim}: "
          f"kernel {1e3 * result['kernel_s']:.3f} ms, ATen flash {1e3 * result['aten_s']:.3f} ms, "
          f"ATen / kernel {result['aten_over_kernel']:.2f} (median of {args.rounds} alternating rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
