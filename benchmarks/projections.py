"""Each attention module's query, key and value projections as one packed product against three, paired step
by step on one engine.

    python -m benchmarks.projections --json projections.json       # about 3 min

One engine on a preset's model (``--preset``, bfloat16, page 128) whose projections the engine grouped
(``kernels.PackedProjections``); beside each group, the three projections packed one by one
(``kernels.PackedLinear``, what the engine ran before grouping). Before each measured step or request the
benchmark points every attention module at one side or the other, so both sides run the same weights in the
same engine, cache and minute:

* decode steps: ``--batch`` requests of ``--batch-prompt`` fresh tokens decode ``--decode-tokens`` tokens
  each; decode-only steps alternate sides and each is paired with the next;
* hits: ``--hits`` fresh ``--prompt-len`` prompts, each served cold once, then again on each side (alternating
  which goes first), one output token each: every hit seeds all pages but the last.

Reported: each side's median, and the median of the paired ratios (three over one: above 1, grouping is
faster).
"""

from __future__ import annotations

import argparse
import sys

from mmcache.cli import positive_int

from .kernel_harness import decode_only_step, order, paired, script_main, timed

SIDES = ("grouped", "separate")


def measure(preset: str, batch: int, batch_prompt: int, decode_tokens: int, hits: int, prompt_len: int,
            seed: int = 0) -> dict:
    import numpy as np

    from mmcache.engine import EngineConfig
    from mmcache.presets import engine_from_preset

    eng = engine_from_preset(preset, dtype="bfloat16", config=EngineConfig(page_size=128))
    attns, sides = projection_sides(eng)
    if not attns:
        return {"skipped": "the engine did not group this model's projections (see mmcache.engine.compute.kernels)"}

    def use(side: str) -> None:
        for a, group in zip(attns, sides[side]):
            a.q_proj, a.k_proj, a.v_proj = group

    rng = np.random.default_rng(seed)
    vocab = eng.adapter.vocab_size

    def fresh(n: int) -> list[int]:
        return rng.integers(2, vocab, size=n).tolist()

    steps = decode_steps(eng, use, [fresh(batch_prompt) for _ in range(batch)], decode_tokens)
    hit_times = hit_pairs(eng, use, fresh, hits, prompt_len)
    use("grouped")
    pairs = min(len(steps["grouped"]), len(steps["separate"]))
    out = {"preset": preset, "backend": eng.backend, "attention_modules": len(attns),
           "per_step_s": steps, "per_hit_s": hit_times}
    for kind, times, n in (("decode_step", steps, pairs), ("hit", hit_times, hits)):
        out[kind] = {**paired({side: t[:n] for side, t in times.items()}, "separate", "grouped"), "pairs": n}
    return out


def projection_sides(eng) -> tuple[list, dict]:
    """The attention modules the engine grouped, and per side their projections."""
    from mmcache.engine.compute import kernels

    attns = [m for m in eng.adapter.decoder.modules()
             if isinstance(getattr(m, "q_proj", None), kernels.PackedProjection)]
    sides = {"grouped": [tuple(getattr(a, n) for n in kernels.PROJECTIONS) for a in attns]}
    sides["separate"] = [tuple(kernels.PackedLinear(m) for m in group) for group in sides["grouped"]]
    return attns, sides


def decode_steps(eng, use, prompts: list[list[int]], decode_tokens: int) -> dict:
    """The batch of ``prompts`` decoded to the end, decode-only steps alternating sides: side -> seconds."""
    from mmcache.engine import Request, SamplingParams

    steps = {side: [] for side in SIDES}
    sp = SamplingParams(max_tokens=decode_tokens, temperature=0.0, ignore_eos=True)
    for p in prompts:
        eng.add_request(Request(p, sp))
    turn = 0
    while eng.has_unfinished():
        side = SIDES[turn % 2]
        use(side)
        elapsed = decode_only_step(eng)
        if elapsed is not None:
            steps[side].append(elapsed)
            turn += 1
    return steps


def hit_pairs(eng, use, fresh, hits: int, prompt_len: int) -> dict:
    """``hits`` fresh prompts, each served cold once, then as a hit on each side in ``order``: side -> seconds."""
    from mmcache.engine import Request, SamplingParams

    hit_times = {side: [] for side in SIDES}
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for i in range(hits):
        prompt = fresh(prompt_len)
        use("grouped")
        eng.generate([Request(prompt, one)])
        for side in order(SIDES, i):
            use(side)
            hit_times[side].append(timed(eng.generate, [Request(prompt, one)]))
    return hit_times


def main(argv=None) -> int:
    return script_main("benchmarks.projections", __doc__, argv, _arguments, _measure, _report, check=_check)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="qwen2.5-0.5b")
    p.add_argument("--batch", type=positive_int, default=8, help="requests of the decode batch")
    p.add_argument("--batch-prompt", type=positive_int, default=600, help="prompt tokens of each of them")
    p.add_argument("--decode-tokens", type=positive_int, default=61, help="output tokens of each of them")
    p.add_argument("--hits", type=positive_int, default=8, help="prompts served cold, then as hits on each side")
    p.add_argument("--prompt-len", type=positive_int, default=2048, help="tokens of each of those prompts")


def _check(args: argparse.Namespace) -> str | None:
    if args.decode_tokens < 3:
        return "--decode-tokens must be at least 3 (two decode steps make one pair)"
    return None


def _measure(args: argparse.Namespace) -> dict:
    return measure(args.preset, args.batch, args.batch_prompt, args.decode_tokens, args.hits, args.prompt_len)


def _report(args: argparse.Namespace, result: dict) -> None:
    for kind in ("decode_step", "hit"):
        r = result[kind]
        print(f"{kind}: grouped {1e3 * r['grouped_s']:.1f} ms, separate {1e3 * r['separate_s']:.1f} ms, "
              f"separate / grouped {r['separate_over_grouped']:.3f} (median of {r['pairs']} pairs)")


if __name__ == "__main__":
    sys.exit(main())
