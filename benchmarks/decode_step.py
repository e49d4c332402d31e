"""A decode step on the compiled kernel against the same step on ATen's path, alternating within one process.

    python -m benchmarks.decode_step --json decode_step.json      # 2 shapes x 3 rounds, about 2 min

Each round submits a batch of greedy requests and steps the engine until they finish; steps alternate
between the compiled decode kernel and ATen's path (the engine's runner is handed the kernel or None before
each step, a measuring device only: an engine chooses once, at construction), starting with the other one
each round, so the two sides share the minute. For every step that only decodes (no prompt chunk in
it) it records the step's wall time and the time inside decode attention (the kernel's call, or ATen's
per-sequence function), and reports medians per side and the ratio of the medians of each.

Shapes (Qwen2.5-0.5B shape, bf16, page 128 by default):

* ``shared``: SGLang's generated-shared-prefix shape scaled down, two 2048-token system prompts each under 4
  requests with their own 128 tokens (the requests under one prompt share its pages).
* ``own``: 12 requests of 1,500 tokens, nothing shared.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from mmcache.cli import positive_int

from .kernel_harness import decode_only_step, order, script_main

SHAPES = ("shared", "own")
SIDES = ("kernel", "aten")


def prompts(shape: str, rng, vocab: int, scale: float) -> list[list[int]]:
    def tokens(n: int) -> list[int]:
        return [int(x) for x in rng.integers(2, vocab, max(1, round(n * scale)))]

    if shape == "shared":
        system = [tokens(2048) for _ in range(2)]
        return [system[i % 2] + tokens(128) for i in range(8)]
    if shape == "own":
        return [tokens(1500) for _ in range(12)]
    raise ValueError(f"unknown shape {shape!r}; expected one of {SHAPES}")


class AttentionClock:
    """Sums the wall time inside the decode attention of either path while installed."""

    def __init__(self):
        from mmcache.engine import attention
        from mmcache.engine.compute import native

        self.seconds = 0.0
        self._patched = [(native, "decode_attention"), (attention, "_decodes_one_by_one")]
        self._real = [getattr(m, name) for m, name in self._patched]
        for (module, name), real in zip(self._patched, self._real):
            setattr(module, name, self._timed(real))

    def _timed(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        return timed

    def remove(self) -> None:
        for (module, name), real in zip(self._patched, self._real):
            setattr(module, name, real)


def measure(args) -> dict:
    import numpy as np

    from mmcache.engine import EngineConfig
    from mmcache.presets import engine_from_preset
    from mmcache.engine.compute import native

    kernel = native.library()
    if kernel is None:
        raise SystemExit(f"the compiled decode kernel is not available here: {native.status()}")
    eng = engine_from_preset(args.preset, dtype=args.dtype, config=EngineConfig(page_size=args.page_size))
    rng = np.random.default_rng(args.seed)
    clock = AttentionClock()
    result = {}
    try:
        for shape in args.shapes:
            steps = {side: [] for side in SIDES}
            for r in range(args.rounds):
                one_round(eng, kernel, clock, prompts(shape, rng, eng.adapter.vocab_size, args.scale), r, args,
                          steps)
            result[shape] = summarize(steps)
    finally:
        clock.remove()
    return result


def one_round(eng, kernel, clock: AttentionClock, batch: list[list[int]], r: int, args, steps: dict) -> None:
    """Round ``r``: ``batch`` decoded to the end, steps alternating sides; each decode-only step into ``steps``."""
    from mmcache.engine import Request, SamplingParams

    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for p in batch:
        eng.add_request(Request(p, sp))
    k = 0
    while eng.has_unfinished():
        side = order(SIDES, k + r)[0]  # steps alternate, each round starting on the other side
        eng.runner.decode_kernel = kernel if side == "kernel" else None
        clock.seconds = 0.0
        took = decode_only_step(eng)
        if clock.seconds > 0 and took is not None:  # decodes only
            steps[side].append({"step_s": took, "attention_s": clock.seconds})
        k += 1
    eng.clear_cache()


def summarize(steps: dict) -> dict:
    med = {side: {f: statistics.median(s[f] for s in v) for f in ("step_s", "attention_s")} if v else None
           for side, v in steps.items()}
    out = {"steps": {side: len(v) for side, v in steps.items()}, "medians": med}
    if all(med.values()):
        out["aten_over_kernel"] = {f: med["aten"][f] / med["kernel"][f] for f in ("step_s", "attention_s")}
    return out


def main(argv: list[str] | None = None) -> int:
    return script_main("benchmarks.decode_step", __doc__, argv, _arguments, _measure, _report)


def shape_list(text: str) -> list[str]:
    """An argparse ``type``: comma-separated names of ``SHAPES``."""
    names = [s for s in text.split(",") if s]
    for name in names:
        if name not in SHAPES:
            raise argparse.ArgumentTypeError(f"unknown shape {name!r}; expected one of {', '.join(SHAPES)}")
    return names


def _arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--page-size", type=positive_int, default=128)
    ap.add_argument("--shapes", type=shape_list, default=",".join(SHAPES),
                    help="comma-separated subset of " + ",".join(SHAPES))
    ap.add_argument("--rounds", type=positive_int, default=3)
    ap.add_argument("--max-tokens", type=positive_int, default=24)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every prompt length (tests: smaller)")
    ap.add_argument("--seed", type=int, default=0)


def _measure(args: argparse.Namespace) -> dict:
    return {"preset": args.preset, "dtype": args.dtype, "page_size": args.page_size, "rounds": args.rounds,
            "shapes": measure(args)}


def _report(args: argparse.Namespace, result: dict) -> None:
    for shape, r in result["shapes"].items():
        m = r["medians"]
        print(f"{shape}: decode step kernel {m['kernel']['step_s'] * 1e3:.1f} ms (attention "
              f"{m['kernel']['attention_s'] * 1e3:.1f}), ATen {m['aten']['step_s'] * 1e3:.1f} ms (attention "
              f"{m['aten']['attention_s'] * 1e3:.1f}); steps {r['steps']}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
