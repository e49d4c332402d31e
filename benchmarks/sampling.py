"""``mmcache bench sampling``: what the engine's sampler costs per token, against sampling by the definition.

The definition (``by_definition``) is how a sampler is usually written, and how the engine's was before:
mask below the k-th logit, sort the whole vocabulary for top-p, softmax, ``torch.multinomial``. The engine's
(``mmcache.engine.sampling.sample``) finds the top-p nucleus among the best 256 or 4096 tokens, or by binning
the logits when it is larger, and draws one uniform number (inverse CDF). Both run side by side on the same rows, alternating, for each parameter set:

* per call, on one row of the Qwen2.5 vocabulary (151,936 logits) of two shapes: ``peaked`` (Zipf-like, as a
  trained model's next-token distribution is; the nucleus is small) and ``flat`` (standard normal, as a
  random-weight model's is; the nucleus is most of the vocabulary);
* in the engine: inter-token latency of a batch of requests decoding with top-p sampling on the ``small``
  preset (bf16), with the engine's sampler and with the definition patched in, runs alternating: ``ENGINE_PAIRS``
  pairs (2 quick, 5 full), run i of one sampler paired with run i of the other. ``itl_p50_s`` and
  ``itl_p50_definition_s`` are each sampler's median over its runs of the run's median gap; ``itl_ratio_paired``
  is the median over pairs of (definition's ITL / engine's ITL), ``itl_ratio_pairs`` each pair's ratio, so a
  slow minute that both runs of a pair share does not decide it (the table's "better by", marked ``paired``).
  Quick mode keeps two pairs, whose median is the mean of the two ratios (the table says so): on the shared
  2-core development machine a run took 17 to 28 s, mostly the batch's 2,048-token prefill, so a third pair
  would add 35 to 55 s.

``--quick`` uses fewer repeats, fewer pairs and a shorter decode.
"""

from __future__ import annotations

import statistics
import time
from unittest import mock

import torch

from mmcache.presets.text import PRESETS

from .options import MAX_REPEATS, MAX_REQUESTS, count
from .table import Row

DESCRIPTION = "per-token sampling cost (temperature, top-k, top-p) against a full-sort + multinomial sampler"
VOCAB = 151_936
PARAMS = {  # name: (temperature, top_k, top_p)
    "temperature 1.0": (1.0, 0, 1.0),
    "temperature 0.8, top-k 50": (0.8, 50, 1.0),
    "temperature 0.8, top-p 0.9": (0.8, 0, 0.9),
    "temperature 0.8, top-k 50, top-p 0.9": (0.8, 50, 0.9),
}
ENGINE_PRESET, PROMPT_LEN = "small", 256  # the engine run's model and its prompts' length
MAX_DECODE = PRESETS[ENGINE_PRESET].config["max_position_embeddings"] - PROMPT_LEN  # what the context leaves
# Full: odd, so the median is one pair's ratio, not the mean of the middle two; quick: two, for time (docstring).
ENGINE_PAIRS = {"quick": 2, "full": 5}


def add_arguments(p) -> None:
    p.add_argument("--repeats", type=count(MAX_REPEATS), default=None,
                   help=f"timed calls per sampler and case (default 41; quick 11; at most {MAX_REPEATS})")
    p.add_argument("--batch", type=count(MAX_REQUESTS), default=8,
                   help=f"requests decoding together in the engine run (at most {MAX_REQUESTS})")
    p.add_argument("--tokens", type=count(MAX_DECODE), default=None,
                   help=f"tokens per request in the engine run (default 32; quick 12; at most {MAX_DECODE}, what "
                        f"{ENGINE_PRESET}'s context leaves after a {PROMPT_LEN}-token prompt)")


def by_definition(logits: torch.Tensor, params, generator: torch.Generator | None) -> int:
    """Temperature, top-k, top-p and the draw written out directly: full sort, softmax, multinomial."""
    logits = logits.float()
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if 0 < params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        logits = logits.index_fill(0, order[drop], float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))


def rows(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.randperm(VOCAB, generator=gen).double() + 1
    return {"peaked": (-1.1 * torch.log(ranks) * 4).float().to(torch.bfloat16),
            "flat": torch.randn(VOCAB, generator=gen).to(torch.bfloat16)}


def _per_call(repeats: int) -> dict:
    from mmcache.engine import SamplingParams
    from mmcache.engine.sampling import sample

    out = {}
    for shape, row in rows().items():
        for name, (t, k, p) in PARAMS.items():
            sp = SamplingParams(temperature=t, top_k=k, top_p=p)
            times = {"mmcache": [], "definition": []}
            gens = {n: torch.Generator().manual_seed(0) for n in times}
            fns = {"mmcache": sample, "definition": by_definition}
            for n, f in fns.items():
                f(row, sp, gens[n])  # warm
            for r in range(repeats):
                order = list(fns) if r % 2 == 0 else list(fns)[::-1]
                for n in order:
                    t0 = time.perf_counter()
                    fns[n](row, sp, gens[n])
                    times[n].append(time.perf_counter() - t0)
            med = {n: statistics.median(v) for n, v in times.items()}
            out[f"{shape}: {name}"] = {"mmcache_ms": med["mmcache"] * 1e3, "definition_ms": med["definition"] * 1e3,
                                       "speedup": med["definition"] / med["mmcache"]}
    return out


def paired_ratio(engine: list[float], definition: list[float]) -> tuple[float, list[float]]:
    """The median over pairs of (definition's ITL / engine's ITL), run i of one with run i of the other, and
    the per-pair ratios: above 1, the engine's sampler is faster."""
    ratios = [d / e for e, d in zip(engine, definition, strict=True)]
    return statistics.median(ratios), ratios


def _engine_itl(batch: int, tokens: int, runs: int) -> dict:
    from mmcache.engine import EngineConfig, SamplingParams
    from mmcache.presets import engine_from_preset
    from mmcache.engine import engine as engine_module

    eng = engine_from_preset(ENGINE_PRESET, dtype="bfloat16", config=EngineConfig(cache_mode="off"))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 8000, (PROMPT_LEN,), generator=gen).tolist() for _ in range(batch)]
    sp = [SamplingParams(max_tokens=tokens, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True)
          for i in range(batch)]
    eng.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm

    def itl() -> float:
        outs = eng.generate(prompts, sp)
        gaps = [b - a for o in outs for a, b in zip(o.token_times, o.token_times[1:])]
        return statistics.median(gaps)

    res = {"mmcache": [], "definition": []}
    for r in range(runs):
        for n in (("mmcache", "definition") if r % 2 == 0 else ("definition", "mmcache")):
            if n == "definition":
                with mock.patch.object(engine_module, "sample", by_definition):
                    res[n].append(itl())
            else:
                res[n].append(itl())
    med = {n: statistics.median(v) for n, v in res.items()}
    ratio, ratios = paired_ratio(res["mmcache"], res["definition"])
    return {"batch": batch, "tokens": tokens, "runs": runs, "itl_p50_s": med["mmcache"],
            "itl_p50_definition_s": med["definition"], "itl_runs_s": res, "itl_ratio_paired": ratio,
            "itl_ratio_pairs": ratios}


def run(args) -> dict:
    repeats = args.repeats or (11 if args.quick else 41)
    tokens = args.tokens or (12 if args.quick else 32)
    return {"vocab": VOCAB, "repeats": repeats, "per_call": _per_call(repeats),
            "engine": _engine_itl(args.batch, tokens, ENGINE_PAIRS["quick" if args.quick else "full"])}


def table_rows(result: dict) -> list[Row]:
    out = []
    for case in ("peaked: temperature 0.8, top-p 0.9", "flat: temperature 0.8, top-p 0.9", "flat: temperature 1.0"):
        c = result["per_call"][case]
        out.append(Row("sampling", f"sampler, {case}", c["mmcache_ms"] / 1e3, "s", c["definition_ms"] / 1e3,
                       "sort + multinomial"))
    e = result["engine"]
    even = "" if e["runs"] % 2 else f"ratio: median of {e['runs']} pair ratios (even: mean of the middle two)"
    out.append(Row("sampling", f"decode ITL p50, {e['batch']} requests, top-p 0.9, {e['runs']} run pairs",
                   e["itl_p50_s"], "s", e["itl_p50_definition_s"], "sort + multinomial", target=even,
                   paired=e["itl_ratio_paired"]))
    return out
