"""umT5 layers at the real umT5-XXL shape: forward time with the model's own relative position bias against the
bias served from the store, paired forward by forward.

    python -m benchmarks.position_bias_layer --json position_bias_layer.json      # about 1 min

A ``UMT5EncoderModel`` of ``--layers`` layers of Wan's umT5-XXL (d_model 4096, d_ff 10240, gated GELU, 64
heads of 64; Wan-Video/Wan2.1 ``wan/modules/t5.py`` ``umt5_xxl``) with seeded random weights in ``--dtype``,
one prompt of ``--real`` tokens padded to ``--length`` (Wan's 512), one torch thread by default. Every layer of
umT5 owns a bias table, so a forward's share spent on the bias is the same for 1 layer as for the real 24; the
embedding table is cut to 1,000 rows (a lookup, not a product). Both sides run the same module: "own" calls the
model as the pipeline does, "served" inside ``PositionBiases.serving`` with a store that already holds the
biases (a hit, as for every request but the first). Sides alternate which goes first; reported are each side's
median and the median of the paired ratios (served over own: below 1, the store saves that share of a forward),
and whether the two sides' outputs are bit-identical.
"""

from __future__ import annotations

import argparse
import sys

from mmcache.cli import positive_int, writable

from .kernel_harness import in_turns, paired, say_machine, timed, write_json

REAL_UMT5_XXL_LAYER = dict(d_model=4096, d_kv=64, d_ff=10240, num_heads=64)  # wan/modules/t5.py umt5_xxl
DTYPES = ("bfloat16", "float32")


def umt5_layers(layers: int, length: int, real: int, dtype: str, seed: int, shape: dict):
    """A seeded umT5 encoder of ``layers`` layers of ``shape`` in ``dtype``, one prompt's ids and mask."""
    import torch
    from transformers import UMT5Config, UMT5EncoderModel

    cfg = UMT5Config(vocab_size=1000, num_layers=layers, dropout_rate=0.0, feed_forward_proj="gated-gelu", **shape)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = UMT5EncoderModel(cfg).to(getattr(torch, dtype)).eval()
        ids = torch.randint(3, cfg.vocab_size, (1, length))
    mask = torch.zeros(1, length, dtype=torch.long)
    mask[:, :real] = 1
    return model, ids, mask


def measure(layers: int, length: int, real: int, repeats: int, dtype: str, threads: int, seed: int = 0,
            shape: dict = REAL_UMT5_XXL_LAYER) -> dict:
    import torch

    from encoders.position_bias import PositionBiases
    from mmcache.store import EncoderOutputStore

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model, ids, mask = umt5_layers(layers, length, real, dtype, seed, shape)
        biases = PositionBiases(model)
        store = EncoderOutputStore(2 * biases.forward_bytes(length) * 4)  # room for them (BUDGET_SHARE = 4)

        def own():
            with torch.no_grad():
                return model(ids, attention_mask=mask).last_hidden_state

        def served():
            with torch.no_grad(), biases.serving(store, "benchmark", b"", length):
                return model(ids, attention_mask=mask).last_hidden_state

        identical = torch.equal(own(), served())  # also the warm-up of both sides, and the store's fill
        sides = {"own": own, "served": served}
        times = in_turns(tuple(sides), repeats, lambda side: timed(sides[side]))
        return {"layers": layers, "length": length, "real_tokens": real, "dtype": dtype, "threads": threads,
                "shape": dict(shape, num_layers=layers), "repeats": repeats,
                "bias_bytes_per_forward": biases.forward_bytes(length), "bit_identical": identical,
                **paired(times, "served", "own"), "per_forward_s": times,
                "biases_computed": biases.computed, "biases_served": biases.served}
    finally:
        torch.set_num_threads(before)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.position_bias_layer", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=positive_int, default=1, help="umT5-XXL layers in the model (the real has 24)")
    p.add_argument("--length", type=positive_int, default=512, help="text length, the prompt padded to it")
    p.add_argument("--real", type=positive_int, default=60, help="real tokens of the prompt (the mask's ones)")
    p.add_argument("--repeats", type=positive_int, default=7, help="forwards per side")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    p.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads while measuring")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    if not writable(args.json, p.prog):
        return 2
    if args.real > args.length:
        p.error("--real cannot exceed --length")
    say_machine(p.prog, kernels=False)
    r = measure(args.layers, args.length, args.real, args.repeats, args.dtype, args.threads)
    write_json(args.json, r)
    print(f"umT5-XXL x{r['layers']} layer(s), {r['dtype']}, {r['length']} tokens: own {1e3 * r['own_s']:.0f} ms, "
          f"served {1e3 * r['served_s']:.0f} ms per forward, served / own {r['served_over_own']:.3f} "
          f"(median of {r['repeats']} pairs); bit-identical {r['bit_identical']}; biases "
          f"{r['bias_bytes_per_forward'] / 2**20:.0f} MiB per forward")
    return 0


if __name__ == "__main__":
    sys.exit(main())
