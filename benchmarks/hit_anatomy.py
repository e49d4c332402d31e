"""Where the repeated prompt's speed-up goes: a cold prompt against the same prompt again, each split into the
time inside the linear layers and the rest, in one process.

    python -m benchmarks.hit_anatomy --repeats 9 --json anatomy.json

Each repeat takes a fresh prompt of ``--prompt-len`` tokens and times, back to back, the cold prompt and the
same prompt again (a hit: every page but the last is seeded, the last page is computed). Within both requests
a clock on the engine's own linear modules (every packed or plain linear and fused MLP of every decoder
layer, and the LM head) sums the time spent inside them, so each request splits into its linears and the
rest (attention, norms, rotary, residuals, embedding, the engine's own work), measured in the same seconds.
Every ratio is taken within its repeat, then the median over repeats, because this machine's speed moves
between minutes.

The question it answers: how far the repeated prompt's speed-up can go on this machine. A hit computes
``page_size`` rows instead of ``prompt_len``, so its linears could at best be ``prompt_len / page_size``
times cheaper (16x at 2048 and 128) and its attention about half that (a page of queries over the whole
prompt against a causal prompt); the whole request's ratio lies between the two parts' ratios, weighted by
their shares of the hit.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from mmcache.cli import positive_int, writable

from .kernel_harness import machine, say_machine, write_json

FIGURES = ("cold_s", "hit_s", "linears_cold_s", "linears_hit_s")


def linear_modules(adapter) -> list:
    """Every module that computes a linear product in a forward, layer by layer: per decoder layer its linear
    modules (a fused gated MLP counts once: it does not call its gate, up and down modules), then the LM head.
    No module of the list runs inside another."""
    from torch import nn

    from mmcache.engine.compute.kernels import PackedGatedMLP

    decoder = adapter.decoder
    modules = []
    for layer in getattr(decoder, "layers", decoder):
        fused = [m for m in layer.modules() if isinstance(m, PackedGatedMLP)]
        inside = {id(p) for f in fused for p in f.modules()}
        modules += [m for m in layer.modules()
                    if isinstance(m, PackedGatedMLP) or (isinstance(m, nn.Linear) and id(m) not in inside)]
    modules.append(adapter.lm_head)
    return modules


class LinearClock:
    """Sums the wall time spent inside ``modules`` (none nested in another) and counts their calls."""

    def __init__(self, modules: list):
        self.seconds, self.calls, self._t0 = 0.0, 0, 0.0
        self._handles = [h for m in modules for h in (m.register_forward_pre_hook(self._enter),
                                                      m.register_forward_hook(self._leave))]

    def _enter(self, module, args) -> None:
        self._t0 = time.perf_counter()

    def _leave(self, module, args, output) -> None:
        self.seconds += time.perf_counter() - self._t0
        self.calls += 1

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def measure(args) -> dict:
    import numpy as np

    from mmcache.engine import EngineConfig, SamplingParams
    from mmcache.presets import engine_from_preset

    if args.prompt_len % args.page_size or args.prompt_len < 2 * args.page_size:
        raise SystemExit("--prompt-len must be a multiple of --page-size, at least two pages")
    eng = engine_from_preset(args.preset, dtype=args.dtype, config=EngineConfig(page_size=args.page_size))
    rng = np.random.default_rng(args.seed)
    modules = linear_modules(eng.adapter)
    clock = LinearClock(modules)

    def call(p: list[int]):
        clock.reset()
        t0 = time.perf_counter()
        out = eng.generate([p], SamplingParams(max_tokens=1))[0]
        took = time.perf_counter() - t0
        if out.error is not None:
            raise RuntimeError(f"request failed: {out.error}")
        return took, clock.seconds, out

    def prompt() -> list[int]:
        return [int(x) for x in rng.integers(0, eng.adapter.vocab_size, args.prompt_len)]

    call(prompt())
    try:
        repeats = [cold_and_hit(call, prompt(), args.prompt_len - args.page_size) for _ in range(args.repeats)]
    finally:
        clock.remove()
    return {"repeats": repeats, "linear_modules": len(modules)}


def cold_and_hit(call, p: list[int], hit_tokens: int) -> dict:
    """One repeat: ``p`` cold, then again (a hit of ``hit_tokens``); each one's seconds, all and in linears."""
    cold, lin_cold, _ = call(p)
    hit, lin_hit, again = call(p)
    if again.matched_tokens != hit_tokens:
        raise RuntimeError(f"expected a hit of {hit_tokens} tokens, got {again.matched_tokens}")
    return {"cold_s": cold, "hit_s": hit, "linears_cold_s": lin_cold, "linears_hit_s": lin_hit}


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
    measured = measure(args)
    return {"preset": args.preset, "dtype": args.dtype, "page_size": args.page_size, "prompt_len": args.prompt_len,
            **measured, **summarize(measured["repeats"]), "machine": machine()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.hit_anatomy", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--page-size", type=positive_int, default=128)
    ap.add_argument("--prompt-len", type=positive_int, default=2048)
    ap.add_argument("--repeats", type=positive_int, default=9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the result here")
    args = ap.parse_args(argv)
    if not writable(args.json, ap.prog):
        return 2
    say_machine(ap.prog)
    result = run(args)
    for i, r in enumerate(result["repeats"]):
        print(f"repeat {i + 1}: cold {r['cold_s']:.3f} s, hit {r['hit_s']:.3f} s; linears "
              f"{r['linears_cold_s']:.3f} / {r['linears_hit_s']:.3f} s", flush=True)
    for k, v in result["ratios"].items():
        print(f"{k:24s} {v:.2f}")
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
