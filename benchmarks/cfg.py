"""Autoregressive classifier-free guidance: the negative branch's prefix reused through the page cache.

Each request carries its own positive prompt (PartiPrompts, drawn with the diffusion benchmark's Zipf
stream) and one fixed negative prompt (Wan's default negative prompt), decoded in lockstep with guidance
(logits = uncond + scale * (cond - uncond)). The negative branch has its own pool and index, so from the
second request on its prompt pages are seeded instead of recomputed. Cache on and cache off run the same
requests one at a time on two engines built from the same preset, alternating which goes first; each of
``--runs`` runs starts with both engines' caches cleared, and its first request (which fills the cache, and in
the first run warms both engines) is left out. ``ttft_p50_s`` and ``latency_p50_s`` are medians over runs of
each run's median over its requests. ``ttft_ratio_paired`` is the median over runs of each run's median over
requests of (cache-off TTFT / cache-on TTFT of the same request), which were served side by side
(``ttft_ratio_paired_runs``: each run's); the table's "better by" (``paired``) is this figure.
``ttft_ratio_on_over_off`` is the ratio of the two p50s, as before. Outputs of the two engines are
compared token for token (``tokens_equal``; under this default schedule the guided bf16 logits can flip a
near-tie, see RESULTS). ``exact_check``: the first three requests again under the exact schedule
(``EngineConfig.exact``), where every logits row of both branches must be equal bit for bit with the cache on
and off while the negative prompt's pages hit.

``negative_matched_share``: the negative prompt's tokens seeded from the cache over its length (capped by the
keep-one-token rule). ``compute_bound_ttft_ratio``: the share of a request's prefill tokens the cache cannot
skip (positive prompt + the negative prompt's last, recomputed page), the best case for cache-on TTFT over
cache-off TTFT if time were proportional to prefill tokens.
"""

from __future__ import annotations

import statistics

import torch

from mmcache.presets.local_tokenizers import parti_prompts, wan_negative_prompt
from mmcache.engine import Engine, EngineConfig, Request, SamplingParams
from mmcache.engine.models import DTYPES
from mmcache.presets.text import PRESETS

from .diffusion import zipf_stream
from .options import MAX_PAGE_SIZE, MAX_REPEATS, MAX_REQUESTS, MAX_THREADS, count, fill_sizes, real, seed
from .table import Row
from mmcache.presets import engine_from_preset

DESCRIPTION = "autoregressive CFG with a fixed negative prompt: negative-branch reuse, TTFT cache on vs off"
MAX_CONTEXT = max(p.config["max_position_embeddings"] for p in PRESETS.values())  # the longest preset context
# Wan's negative prompt is about 400 tokens (4 repeats: 1617), so 64 repeats nearly fill the 32k context.
MAX_NEGATIVE_REPEAT = 64
FULL = {"requests": 24, "max_tokens": 8, "negative_repeat": 4, "runs": 3}
# --quick's values for the options not given; one run, as a run of the quick stream takes about a minute on the
# development machine (the cache-off prefills of the negative prompt)
QUICK = {"requests": 6, "max_tokens": 4, "negative_repeat": 2, "runs": 1}


def add_arguments(p) -> None:
    p.add_argument("--preset", default="small", choices=list(PRESETS),
                   help="engine preset (default: small, the 8-layer Qwen2.5-0.5B shape)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--requests", type=count(MAX_REQUESTS), default=None,
                   help=f"requests in the stream (default {FULL['requests']}, quick {QUICK['requests']})")
    p.add_argument("--runs", type=count(MAX_REPEATS), default=None,
                   help=f"runs of the stream, caches cleared before each; figures are medians over runs "
                        f"(default {FULL['runs']}, quick {QUICK['runs']})")
    p.add_argument("--max-tokens", type=count(MAX_CONTEXT), default=None,
                   help=f"tokens per request (default {FULL['max_tokens']}, quick {QUICK['max_tokens']}); with "
                        "the prompts, within the preset's context")
    p.add_argument("--scale", type=real(), default=3.0, help="guidance scale (a finite number)")
    p.add_argument("--negative-repeat", type=count(MAX_NEGATIVE_REPEAT), default=None,
                   help="the negative prompt repeated this many times, a longer fixed conditioning prefix "
                        f"(default {FULL['negative_repeat']}, quick {QUICK['negative_repeat']}; at most "
                        f"{MAX_NEGATIVE_REPEAT}, about 26k tokens)")
    p.add_argument("--page-size", type=count(MAX_PAGE_SIZE), default=128)
    p.add_argument("--threads", type=count(MAX_THREADS), default=None, help="torch threads (default: torch's own)")
    p.add_argument("--seed", type=seed, default=0)


def _engine(args, mode: str) -> Engine:
    cfg = EngineConfig(page_size=args.page_size, cache_mode=mode, kv_cache_bytes=512 << 20, max_num_seqs=4)
    return engine_from_preset(args.preset, dtype=args.dtype, config=cfg)


def _serve(eng: Engine, rid, prompt: str, negative: str, args):
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    out = eng.generate([Request(prompt, sampling, request_id=rid, negative_prompt=negative,
                                guidance_scale=args.scale)])[0]
    if out.error is not None:
        raise out.error
    return out


def _run_once(engines: dict, prompts: list[str], negative: str, args, run: int) -> tuple[dict, bool]:
    """One run of the stream on both engines, their caches cleared first: per mode the figures of every request
    after the first, and whether every request's tokens were equal."""
    for eng in engines.values():
        eng.clear_cache()
    rows = {m: [] for m in engines}
    same = True
    for i, prompt in enumerate(prompts):
        order = ("on", "off") if (i + run) % 2 == 0 else ("off", "on")
        outs = {m: _serve(engines[m], f"{run}-{i}", prompt, negative, args) for m in order}
        same &= outs["on"].output_ids == outs["off"].output_ids
        if i == 0:
            continue  # the first request fills the cache (and, in the first run, warms both engines)
        for m, o in outs.items():
            rows[m].append({"ttft_s": o.ttft, "latency_s": o.token_times[-1] - o.arrival_time,
                            "negative_matched": o.negative_matched_tokens, "prompt_len": o.prompt_len})
    return rows, same


def paired_ttft_ratio(off: list[dict], on: list[dict]) -> float:
    """The median over requests of (cache-off TTFT / cache-on TTFT of the same request): the two were served side
    by side, so the machine's drift over the stream cancels pair by pair."""
    return statistics.median(a["ttft_s"] / b["ttft_s"] for a, b in zip(off, on, strict=True))


def run(args) -> dict:
    fill_sizes(args, FULL, QUICK)
    if args.threads:
        torch.set_num_threads(args.threads)
    negative = "，".join([wan_negative_prompt()] * args.negative_repeat)
    prompts = zipf_stream(parti_prompts(), args.requests + 1, 1.1, args.seed)
    engines = {"on": _engine(args, "on"), "off": _engine(args, "off")}
    neg_len = len(engines["on"].tokenizer.encode(negative))
    runs = [_run_once(engines, prompts, negative, args, r) for r in range(args.runs)]
    page = args.page_size
    result = {"preset": args.preset, "dtype": args.dtype, "requests": args.requests, "runs": args.runs,
              "negative_tokens": neg_len, "guidance_scale": args.scale, "page_size": page,
              "tokens_equal": all(same for _, same in runs)}
    for m in engines:
        every = [r for rows, _ in runs for r in rows[m]]
        result[m] = {
            "ttft_p50_s": statistics.median(statistics.median(r["ttft_s"] for r in rows[m]) for rows, _ in runs),
            "latency_p50_s": statistics.median(statistics.median(r["latency_s"] for r in rows[m])
                                               for rows, _ in runs),
            "negative_matched_share": sum(r["negative_matched"] for r in every) / (neg_len * len(every)),
        }
    result["exact_check"] = exact_check(args, prompts[:3], negative)
    pos = statistics.mean(r["prompt_len"] for r in runs[0][0]["on"])
    reusable = ((neg_len - 1) // page) * page
    result["compute_bound_ttft_ratio"] = (pos + neg_len - reusable) / (pos + neg_len)
    result["ttft_ratio_on_over_off"] = result["on"]["ttft_p50_s"] / result["off"]["ttft_p50_s"]
    ratios = [paired_ttft_ratio(rows["off"], rows["on"]) for rows, _ in runs]
    result["ttft_ratio_paired"], result["ttft_ratio_paired_runs"] = statistics.median(ratios), ratios
    return result


def exact_check(args, prompts: list[str], negative: str) -> dict:
    """``prompts`` served one by one with the cache on and off under the exact schedule; both branches' logits
    rows compared with ``torch.equal``, output ids compared, and the cache-on run must seed the negative prompt."""
    from mmcache.engine.inspect import record_logits, rows_equal

    runs = {}
    for mode in ("on", "off"):
        cfg = EngineConfig.exact(page_size=args.page_size, cache_mode=mode, kv_cache_bytes=512 << 20)
        eng = engine_from_preset(args.preset, dtype=args.dtype, config=cfg)
        rec = record_logits(eng)
        runs[mode] = (rec, [_serve(eng, f"exact-{i}", p, negative, args) for i, p in enumerate(prompts)])
        eng.check_invariants()
    (rec_on, on), (rec_off, off) = runs["on"], runs["off"]
    logits_equal = [rows_equal(rec_on, rec_off, o.request_id, 2 * len(o.output_ids)) for o in on]  # 2 branches
    tokens_equal = [a.output_ids == b.output_ids for a, b in zip(on, off)]
    seeded = [o.negative_matched_tokens for o in on]
    return {"bit_exact": all(logits_equal) and all(tokens_equal) and all(n > 0 for n in seeded[1:]),
            "logits_equal": logits_equal, "tokens_equal": tokens_equal, "negative_matched_on": seeded,
            "schedule": "EngineConfig.exact: serial, one page per prefill forward"}


def table_rows(r: dict) -> list[Row]:
    return [
        Row("cfg", "bit-exact (exact schedule, on vs off)", float(r["exact_check"]["bit_exact"]), target="1"),
        Row("cfg", "TTFT p50, fixed negative prompt", r["on"]["ttft_p50_s"], "s", r["off"]["ttft_p50_s"],
            target=f"compute bound {r['compute_bound_ttft_ratio']:.2f} of off", paired=r["ttft_ratio_paired"]),
        Row("cfg", "negative prompt tokens seeded", r["on"]["negative_matched_share"], "", None,
            target=f"default schedule, tokens equal: {r['tokens_equal']}", higher_is_better=True),
    ]
