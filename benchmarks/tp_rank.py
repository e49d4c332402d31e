"""One rank of ``mmcache bench tp``, started by torchrun (``python -m torch.distributed.run``), which sets
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``; the library use of tensor parallelism as a user's
script has it. With ``WORLD_SIZE`` 1 the engine runs without a group (tp=1).

    torchrun --nproc-per-node N -m benchmarks.tp_rank --preset P --dtype D --prompt-tokens T --repeats R
             --page-size S --out PATH

Rank 0 measures and writes PATH; every rank builds the same engines in the same order and the others follow.
What rank 0 measures (each figure's definition is in ``benchmarks.tp``):

* exactness: three prompts (one, the same again, a prompt sharing its first pages) under the exact schedule with
  the cache on and with it off: every logits row rank 0 samples from equal bit for bit, and every rank's digest
  of the logits it computed equal on and off;
* the probe: per repeat a fresh prompt of T tokens served cold, then again (a hit of every full page but the
  last token's), one output token each; TTFTs and matched tokens;
* the agreement: its calls, seconds and median per call on every rank, over the probe's admissions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import sys

import torch
import torch.distributed as dist

from mmcache.engine import EngineConfig, Request, SamplingParams
from mmcache.engine.tp_group import leave
from mmcache.engine.inspect import record_logits, rows_equal
from mmcache.presets.text import engine_from_preset, get_preset, preset_config

ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
FOUR = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _draw(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab - 10) for _ in range(n)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="small")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    if size > 1:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))

    def engine(**kw):
        return engine_from_preset(args.preset, args.dtype, EngineConfig(tensor_parallel_size=size,
                                                                       tensor_parallel_timeout_s=600, **kw))

    exact = dict(page_size=args.page_size, schedule="serial", prefill_chunk_tokens=args.page_size)
    probe = dict(page_size=args.page_size, max_num_seqs=4)
    if rank:
        for kw in (dict(exact), dict(exact, cache_mode="off"), probe):
            engine(**kw).follow()
        return 0

    vocab = preset_config(get_preset(args.preset)).vocab_size
    rng = random.Random(0)
    a = _draw(rng, 3 * args.page_size + 37, vocab)
    prompts = [a, a, a[: 2 * args.page_size] + _draw(rng, 21, vocab)]
    runs, digests = {}, {}
    for mode in ("on", "off"):
        e = engine(**exact, cache_mode=mode)
        if e.leader is not None:
            e.leader.query("record_logits")
        rows = record_logits(e)
        outs = e.generate([Request(q, FOUR, request_id=i) for i, q in enumerate(prompts)])
        runs[mode] = (rows, [o.output_ids for o in outs], [o.matched_tokens for o in outs])
        digests[mode] = e.leader.query("logits_digest")[1:] if e.leader is not None else []
        e.stop_group()
    exactness = {
        "logits_equal": all(rows_equal(runs["on"][0], runs["off"][0], i, FOUR.max_tokens) for i in range(3)),
        "tokens": runs["on"][1], "tokens_equal": runs["on"][1] == runs["off"][1],
        "matched_on": runs["on"][2], "follower_digests_equal": digests["on"] == digests["off"],
    }

    e = engine(**probe)

    cold, hit, matched, first_tokens = [], [], [], []
    for r in range(args.repeats + 1):  # the first round warms the model up (and the group) and is not counted
        prompt = _draw(rng, args.prompt_tokens, vocab)
        c = e.generate([Request(prompt, ONE, request_id=f"cold-{r}")])[0]
        h = e.generate([Request(prompt, ONE, request_id=f"hit-{r}")])[0]
        if c.error is not None or h.error is not None:
            raise RuntimeError(f"a probe request failed: {c.error or h.error}")
        if r:
            cold.append(c.ttft)
            hit.append(h.ttft)
            matched.append(h.matched_tokens)
            first_tokens.append([c.output_ids[0], h.output_ids[0]])
        e.clear_cache()
    agreement = []  # the probe engine's agreements on each rank (``GroupMinimum.summary``)
    if e.leader is not None:
        agreement = [e.leader.agreements["main"].summary()] + [
            dict(a["main"], catchup_median_ms=a.get("catchup_median_ms")) for a in e.leader.query("agreements")[1:]]
    e.stop_group()
    result = {
        "tp": size, "preset": args.preset, "dtype": args.dtype, "prompt_tokens": args.prompt_tokens,
        "page_size": args.page_size, "threads_per_rank": torch.get_num_threads(), "exactness": exactness,
        "cold_ttft_s": cold, "hit_ttft_s": hit, "matched_tokens": matched, "first_tokens": first_tokens,
        "cold_ttft_median_s": statistics.median(cold), "hit_ttft_median_s": statistics.median(hit),
        "speedup_median": statistics.median(c / h for c, h in zip(cold, hit)),
        "agreement_per_rank": agreement,
    }
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    try:
        code = main()
    finally:
        leave()
    sys.exit(code)
