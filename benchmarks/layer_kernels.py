"""The decoder's RMSNorms and rotary embedding on the compiled kernels against transformers' own code: whole
requests and decode steps, paired within one process.

    python -m benchmarks.layer_kernels --pairs 10 --json layer_kernels.json      # about 6 min

Two engines on two copies of one preset's model (``--preset``, bfloat16, page 128, seeded alike, so the same
weights): one with ``layer_kernels`` (the default), one without. The rotary embedding is replaced process-wide
(``mmcache.engine.compute.rotary``), so before each of its calls the ``torch`` side points the modeling module's
function back at the original and the ``kernels`` side at the replacement.

In each pair, each engine in turn (alternating which goes first) serves a fresh 2,048-token prompt cold, then
again (a hit on 1,920 tokens), one output token each. Then both engines decode the same batch (``--batch``
fresh prompts of ``--batch-prompt`` tokens, ``--decode-tokens`` greedy tokens each), stepping in turns, so
that each of one engine's decode-only steps is paired with the other's adjacent one.

Reported: medians per side (the decode figure is the median step of each pair's batch); the medians of the
per-pair ratios (torch over kernels: above 1, the kernels are faster); the median ratio over all adjacent
decode-step pairs; each engine's same-vs-cold ratio; and the time spent inside the norm modules (forward hooks
on every RMSNorm) and inside the rotary embedding of a cold and of a hit request on each side.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from mmcache.cli import positive_int

from .kernel_harness import decode_only_step, order, paired, ratio, script_main

SIDES = ("kernels", "torch")
KINDS = ("cold", "hit", "decode_step")


class NormClock:
    """Sums the wall time inside the RMSNorm modules under ``root`` (either kind) while installed; ``timed``
    wraps a function so that its calls are summed in ``rotary_seconds``."""

    def __init__(self, root):
        self.seconds, self.rotary_seconds, self._t0 = 0.0, 0.0, 0.0
        mods = [m for m in root.modules() if type(m).__name__.endswith("RMSNorm")]
        self._handles = [h for m in mods for h in (m.register_forward_pre_hook(self._enter),
                                                   m.register_forward_hook(self._leave))]

    def timed(self, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.rotary_seconds += time.perf_counter() - t0
        return call

    def _enter(self, module, args) -> None:
        self._t0 = time.perf_counter()

    def _leave(self, module, args, output) -> None:
        self.seconds += time.perf_counter() - self._t0

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


class PairedEngines:
    """The two engines, each side's norm clock, and the rotary function ``home`` points at for each."""

    def __init__(self, engines: dict, home, seed: int):
        import numpy as np

        from mmcache.engine.compute import rotary

        self.engines, self.home, self.attribute = engines, home, rotary.NAME
        self.rng = np.random.default_rng(seed)
        self.vocab = engines["kernels"].adapter.vocab_size
        self.clocks = {side: NormClock(eng.adapter.decoder) for side, eng in engines.items()}
        replacement, self.installed = rotary.replacement(home), getattr(home, rotary.NAME)  # it may hold a wrapper
        self.functions = {"kernels": self.clocks["kernels"].timed(replacement),
                          "torch": self.clocks["torch"].timed(replacement.original)}
        self.norm_times = {side: {"warm-up": [], "cold": [], "hit": []} for side in SIDES}
        self.rotary_times = {side: {"warm-up": [], "cold": [], "hit": []} for side in SIDES}

    def use(self, side: str):
        """``side``'s engine, with the modeling module's rotary function pointed at that side's."""
        setattr(self.home, self.attribute, self.functions[side])
        return self.engines[side]

    def tokens(self, n: int) -> list[int]:
        """``n`` fresh token ids."""
        return [int(x) for x in self.rng.integers(0, self.vocab, n)]

    def serve(self, side: str, prompt: list[int], kind: str) -> float:
        """Seconds of one request of one output token on ``side``; its norm and rotary time go under ``kind``."""
        from mmcache.engine import SamplingParams

        eng = self.use(side)
        clock = self.clocks[side]
        clock.seconds = clock.rotary_seconds = 0.0
        t0 = time.perf_counter()
        eng.generate([prompt], SamplingParams(max_tokens=1))
        took = time.perf_counter() - t0
        self.norm_times[side][kind].append(clock.seconds)
        self.rotary_times[side][kind].append(clock.rotary_seconds)
        return took

    def decode_steps(self, turn: list[str], batch: dict) -> dict:
        """Both engines decode ``batch`` in turns; each turn whose two steps only decoded is a step pair."""
        from mmcache.engine import Request, SamplingParams

        sp = SamplingParams(max_tokens=batch["output_tokens"], temperature=0.0, ignore_eos=True)
        prompts = [self.tokens(batch["prompt_tokens"]) for _ in range(batch["requests"])]
        for eng in self.engines.values():
            for p in prompts:
                eng.add_request(Request(p, sp))
        steps = {side: [] for side in SIDES}
        while any(e.has_unfinished() for e in self.engines.values()):
            took = {side: decode_only_step(self.use(side)) for side in turn}
            if None not in took.values():
                for side in SIDES:
                    steps[side].append(took[side])
        return steps

    def restore(self) -> None:
        """The modeling module's rotary function as it was, and no clock left installed."""
        setattr(self.home, self.attribute, self.installed)
        for clock in self.clocks.values():
            clock.remove()


def rotary_home(engine):
    """The module whose rotary function the kernels replace, and None; or None and why they do not run."""
    from mmcache.engine.compute import rotary

    decoder = engine.adapter.decoder
    homes = {sys.modules[type(m).__module__] for m in decoder.modules() if hasattr(m, "head_dim")}
    home = next((h for h in homes if rotary.replacement(h) is not None), None)
    if not engine.compute.num_native_norms:
        return None, "the compiled layer kernels do not run here (see `mmcache.engine.compute.native.status()`)"
    if home is None:
        why = "; ".join(rotary.skipped(decoder).values()) or "not installed"
        return None, f"the compiled rotary embedding does not run here: {why}"
    return home, None


def measure(pairs: int, preset: str, batch: int, batch_prompt: int, decode_tokens: int, prompt_len: int = 2048,
            seed: int = 0) -> dict:
    from mmcache.engine import ComputeConfig, EngineConfig
    from mmcache.presets import engine_from_preset

    engines = {side: engine_from_preset(preset, dtype="bfloat16",
                                        config=EngineConfig(page_size=128,
                                                            compute=ComputeConfig(layer_kernels=side == "kernels")))
               for side in SIDES}
    home, skipped = rotary_home(engines["kernels"])
    if skipped is not None:
        return {"skipped": skipped}
    decode_batch = {"requests": batch, "prompt_tokens": batch_prompt, "output_tokens": decode_tokens}
    sides = PairedEngines(engines, home, seed)
    times = {side: {kind: [] for kind in KINDS} for side in SIDES}
    step_ratios = []
    try:
        for side in SIDES:
            sides.serve(side, sides.tokens(256), "warm-up")
        for r in range(pairs):
            step_ratios += one_pair(sides, order(SIDES, r), prompt_len, decode_batch, times)
    finally:
        sides.restore()
    out = {"preset": preset, "pairs": pairs, "backends": {s: e.backend for s, e in engines.items()},
           "decode_batch": decode_batch, "per_pair_s": times}
    return summarise(out, times, sides, step_ratios)


def one_pair(sides: PairedEngines, turn: list[str], prompt_len: int, batch: dict, times: dict) -> list[float]:
    """Cold and hit per side into ``times``, then both decode ``batch``: the step pairs' ratios."""
    for side in turn:
        p = sides.tokens(prompt_len)
        times[side]["cold"].append(sides.serve(side, p, "cold"))
        times[side]["hit"].append(sides.serve(side, p, "hit"))
    steps = sides.decode_steps(turn, batch)
    for side in SIDES:
        times[side]["decode_step"].append(statistics.median(steps[side]))
    return [t / k for k, t in zip(steps["kernels"], steps["torch"])]


def summarise(out: dict, times: dict, sides: PairedEngines, step_ratios: list[float]) -> dict:
    """``out`` with the medians and paired ratios of every kind, the norm and rotary medians, the step pairs."""
    for kind in KINDS:
        out[kind] = paired({side: t[kind] for side, t in times.items()}, "torch", "kernels")
    for kind in ("cold", "hit"):
        out[kind].update({f"{part}_{side}_s": statistics.median(t[side][kind])
                          for part, t in (("norms", sides.norm_times), ("rotary", sides.rotary_times))
                          for side in SIDES})
    out["decode_step"]["torch_over_kernels_by_step"] = statistics.median(step_ratios)
    out["decode_step"]["step_pairs"] = len(step_ratios)
    out["same_vs_cold"] = {side: ratio(t["cold"], t["hit"]) for side, t in times.items()}
    return out


def main(argv=None) -> int:
    return script_main("benchmarks.layer_kernels", __doc__, argv, _arguments, _measure, _report, check=_check)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pairs", type=positive_int, default=10)
    p.add_argument("--preset", default="qwen2.5-0.5b")
    p.add_argument("--prompt-len", type=positive_int, default=2048, help="the cold and hit prompt's tokens")
    p.add_argument("--batch", type=positive_int, default=8, help="requests of the decode batch")
    p.add_argument("--batch-prompt", type=positive_int, default=256, help="prompt tokens of each of them")
    p.add_argument("--decode-tokens", type=positive_int, default=16, help="output tokens of each of them")


def _check(args: argparse.Namespace) -> str | None:
    if args.decode_tokens < 2:
        return "--decode-tokens must be at least 2 (the first token comes from the prompt's forward)"
    return None


def _measure(args: argparse.Namespace) -> dict:
    return measure(args.pairs, args.preset, args.batch, args.batch_prompt, args.decode_tokens, args.prompt_len)


def _report(args: argparse.Namespace, result: dict) -> None:
    for kind in KINDS:
        r = result[kind]
        unit, scale = ("ms", 1e3) if kind == "decode_step" else ("s", 1)
        inside = "".join(f"; inside the {part}: kernels {1e3 * r[f'{part}_kernels_s']:.1f} ms, torch "
                         f"{1e3 * r[f'{part}_torch_s']:.1f} ms"
                         for part in ("norms", "rotary") if f"{part}_torch_s" in r)
        print(f"{kind}: kernels {scale * r['kernels_s']:.3f} {unit}, torch {scale * r['torch_s']:.3f} {unit}, "
              f"torch / kernels {r['torch_over_kernels']:.3f} (median of {result['pairs']} pairs){inside}")
    d = result["decode_step"]
    print(f"decode steps paired one by one: torch / kernels {d['torch_over_kernels_by_step']:.3f} (median of "
          f"{d['step_pairs']} adjacent pairs)")
    s = result["same_vs_cold"]
    print(f"same vs cold: kernels {s['kernels']:.2f}x, torch {s['torch']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
