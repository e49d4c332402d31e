"""``mmcache export-model`` and ``mmcache generate``.

    mmcache export-model PRESET DIR [--dtype bfloat16]     write an embedded preset (text or VLM) as a Hugging
                                                           Face folder, with a chat template
    mmcache generate (--preset NAME | --model DIR) PROMPT ... [--max-tokens N] [--temperature T] [--top-k K]
                     [--top-p P] [--seed S] [--cache-mode on|off|shadow]

``generate`` prints one JSON line per prompt, in order, a failed request's with its typed error; it exits 1
when any request failed (the others' lines are printed all the same), else 0. ``export-model`` exits 1 with
one line on stderr when the folder cannot be made or written.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..presets.text import PRESETS
from ..presets.vlm import VLM_PRESETS
from .models import DTYPES


def register(sub) -> None:
    p = sub.add_parser("export-model", help="write an embedded model preset as a Hugging Face folder",
                       description="Write PRESET (" + ", ".join(list(PRESETS) + list(VLM_PRESETS)) + ") to DIR: "
                                   "config.json, model.safetensors, tokenizer files and a chat template (and a "
                                   "VLM's image processor), loadable by transformers, vLLM and mmcache serve "
                                   "--model DIR.")
    p.add_argument("preset", choices=list(PRESETS) + list(VLM_PRESETS))
    p.add_argument("dir")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.set_defaults(func=export_main)

    g = sub.add_parser("generate", help="generate from text prompts with the reference engine",
                       description="One JSON line per prompt, in order; a failed request's line carries its "
                                   "error, and the command then exits 1.")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", choices=list(PRESETS))
    src.add_argument("--model", metavar="DIR", help="a local Hugging Face model folder")
    g.add_argument("prompts", nargs="+")
    g.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                   help="default: float32 for presets, bfloat16 for --model")
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    g.add_argument("--top-k", type=int, default=0, help="keep the K most likely tokens (0: all)")
    g.add_argument("--top-p", type=float, default=1.0, help="keep the smallest set covering P of the mass")
    g.add_argument("--seed", type=int, default=None,
                   help="seed of every request's sampling (default: drawn from the engine's seeded generator)")
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--cache-mode", default="on", choices=["on", "off", "shadow"])
    g.set_defaults(func=generate_main)


def export_main(args: argparse.Namespace) -> int:
    from ..presets.export import ModelExportError, export_model

    try:
        out = export_model(args.preset, args.dir, args.dtype)
    except ModelExportError as e:  # a folder that is not new, empty or an export's; no permission, no space
        print(f"mmcache export-model: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.preset} ({args.dtype}) to {out}")
    return 0


def generate_main(args: argparse.Namespace) -> int:
    from ..presets.text import engine_from_preset
    from .config import EngineConfig
    from .engine import Engine
    from .request import SamplingParams

    config = EngineConfig(page_size=args.page_size, cache_mode=args.cache_mode)
    if args.preset:
        eng = engine_from_preset(args.preset, dtype=args.dtype or "float32", config=config)
    else:
        eng = Engine.from_pretrained(args.model, dtype=args.dtype or "bfloat16", config=config)
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, seed=args.seed)
    failed = False
    for out in eng.generate(args.prompts, sampling):
        failed |= out.error is not None
        print(json.dumps({"request_id": out.request_id, "text": out.text, "output_ids": out.output_ids,
                          "finish_reason": out.finish_reason, "matched_tokens": out.matched_tokens,
                          "error": str(out.error) if out.error else None}))
    return 1 if failed else 0
