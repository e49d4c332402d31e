"""The decoder's RMSNorms on the compiled kernel against the model's own modules: whole requests and decode steps,
paired within one process.

    python -m benchmarks.norm_kernel --pairs 8 --json norm_kernel.json      # about 4 min

Two engines on two copies of one preset's model (``--preset``, bfloat16, page 128, seeded alike, so the same
weights): one with ``native_norms`` (the default), one without. In each pair, each engine in turn (alternating
which goes first) serves a fresh 2,048-token prompt cold, then again (a hit on 1,920 tokens), one output token
each; then both engines decode the same batch (``--batch`` fresh prompts of ``--batch-prompt`` tokens,
``--decode-tokens`` greedy tokens each), stepping in turns, so that each of the one engine's decode-only steps
is paired with the other's adjacent one. Reported: medians per side (the decode figure is the median step of
each pair's batch), the medians of the per-pair ratios (module over kernel: above 1, the kernel is faster),
the median ratio over all adjacent decode-step pairs, each engine's same-vs-cold ratio, and the time spent
inside the norm modules of a cold and of a hit request on each side (forward hooks on every RMSNorm).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from mmcache.cli import positive_int

SIDES = ("kernel", "module")
KINDS = ("cold", "hit", "decode_step")


class NormClock:
    """Sums the wall time inside the RMSNorm modules under ``root`` (either kind) while installed."""

    def __init__(self, root):
        self.seconds, self._t0 = 0.0, 0.0
        mods = [m for m in root.modules() if type(m).__name__.endswith("RMSNorm")]
        self._handles = [h for m in mods for h in (m.register_forward_pre_hook(self._enter),
                                                   m.register_forward_hook(self._leave))]

    def _enter(self, module, args) -> None:
        self._t0 = time.perf_counter()

    def _leave(self, module, args, output) -> None:
        self.seconds += time.perf_counter() - self._t0

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def measure(pairs: int, preset: str, batch: int, batch_prompt: int, decode_tokens: int, prompt_len: int = 2048,
            seed: int = 0) -> dict:
    import numpy as np

    from mmcache.engine import Engine, EngineConfig, Request, SamplingParams

    engines = {side: Engine.from_preset(preset, dtype="bfloat16",
                                        config=EngineConfig(page_size=128, native_norms=side == "kernel"))
               for side in SIDES}
    if not engines["kernel"].adapter.num_native_norms:
        return {"skipped": "the compiled norm kernel does not run here (see `mmcache.engine.native.status()`)"}
    rng = np.random.default_rng(seed)
    vocab = engines["kernel"].adapter.vocab_size
    clocks = {side: NormClock(eng.adapter.decoder) for side, eng in engines.items()}

    def tokens(n: int) -> list[int]:
        return [int(x) for x in rng.integers(0, vocab, n)]

    def serve(side, prompt, kind) -> float:
        clocks[side].seconds = 0.0
        t0 = time.perf_counter()
        engines[side].generate([prompt], SamplingParams(max_tokens=1))
        took = time.perf_counter() - t0
        norm_times[side][kind].append(clocks[side].seconds)
        return took

    def decode_steps(order) -> dict:
        """Both engines decode a batch each, stepping in turns (``order`` first in each turn): every turn in
        which both steps only decoded gives a pair of adjacent steps."""
        sp = SamplingParams(max_tokens=decode_tokens, temperature=0.0, ignore_eos=True)
        prompts = [tokens(batch_prompt) for _ in range(batch)]
        for eng in engines.values():
            for p in prompts:
                eng.add_request(Request(p, sp))
        steps = {side: [] for side in SIDES}
        while any(e.has_unfinished() for e in engines.values()):
            took = {}
            for side in order:
                eng = engines[side]
                before = eng.counters["prompt_tokens"]
                t0 = time.perf_counter()
                eng.step()
                if eng.counters["prompt_tokens"] == before:
                    took[side] = time.perf_counter() - t0
            if len(took) == len(SIDES):
                for side in SIDES:
                    steps[side].append(took[side])
        return steps

    norm_times = {side: {"warm-up": [], "cold": [], "hit": []} for side in SIDES}
    for side in SIDES:
        serve(side, tokens(256), "warm-up")
    times = {side: {kind: [] for kind in KINDS} for side in SIDES}
    step_ratios = []
    for r in range(pairs):
        order = SIDES if r % 2 == 0 else SIDES[::-1]
        for side in order:
            p = tokens(prompt_len)
            times[side]["cold"].append(serve(side, p, "cold"))
            times[side]["hit"].append(serve(side, p, "hit"))
        steps = decode_steps(order)
        for side in SIDES:
            times[side]["decode_step"].append(statistics.median(steps[side]))
        step_ratios += [m / k for k, m in zip(steps["kernel"], steps["module"])]
    out = {"preset": preset, "pairs": pairs, "backends": {s: e.backend for s, e in engines.items()},
           "decode_batch": {"requests": batch, "prompt_tokens": batch_prompt, "output_tokens": decode_tokens},
           "per_pair_s": times}
    for kind in KINDS:
        k, m = times["kernel"][kind], times["module"][kind]
        out[kind] = {"kernel_s": statistics.median(k), "module_s": statistics.median(m),
                     "module_over_kernel": statistics.median(b / a for a, b in zip(k, m))}
    for clock in clocks.values():
        clock.remove()
    for kind in ("cold", "hit"):
        k, m = norm_times["kernel"][kind], norm_times["module"][kind]
        out[kind].update(norms_kernel_s=statistics.median(k), norms_module_s=statistics.median(m))
    out["decode_step"]["module_over_kernel_by_step"] = statistics.median(step_ratios)
    out["decode_step"]["step_pairs"] = len(step_ratios)
    out["same_vs_cold"] = {side: statistics.median(c / h for c, h in zip(t["cold"], t["hit"]))
                           for side, t in times.items()}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.norm_kernel", description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=positive_int, default=8)
    p.add_argument("--preset", default="qwen2.5-0.5b")
    p.add_argument("--prompt-len", type=positive_int, default=2048, help="the cold and hit prompt's tokens")
    p.add_argument("--batch", type=positive_int, default=8, help="requests of the decode batch")
    p.add_argument("--batch-prompt", type=positive_int, default=256, help="prompt tokens of each of them")
    p.add_argument("--decode-tokens", type=positive_int, default=16, help="output tokens of each of them")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    if args.decode_tokens < 2:
        p.error("--decode-tokens must be at least 2 (the first token comes from the prompt's forward)")
    result = measure(args.pairs, args.preset, args.batch, args.batch_prompt, args.decode_tokens, args.prompt_len)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if "skipped" in result:
        print(result["skipped"])
        return 0
    for kind in KINDS:
        r = result[kind]
        unit, scale = ("ms", 1e3) if kind == "decode_step" else ("s", 1)
        inside = (f"; inside the norms: kernel {1e3 * r['norms_kernel_s']:.1f} ms, module "
                  f"{1e3 * r['norms_module_s']:.1f} ms" if "norms_kernel_s" in r else "")
        print(f"{kind}: kernel {scale * r['kernel_s']:.3f} {unit}, module {scale * r['module_s']:.3f} {unit}, "
              f"module / kernel {r['module_over_kernel']:.3f} (median of {result['pairs']} pairs){inside}")
    d = result["decode_step"]
    print(f"decode steps paired one by one: module / kernel {d['module_over_kernel_by_step']:.3f} (median of "
          f"{d['step_pairs']} adjacent pairs)")
    s = result["same_vs_cold"]
    print(f"same vs cold: kernel {s['kernel']:.2f}x, module {s['module']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
