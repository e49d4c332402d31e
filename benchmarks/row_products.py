"""Products of a decode step's few rows: oneDNN's packed product against the compiled kernel for them (the row
kernel, ``native.linear``, on AVX2 builds; the tile kernel, ``native.TileWeight``, for bfloat16 weights where the
CPU grants AMX, else its vector way where the CPU has AVX-512 BF16), paired in one process.

    python -m benchmarks.row_products --json row_products.json      # about 3 min on a 2-core machine

Packed linears compute products of at most ``native.ROW_PRODUCT_ROWS`` rows on the row kernel where the compiled
library is its AVX2 build, and bfloat16 products of at most ``native.TILE_PRODUCT_ROWS`` rows on the tile kernel
where the CPU has the tile unit or AVX-512 BF16 (``EngineConfig.row_products``, ``kernels.row_kernel``); this
measures what that buys.

* Products: each distinct product of one decoder layer of ``--preset`` in ``--dtype`` (the query, key and value
  projections as the engine groups them, the output projection, the MLP's gate or up, its down) and the LM head,
  at each row count of ``--rows``. Sides: ``onednn`` (``kernels.PackedWeight`` as the engine packs it: bfloat16
  weights widened to float32 where oneDNN has no bfloat16 path) and ``kernel`` (the same with the compiled
  kernel). Each of ``--rounds`` rounds times ``--calls`` calls of each side, alternating which goes first;
  reported: each side's median per call and the median over rounds of ``onednn``'s time over ``kernel``'s.
  ``layer`` sums one layer's products (the gate's shape twice: gate and up); ``step`` is ``layer`` times the
  number of layers plus the head. One layer's weights stay in a large last-level cache between calls, which a
  step's do not: the sweep below is the closer measure of a step.
* Sweep (``--no-sweep`` leaves it out): every layer's products in a forward's order, each layer with its own
  weights, so the whole model's layer weights stream from memory once per sweep; at each row count, ``--rounds``
  sweeps per side, alternating which goes first; reported as above.
* Decode (where the engine uses a kernel): two engines on two copies of the model, ``row_products`` off and on;
  ``--pairs`` times, a fresh batch of ``--batch`` requests (prompts of ``--prompt-len`` tokens) decodes
  ``--tokens`` tokens on each, alternating which goes first; reported: each side's median inter-token latency
  (over every token after the first of every request of the batch), and the median over pairs of off over on.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from mmcache.cli import positive_int, positive_ints

from .kernel_harness import in_turns, order, paired, script_main, timed

SIDES = ("onednn", "kernel")


def _products(preset: str, dtype: torch.dtype) -> tuple[dict, int]:
    """One decoder layer's products and the LM head: name -> (weight, bias); and the number of layers."""
    from mmcache.presets.text import build_model

    model, _ = build_model(preset, str(dtype).removeprefix("torch."))
    layer = model.model.layers[0]
    att, mlp = layer.self_attn, layer.mlp

    def cat(parts):
        return None if parts[0] is None else torch.cat(parts).detach()

    weights = {"qkv": (cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]),
                       cat([att.q_proj.bias, att.k_proj.bias, att.v_proj.bias])),
               "o": (att.o_proj.weight.detach(), cat([att.o_proj.bias])),
               "gate": (mlp.gate_proj.weight.detach(), None),
               "down": (mlp.down_proj.weight.detach(), None),
               "head": (model.get_output_embeddings().weight.detach(), None)}
    return weights, len(model.model.layers)


def measure_products(preset: str, dtype: torch.dtype, rows: list[int], rounds: int, calls: int,
                     seed: int = 0) -> dict:
    from mmcache.engine.compute import kernels, native

    lib = native.library()
    if lib is None:
        raise SystemExit(f"the compiled library is not available here: {native.status()}")
    weights, layers = _products(preset, dtype)
    gen = torch.Generator().manual_seed(seed)
    out: dict = {}
    for n in rows:
        per_shape: dict = {}
        for name, (w, b) in weights.items():
            sides = {"onednn": kernels.PackedWeight(w, b), "kernel": kernels.PackedWeight(w, b, rows=lib)}
            if sides["kernel"].rows is None:
                raise SystemExit(f"the row kernel does not take {dtype} weights that oneDNN packs as they are")
            x = torch.randn(n, w.shape[1], generator=gen).to(dtype)
            for fn in sides.values():  # first calls (allocations, oneDNN's kernel choice) not timed
                fn(x)
            per_shape[name] = in_turns(SIDES, rounds, lambda side: timed(sides[side], x, calls=calls))
        count = {"qkv": 1, "o": 1, "gate": 2, "down": 1}
        per_shape["layer"] = {side: [sum(c * per_shape[s][side][r] for s, c in count.items())
                                     for r in range(rounds)] for side in ("onednn", "kernel")}
        per_shape["step"] = {side: [layers * per_shape["layer"][side][r] + per_shape["head"][side][r]
                                    for r in range(rounds)] for side in ("onednn", "kernel")}
        out[str(n)] = {name: paired(t, "onednn", "kernel") for name, t in per_shape.items()}
    return {"preset": preset, "dtype": str(dtype).removeprefix("torch."), "layers": layers,
            "widened": kernels.widened(dtype), "library": native.status(), "rounds": rounds, "calls": calls,
            "rows": out}


def measure_sweep(preset: str, dtype: torch.dtype, rows: list[int], rounds: int, seed: int = 0) -> dict:
    """Every layer's products in a forward's order (the query, key and value projections as one, the output
    projection, gate, up, down), each layer with its own weights: a sweep reads the whole model's layer weights
    once, more than a last-level cache holds at the benchmark's size, as a decode step or a short prefill does.
    Per row count: the median over ``rounds`` (alternating which side goes first) of each side's sweep and of
    oneDNN's over the kernel's."""
    from mmcache.engine.compute import kernels, native

    lib = native.library()
    weights = _forward_products(preset, dtype)
    sides = {"onednn": [kernels.PackedWeight(w, b) for w, b in weights],
             "kernel": [kernels.PackedWeight(w, b, rows=lib) for w, b in weights]}
    kind = sides["kernel"][0].row_kernel
    gen = torch.Generator().manual_seed(seed)
    out = {str(n): _sweep_at(n, weights, sides, dtype, rounds, gen) for n in rows}
    return {"kernel": kind, "weight_bytes": sum(w.numel() * w.element_size() for w, _ in weights),
            "rounds": rounds, "rows": out}


def _forward_products(preset: str, dtype: torch.dtype) -> list[tuple]:
    """Every layer's (weight, bias) in a forward's order: qkv as one, o, gate, up, down."""
    from mmcache.presets.text import build_model

    model, _ = build_model(preset, str(dtype).removeprefix("torch."))
    weights = []
    for layer in model.model.layers:
        att, mlp = layer.self_attn, layer.mlp
        qkv = [att.q_proj, att.k_proj, att.v_proj]
        weights.append((torch.cat([m.weight.detach() for m in qkv]),
                        None if att.q_proj.bias is None else torch.cat([m.bias.detach() for m in qkv])))
        weights += [(m.weight.detach(), None if m.bias is None else m.bias.detach())
                    for m in (att.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
    return weights


def _sweep_at(n: int, weights: list[tuple], sides: dict, dtype: torch.dtype, rounds: int, gen) -> dict:
    """At ``n`` rows: both sides' sweeps in turns over ``rounds``, and whether the kernel runs."""
    xs = {k: torch.randn(n, k, generator=gen).to(dtype) for k in {w.shape[1] for w, _ in weights}}

    def sweep(side):
        for (w, _), fn in zip(weights, sides[side]):
            fn(xs[w.shape[1]])

    sweep("onednn"), sweep("kernel")  # first calls not timed
    times = in_turns(SIDES, rounds, lambda side: timed(sweep, side))
    on_kernel = sides["kernel"][0].on_rows(xs[weights[0][0].shape[1]])
    return {**paired(times, "onednn", "kernel"), "on_kernel": bool(on_kernel)}


def measure_decode(preset: str, dtype: torch.dtype, pairs: int, batch: int, tokens: int, prompt_len: int,
                   seed: int = 0) -> dict:
    import numpy as np

    from mmcache.engine import ComputeConfig, Engine, EngineConfig, Request, SamplingParams
    from mmcache.presets.text import build_model

    engines = {}
    for side, on in (("off", False), ("on", True)):
        model, tok = build_model(preset, str(dtype).removeprefix("torch."))
        engines[side] = Engine(model, tok, EngineConfig(page_size=128, max_num_seqs=batch,
                                                        compute=ComputeConfig(row_products=on)))
    if not engines["on"].compute.num_row_product_linears:
        raise SystemExit("the engine uses no compiled kernel for few rows here (only on the compiled library's AVX2 "
                         "build, native.row_products, and for bfloat16 on the AMX tile unit or with AVX-512 BF16, "
                         "native.product_way); run with --no-decode to time the products alone")
    rng = np.random.default_rng(seed)
    vocab = engines["off"].adapter.vocab_size
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    itl = {side: [] for side in engines}
    for i in range(pairs):
        prompts = [rng.integers(2, vocab, size=prompt_len).tolist() for _ in range(batch)]
        for side in order(("off", "on"), i):
            outs = engines[side].generate([Request(p, params) for p in prompts])
            gaps = [b - a for o in outs for a, b in zip(o.token_times, o.token_times[1:])]
            itl[side].append(statistics.median(gaps))
    return {"preset": preset, "dtype": str(dtype).removeprefix("torch."), "pairs": pairs, "batch": batch,
            "tokens": tokens, "prompt_len": prompt_len,
            "on_backend": engines["on"].backend, "off_backend": engines["off"].backend, "itl_p50_s": itl,
            **paired(itl, "off", "on")}


def main(argv=None) -> int:
    return script_main("benchmarks.row_products", __doc__, argv, _arguments, _measure, _report)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="qwen2.5-0.5b")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--rows", type=positive_ints, default="1,4,8,16", help="comma-separated row counts of the products")
    p.add_argument("--rounds", type=positive_int, default=6)
    p.add_argument("--calls", type=positive_int, default=3, help="calls per side and round")
    p.add_argument("--pairs", type=positive_int, default=4, help="decode pairs")
    p.add_argument("--batch", type=positive_int, default=8, help="requests decoding together")
    p.add_argument("--tokens", type=positive_int, default=32, help="tokens per request")
    p.add_argument("--prompt-len", type=positive_int, default=64)
    p.add_argument("--no-decode", action="store_true", help="products only")
    p.add_argument("--no-sweep", action="store_true", help="leave out the sweep over every layer's weights")


def _measure(args: argparse.Namespace) -> dict:
    dtype = getattr(torch, args.dtype)
    result = {"products": measure_products(args.preset, dtype, args.rows, args.rounds, args.calls)}
    if not args.no_sweep:
        result["sweep"] = measure_sweep(args.preset, dtype, args.rows, args.rounds)
    if not args.no_decode:
        result["decode"] = measure_decode(args.preset, dtype, args.pairs, args.batch, args.tokens, args.prompt_len)
    return result


def _report(args: argparse.Namespace, result: dict) -> None:
    """The figures of ``main``'s result on stdout: products per row count, the sweep's, the decode's."""
    prod = result["products"]
    print(f"products ({prod['preset']}, {prod['dtype']}, widened for oneDNN: {prod['widened']}; {prod['library']}), "
          f"median of {prod['rounds']} rounds:")
    for n, summary in prod["rows"].items():
        for name, r in summary.items():
            print(f"  {n:>3} rows {name:>5}: onednn {1e3 * r['onednn_s']:8.2f} ms, "
                  f"kernel {1e3 * r['kernel_s']:8.2f} ms, onednn / kernel {r['onednn_over_kernel']:.2f}")
    if "sweep" in result:
        sw = result["sweep"]
        print(f"every layer's products in a forward's order ({sw['weight_bytes'] / 2 ** 20:.0f} MiB of weights, "
              f"kernel: {sw['kernel']}), median of {sw['rounds']} rounds:")
        for n, r in sw["rows"].items():
            where = "" if r["on_kernel"] else " (past the kernel's rows: oneDNN on both sides)"
            print(f"  {n:>3} rows: onednn {1e3 * r['onednn_s']:8.2f} ms, kernel {1e3 * r['kernel_s']:8.2f} ms, "
                  f"onednn / kernel {r['onednn_over_kernel']:.2f}{where}")
    if "decode" in result:
        r = result["decode"]
        print(f"decode ({r['batch']} requests, {r['tokens']} tokens, {r['pairs']} pairs): ITL p50 off "
              f"{1e3 * r['off_s']:.1f} ms, on {1e3 * r['on_s']:.1f} ms, off / on {r['off_over_on']:.3f}")


if __name__ == "__main__":
    sys.exit(main())
