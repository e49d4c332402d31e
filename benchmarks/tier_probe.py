"""Time to first token of one prompt served four ways: a pool hit, a host-tier hit, a disk-tier hit, a recompute.

    python -m benchmarks.tier_probe [--preset small] [--dtype float32] [--prompt-tokens 2048] [--repeats 5]
                                    [--page-size 16] [--disk-dir DIR] [--warm-disk] [--json PATH]

Two engines share one model: one with a host tier, one with a disk tier only. Each repeat draws a fresh prompt
and, on the first engine, empties pool and tiers and serves it (recompute), serves it again (pool hit), moves
its pages down to host memory (``Engine.clear_cache(demote=True)``) and serves it again (host-tier hit); on the
second engine it serves it, moves its pages to disk and serves it again (disk-tier hit). Before the disk hit the
file's pages are written out and dropped from the OS page cache (``posix_fadvise``), so the read comes from the
device, unless ``--warm-disk``. Each request asks for one token: its TTFT is the engine's arrival to first
token. Figures are medians over the repeats; the JSON holds every sample, the matched tokens and the tiers'
counters. Without ``--disk-dir`` the disk tier lives in a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile

import numpy as np
import torch

from mmcache.engine import Engine, EngineConfig, Request, SamplingParams
from mmcache.presets.text import PRESETS, build_model

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def _serve(engine: Engine, prompt: list, rid: str) -> tuple[float, int]:
    out = engine.generate([Request(prompt, ONE_TOKEN, request_id=rid)])[0]
    if out.error is not None:
        raise RuntimeError(f"request {rid} failed: {out.error}")
    return out.ttft, out.matched_tokens


def _drop_from_page_cache(engine: Engine) -> None:
    """Write the disk tier's file out and drop its pages from the OS page cache (this file's only)."""
    disk = engine.managers["main"].tiers.level("disk")
    os.fsync(disk.fd)
    os.posix_fadvise(disk.fd, 0, 0, os.POSIX_FADV_DONTNEED)


def probe(preset: str, dtype: str, prompt_tokens: int, repeats: int, page_size: int, disk_dir: str,
          warm_disk: bool) -> dict:
    model, tok = build_model(preset, dtype)
    pages = -(-prompt_tokens // page_size) * 2 + 8
    base = dict(page_size=page_size, num_pages=pages, max_tokens_per_step=max(4096, prompt_tokens))
    page_bytes = Engine(model, tok, EngineConfig(page_size=page_size, num_pages=1, cache_mode="off")).page_bytes
    tier_bytes = page_bytes * pages
    host_engine = Engine(model, tok, EngineConfig(host_tier_bytes=tier_bytes, **base))
    disk_engine = Engine(model, tok, EngineConfig(disk_tier_bytes=tier_bytes, disk_tier_dir=disk_dir, **base))
    rng = np.random.default_rng(0)
    vocab = min(int(getattr(model.config, "vocab_size", 512)), 8192)
    samples: dict[str, list] = {"recompute": [], "pool": [], "host": [], "disk": []}
    matched: dict[str, list] = {k: [] for k in samples}
    for r in range(repeats + 1):  # the first round warms up and is not kept
        prompt = rng.integers(2, vocab, size=prompt_tokens).tolist()
        runs = []
        host_engine.clear_cache()
        runs.append(("recompute", _serve(host_engine, prompt, f"r{r}-recompute")))
        runs.append(("pool", _serve(host_engine, prompt, f"r{r}-pool")))
        host_engine.clear_cache(demote=True)
        runs.append(("host", _serve(host_engine, prompt, f"r{r}-host")))
        disk_engine.clear_cache()
        _serve(disk_engine, prompt, f"r{r}-disk-first")
        disk_engine.clear_cache(demote=True)
        if not warm_disk:
            _drop_from_page_cache(disk_engine)
        runs.append(("disk", _serve(disk_engine, prompt, f"r{r}-disk")))
        if r:
            for name, (ttft, m) in runs:
                samples[name].append(ttft)
                matched[name].append(m)
    medians = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "preset": preset, "dtype": dtype, "prompt_tokens": prompt_tokens, "repeats": repeats,
        "page_size": page_size, "page_bytes": host_engine.page_bytes, "warm_disk": warm_disk,
        "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "ttft_median_s": medians, "ttft_s": samples, "matched_tokens": matched,
        "host_vs_recompute": medians["recompute"] / medians["host"],
        "disk_vs_recompute": medians["recompute"] / medians["disk"],
        "tiers": {"host": host_engine.metrics()["main"]["tiers"], "disk": disk_engine.metrics()["main"]["tiers"]},
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--disk-dir", default=None)
    p.add_argument("--warm-disk", action="store_true", help="leave the disk file in the OS page cache")
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result = probe(args.preset, args.dtype, args.prompt_tokens, args.repeats, args.page_size,
                       args.disk_dir or tmp, args.warm_disk)
    med = result["ttft_median_s"]
    for name in ("pool", "host", "disk", "recompute"):
        print(f"{name:>9}: TTFT median {med[name] * 1000:8.2f} ms  matched {result['matched_tokens'][name][-1]}")
    print(f"host tier vs recompute: {result['host_vs_recompute']:.1f}x; "
          f"disk tier vs recompute: {result['disk_vs_recompute']:.1f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
