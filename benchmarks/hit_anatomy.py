"""Where the repeated prompt's speed-up goes: a cold prompt against the same prompt again, split into the
linear layers and everything else, in one process.

    python -m benchmarks.hit_anatomy --repeats 8 --json anatomy.json

Each repeat takes a fresh prompt of ``--prompt-len`` tokens and times, back to back: the cold prompt, the same
prompt again (a hit: every page but the last is seeded, the last page is computed), and then the engine's own
linear modules alone (every packed or plain linear and fused MLP of every decoder layer, in layer order, and
the LM head on one row, the way a forward calls them) on random rows, once with the cold prompt's row count
and once with the hit's. So each repeat gives the whole-request ratio cold / hit, the linears' ratio, and the
ratio of the rest (attention, norms, rotary, residuals, embedding, the engine's own work: the request's time
minus its linears). Every ratio is taken within its repeat, then the median over repeats, because this
machine's speed moves between minutes.

The question it answers: how far the repeated prompt's speed-up can go on this machine. A hit computes
``page_size`` rows instead of ``prompt_len``, so its linears could at best be ``prompt_len / page_size``
times cheaper (16x at 2048 and 128) and its attention about half that (a page of queries over the whole
prompt against a causal prompt); the whole request's ratio lies between the two parts' ratios, weighted by
their shares of the hit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

FIGURES = ("cold_s", "hit_s", "linears_cold_s", "linears_hit_s")


def linear_calls(adapter) -> list:
    """``(module, in_features)`` for every linear product a forward makes, in order: per decoder layer its
    linear modules (a fused gated MLP counts once, with the hidden width), then the LM head."""
    from torch import nn

    from mmcache.engine.kernels import PackedGatedMLP

    decoder = adapter.decoder
    calls = []
    for layer in getattr(decoder, "layers", decoder):
        fused = [m for m in layer.modules() if isinstance(m, PackedGatedMLP)]
        inside = {id(p) for f in fused for p in f.modules()}
        for m in layer.modules():
            if isinstance(m, PackedGatedMLP):
                calls.append((m, m.gate_proj.in_features))
            elif isinstance(m, nn.Linear) and id(m) not in inside:
                calls.append((m, m.in_features))
    head = adapter.lm_head
    calls.append((head, head.in_features))
    return calls


def time_linears(calls: list, rows: int, dtype, generator) -> float:
    """Seconds for one pass over ``calls`` with ``rows`` random rows (the LM head on one row, as a forward
    computes logits only for the request's last token)."""
    import torch

    inputs = {width: torch.randn(rows, width, generator=generator).to(dtype) for _, width in calls}
    with torch.inference_mode():
        t0 = time.perf_counter()
        for i, (module, width) in enumerate(calls):
            x = inputs[width]
            module(x[-1:] if i == len(calls) - 1 else x)
        return time.perf_counter() - t0


def measure(args) -> dict:
    import numpy as np
    import torch

    from mmcache.engine import Engine, EngineConfig, SamplingParams

    if args.prompt_len % args.page_size or args.prompt_len < 2 * args.page_size:
        raise SystemExit("--prompt-len must be a multiple of --page-size, at least two pages")
    eng = Engine.from_preset(args.preset, dtype=args.dtype, config=EngineConfig(page_size=args.page_size))
    vocab = eng.adapter.vocab_size
    rng = np.random.default_rng(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    calls = linear_calls(eng.adapter)

    def call(p: list[int]):
        t0 = time.perf_counter()
        out = eng.generate([p], SamplingParams(max_tokens=1))[0]
        return time.perf_counter() - t0, out

    def prompt() -> list[int]:
        return [int(x) for x in rng.integers(0, vocab, args.prompt_len)]

    call(prompt())
    time_linears(calls, args.page_size, eng.adapter.dtype, gen)
    repeats = []
    for _ in range(args.repeats):
        p = prompt()
        cold, first = call(p)
        hit, again = call(p)
        if first.error is not None or again.error is not None:
            raise RuntimeError(f"request failed: {first.error or again.error}")
        if again.matched_tokens != args.prompt_len - args.page_size:
            raise RuntimeError(f"expected a hit of {args.prompt_len - args.page_size} tokens, "
                               f"got {again.matched_tokens}")
        rows_hit = args.prompt_len - again.matched_tokens
        lin_cold = time_linears(calls, args.prompt_len, eng.adapter.dtype, gen)
        lin_hit = time_linears(calls, rows_hit, eng.adapter.dtype, gen)
        repeats.append({"cold_s": cold, "hit_s": hit, "linears_cold_s": lin_cold, "linears_hit_s": lin_hit})
    return {"repeats": repeats, "linear_calls_per_forward": len(calls)}


def summarize(repeats: list[dict]) -> dict:
    """Medians of each figure and of the per-repeat ratios."""
    def med(f) -> float:
        return statistics.median(f(r) for r in repeats)

    return {
        "medians": {k: med(lambda r, k=k: r[k]) for k in FIGURES},
        "ratios": {
            "cold_over_hit": med(lambda r: r["cold_s"] / r["hit_s"]),
            "linears_cold_over_hit": med(lambda r: r["linears_cold_s"] / r["linears_hit_s"]),
            "rest_cold_over_hit": med(lambda r: (r["cold_s"] - r["linears_cold_s"])
                                      / (r["hit_s"] - r["linears_hit_s"])),
            "hit_linears_share": med(lambda r: r["linears_hit_s"] / r["hit_s"]),
            "cold_linears_share": med(lambda r: r["linears_cold_s"] / r["cold_s"]),
            # the ratio a hit would reach if nothing but its linears took time
            "cold_over_hit_linears": med(lambda r: r["cold_s"] / r["linears_hit_s"]),
        },
    }


def run(args) -> dict:
    from mmcache.openmp import loaded_runtime

    measured = measure(args)
    result = {"preset": args.preset, "dtype": args.dtype, "page_size": args.page_size,
              "prompt_len": args.prompt_len, **measured, **summarize(measured["repeats"])}
    import torch

    result["machine"] = {"threads": torch.get_num_threads(), "openmp": loaded_runtime()}
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.hit_anatomy", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--page-size", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the result here")
    args = ap.parse_args(argv)
    result = run(args)
    for i, r in enumerate(result["repeats"]):
        print(f"repeat {i + 1}: cold {r['cold_s']:.3f} s, hit {r['hit_s']:.3f} s; linears "
              f"{r['linears_cold_s']:.3f} / {r['linears_hit_s']:.3f} s", flush=True)
    for k, v in result["ratios"].items():
        print(f"{k:24s} {v:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
