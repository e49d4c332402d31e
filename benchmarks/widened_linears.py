"""bfloat16 linears on ATen's bfloat16 product against the same products widened to float32
(``kernels.PackedWeight``), paired in one process.

    python -m benchmarks.widened_linears --json widened.json       # about 10 min on a 2-core AVX2 machine

Where oneDNN has no bfloat16 path (AVX2-only CPUs), the engine packs a bfloat16 model's linears as float32
(``kernels.widened``); this measures what that buys.

* Products: each distinct product of one decoder layer of ``--preset`` in bfloat16 (the query, key and value
  projections as the engine groups them, the output projection, the MLP's gate or up, its down), at each row
  count of ``--rows``. Sides: ``aten`` (``torch.nn.functional.linear`` on the bfloat16 weight), ``widened``
  (the weight packed as float32) and, where this CPU's oneDNN packs bfloat16 itself, ``packed`` (packed as it
  is). Each of ``--rounds`` rounds times ``--calls`` calls of every side, in an order that rotates by round;
  reported: each side's median per call and the median over rounds of each side's time over ``widened``'s.
  ``layer`` sums one layer's products (the gate's shape twice: gate and up).
* Whole requests: two engines on two copies of the model, one with ``packed_linears=False`` (ATen's
  products) and one packing as the engine does on this CPU; ``--pairs`` fresh prompts of ``--prompt-len``
  tokens served cold with one output token on each, alternating which goes first; reported: the medians and
  the median of the paired ratios (plain over packed).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from mmcache.cli import positive_int, positive_ints

from .kernel_harness import order, paired, ratio, script_main, timed


def _layer_products(preset: str) -> dict:
    """One decoder layer's products of the preset in bfloat16: name -> (weight, bias)."""
    from mmcache.presets.text import build_model

    model, _ = build_model(preset, "bfloat16")
    layer = model.model.layers[0]
    att, mlp = layer.self_attn, layer.mlp
    weights = {
        "qkv": (torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]).detach(),
                None if att.q_proj.bias is None
                else torch.cat([att.q_proj.bias, att.k_proj.bias, att.v_proj.bias]).detach()),
        "o": (att.o_proj.weight.detach(), None if att.o_proj.bias is None else att.o_proj.bias.detach()),
        "gate": (mlp.gate_proj.weight.detach(), None),
        "down": (mlp.down_proj.weight.detach(), None),
    }
    return weights


def measure_products(preset: str, rows: list[int], rounds: int, calls: int, seed: int = 0) -> dict:
    from mmcache.engine.compute import kernels

    weights = _layer_products(preset)
    native = not kernels.widened(torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    out: dict = {}
    for n in rows:
        per_shape: dict = {}
        for name, (w, b) in weights.items():
            sides = {"aten": lambda x, w=w, b=b: torch.nn.functional.linear(x, w, b),
                     "widened": kernels.PackedWeight(w, b, widen=True)}
            if native:
                sides["packed"] = kernels.PackedWeight(w, b, widen=False)
            x = torch.randn(n, w.shape[1], generator=gen).to(torch.bfloat16)
            for fn in sides.values():  # first calls (allocations, oneDNN's kernel choice) not timed
                fn(x)
            times = {side: [] for side in sides}
            for r in range(rounds):
                for side in order(list(sides), r):
                    times[side].append(timed(sides[side], x, calls=calls))
            per_shape[name] = times
        summary = {}
        for name, times in [*per_shape.items(), ("layer", _layer_sum(per_shape, rounds))]:
            summary[name] = {f"{side}_s": statistics.median(t) for side, t in times.items()}
            for side, t in times.items():
                if side != "widened":
                    summary[name][f"{side}_over_widened"] = ratio(t, times["widened"])
        out[str(n)] = summary
    return {"preset": preset, "oneDNN_packs_bfloat16": native, "rounds": rounds, "calls": calls, "rows": out}


def _layer_sum(per_shape: dict, rounds: int) -> dict:
    """Per round, one layer's products: qkv + o + 2 gate (gate and up) + down."""
    count = {"qkv": 1, "o": 1, "gate": 2, "down": 1}
    sides = per_shape["qkv"].keys()
    return {side: [sum(count[s] * per_shape[s][side][r] for s in count) for r in range(rounds)] for side in sides}


def measure_requests(preset: str, pairs: int, prompt_len: int, seed: int = 0) -> dict:
    import numpy as np

    from mmcache.engine import ComputeConfig, Engine, EngineConfig, Request, SamplingParams
    from mmcache.engine.compute import kernels
    from mmcache.presets.text import build_model

    engines = {}
    for side, packed in (("plain", False), ("packed", True)):
        model, tok = build_model(preset, "bfloat16")
        engines[side] = Engine(model, tok, EngineConfig(page_size=128, compute=ComputeConfig(packed_linears=packed)))
    rng = np.random.default_rng(seed)
    vocab = engines["plain"].adapter.vocab_size
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times = {side: [] for side in engines}
    for i in range(pairs):
        prompt = rng.integers(2, vocab, size=prompt_len).tolist()
        for side in order(("plain", "packed"), i):
            times[side].append(timed(engines[side].generate, [Request(prompt, one)]))
    return {"preset": preset, "prompt_len": prompt_len, "pairs": pairs,
            "widened": kernels.widened(torch.bfloat16),
            "packed_backend": engines["packed"].backend, "plain_backend": engines["plain"].backend,
            "per_request_s": times, **paired(times, "plain", "packed")}


def main(argv=None) -> int:
    return script_main("benchmarks.widened_linears", __doc__, argv, _arguments, _measure, _report)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="qwen2.5-0.5b")
    p.add_argument("--rows", type=positive_ints, default="8,128,2048",
                   help="comma-separated row counts of the products")
    p.add_argument("--rounds", type=positive_int, default=5)
    p.add_argument("--calls", type=positive_int, default=3, help="calls per side and round")
    p.add_argument("--pairs", type=positive_int, default=3, help="whole-request pairs")
    p.add_argument("--prompt-len", type=positive_int, default=2048)
    p.add_argument("--no-requests", action="store_true", help="products only")


def _measure(args: argparse.Namespace) -> dict:
    result = {"products": measure_products(args.preset, args.rows, args.rounds, args.calls)}
    if not args.no_requests:
        result["requests"] = measure_requests(args.preset, args.pairs, args.prompt_len)
    return result


def _report(args: argparse.Namespace, result: dict) -> None:
    prod = result["products"]
    print(f"products ({prod['preset']}, bfloat16; oneDNN packs bfloat16 here: {prod['oneDNN_packs_bfloat16']}), "
          f"median of {prod['rounds']} rounds:")
    for n, summary in prod["rows"].items():
        for name, r in summary.items():
            extra = "".join(f", {k} {v:.3f}" for k, v in r.items() if k.endswith("_over_widened"))
            print(f"  {n:>5} rows {name:>5}: aten {1e3 * r['aten_s']:.2f} ms, widened {1e3 * r['widened_s']:.2f} ms"
                  + extra)
    if "requests" in result:
        r = result["requests"]
        print(f"requests ({r['prompt_len']} tokens cold, {r['pairs']} pairs, widened: {r['widened']}): plain "
              f"{r['plain_s']:.2f} s, packed {r['packed_s']:.2f} s, plain / packed {r['plain_over_packed']:.3f}")


if __name__ == "__main__":
    sys.exit(main())
