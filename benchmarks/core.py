"""Core costs: naming throughput against two public schemes, lookup, eviction, metadata per page.

* naming: mmcache's chained xxHash 64 (``AllocationManager.prepare`` on the int32 array the engine keeps per
  request, validation included; ``mmcache_from_list_mtok_s`` adds the one-time list-to-array conversion)
  against the two schemes other engines use, re-implemented here from their descriptions, on Python lists,
  their native form: vLLM's default (SHA-256 over the pickled tuple (parent hash, token tuple, extras)) and
  transformers' continuous batching (blake2b with an 8-byte digest over the parent hash and the int32 ids).
  All three name the same pages of the same tokens.
* lookup: ``admit`` of a prepared prompt whose first k pages are cached: probe, verify, increment (names
  computed beforehand, as the engine does outside the lock); then the request is aborted, untimed.
* eviction: a live request takes 1000 pages from a pool full of cached 16-page runs.
* metadata: bytes of pool and index metadata per page, measured with tracemalloc over a full index.
"""

from __future__ import annotations

import hashlib
import pickle
import statistics
import time
import tracemalloc
from array import array

import numpy as np

from mmcache import AllocationManager, CacheConfig, Fingerprint
from .options import MAX_REPEATS, MAX_TOKENS, count, fill_sizes
from .table import Row

DESCRIPTION = "core costs: naming, lookup, eviction, metadata per page"
PAGE = 128
SLOW_SHARE = 8  # the reference schemes, about 15x slower, name 1/SLOW_SHARE of the tokens per repeat
MIN_TOKENS = SLOW_SHARE * PAGE  # fewer, and they name no page at all: nothing to time, no ratio


FULL = {"repeats": 7, "tokens": 1 << 20}
QUICK = {"repeats": 3, "tokens": 1 << 18}  # --quick's values for the options not given


def add_arguments(p) -> None:
    p.add_argument("--repeats", type=count(MAX_REPEATS), default=None,
                   help=f"timed repeats per figure (the median is kept; default {FULL['repeats']}, quick "
                        f"{QUICK['repeats']}; at most {MAX_REPEATS})")
    p.add_argument("--tokens", type=count(MAX_TOKENS, minimum=MIN_TOKENS), default=None,
                   help=f"tokens named per naming repeat (default {FULL['tokens']}, quick {QUICK['tokens']}; at least "
                        f"{MIN_TOKENS}, so that the reference schemes, which name 1/{SLOW_SHARE} of them, name a "
                        f"{PAGE}-token page; at most {MAX_TOKENS})")


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _sha256_pickle(tokens: list, page: int) -> list:
    parent, out = b"", []
    for i in range(0, len(tokens) - page + 1, page):
        parent = hashlib.sha256(pickle.dumps((parent, tuple(tokens[i:i + page]), None),
                                             protocol=pickle.HIGHEST_PROTOCOL)).digest()
        out.append(parent)
    return out


def _blake2b(tokens: list, page: int) -> list:
    parent, out = None, []
    for i in range(0, len(tokens) - page + 1, page):
        h = hashlib.blake2b(digest_size=8)
        if parent is not None:
            h.update(parent.to_bytes(8, "little"))
        h.update(array("i", tokens[i:i + page]).tobytes())
        parent = int.from_bytes(h.digest(), "little")
        out.append(parent)
    return out


def _manager(num_pages: int) -> AllocationManager:
    fp = Fingerprint(model_digest="bench", kv_dtype="none", attention_backend="none", page_size=PAGE)
    return AllocationManager(CacheConfig(num_pages=num_pages, page_size=PAGE), fp)


def _store(mgr: AllocationManager, rid, tokens: np.ndarray) -> None:
    res = mgr.admit(rid, tokens)
    mgr.reserve(rid, len(tokens) - res.matched_tokens)
    mgr.commit(rid, tokens[res.matched_tokens:])
    mgr.teardown(rid)


def bench_naming(tokens: int, repeats: int) -> dict:
    """Naming throughput of mmcache and of the two reference schemes, measured side by side.

    Each repeat times every scheme once, in an order that rotates between repeats, so that load swings on a
    shared machine fall on all of them alike; each figure is the median over repeats, and the ratios are the
    medians of the per-repeat ratios. A rate counts the tokens of the pages named, not a partial last page.
    ``tokens`` is at least ``MIN_TOKENS`` (ValueError otherwise).
    """
    if tokens < MIN_TOKENS:
        raise ValueError(f"naming needs at least {MIN_TOKENS} tokens, got {tokens}")
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 151_936, size=tokens).astype(np.int32)
    ids = arr.tolist()
    mgr = _manager(8)
    small = ids[: tokens // SLOW_SHARE]
    named, small_named = tokens // PAGE * PAGE, len(small) // PAGE * PAGE
    schemes = {"mmcache": (lambda: mgr.prepare(arr), named), "mmcache_from_list": (lambda: mgr.prepare(ids), named),
               "sha256_pickle": (lambda: _sha256_pickle(small, PAGE), small_named),
               "blake2b": (lambda: _blake2b(small, PAGE), small_named)}
    names = list(schemes)
    rates: dict[str, list] = {k: [] for k in names}
    for r in range(max(3, repeats)):
        for k in names[r % len(names):] + names[:r % len(names)]:
            fn, n = schemes[k]
            t0 = time.perf_counter()
            fn()
            rates[k].append(n / (time.perf_counter() - t0) / 1e6)
    ratio = lambda k: statistics.median(a / b for a, b in zip(rates["mmcache"], rates[k]))
    return {
        **{f"{k}_mtok_s": statistics.median(v) for k, v in rates.items()},
        "vs_sha256_pickle": ratio("sha256_pickle"),
        "vs_blake2b": ratio("blake2b"),
        "tokens": tokens,
        "page_size": PAGE,
    }


def bench_lookup(repeats: int) -> dict:
    out = {}
    for k in (1, 100, 1000):
        mgr = _manager(k + 8)
        rng = np.random.default_rng(k)
        tokens = rng.integers(0, 151_936, size=k * PAGE + 1)
        _store(mgr, "warm", tokens)
        prep = mgr.prepare(tokens)
        times = []
        for i in range(repeats):
            t0 = time.perf_counter()
            res = mgr.admit(("probe", i), prep)
            times.append(time.perf_counter() - t0)
            assert res.matched_pages == k
            mgr.abort(("probe", i))
        out[f"pages_{k}"] = statistics.median(times) * 1e3
    return out


def bench_evict(repeats: int) -> float:
    run_pages, want = 16, 1000
    times = []
    for r in range(max(3, repeats // 2)):
        runs = -(-want // run_pages) + 4
        mgr = _manager(runs * run_pages)
        rng = np.random.default_rng(r)
        for i in range(runs):
            _store(mgr, i, rng.integers(0, 151_936, size=run_pages * PAGE))
        assert mgr.pool.num_free == 0
        mgr.admit("live", [1])
        t0 = time.perf_counter()
        mgr.reserve("live", want * PAGE)
        times.append(time.perf_counter() - t0)
        assert mgr.metrics.evicted_pages >= want
    return statistics.median(times) * 1e3 * 1000 / want


def bench_metadata() -> dict:
    pages = 4096
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 151_936, size=16 * PAGE) for _ in range(pages // 16)]  # input, not metadata
    _store(_manager(16), "warm-up", prompts[0])  # first-use allocations of the code paths are not per page
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    mgr = _manager(pages)
    for i, tokens in enumerate(prompts):
        _store(mgr, i, tokens)
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert mgr.index.size == pages
    return {"traced": used / pages, "arrays": mgr.metadata_nbytes() / pages}


def run(args) -> dict:
    fill_sizes(args, FULL, QUICK)
    repeats, tokens = args.repeats, args.tokens
    meta = bench_metadata()
    return {
        "naming": bench_naming(tokens, repeats * 3),
        "lookup_ms": bench_lookup(repeats * 3),
        "evict_ms_per_1000_pages": bench_evict(repeats),
        "metadata_bytes_per_page": meta["traced"],
        "metadata_array_bytes_per_page": meta["arrays"],
        "quick": bool(args.quick),
    }


def table_rows(r: dict) -> list[Row]:
    n = r["naming"]
    return [
        Row("core", "page naming throughput", n["mmcache_mtok_s"], "Mtok/s", n["sha256_pickle_mtok_s"],
            "vLLM sha256(pickle)", ">= 10x sha256", higher_is_better=True, paired=n["vs_sha256_pickle"]),
        Row("core", "page naming throughput", n["mmcache_mtok_s"], "Mtok/s", n["blake2b_mtok_s"],
            "transformers blake2b", higher_is_better=True, paired=n["vs_blake2b"]),
        Row("core", "hit lookup, 1000 pages", r["lookup_ms"]["pages_1000"], "ms", target="<= 1 ms"),
        Row("core", "hit lookup, 100 pages", r["lookup_ms"]["pages_100"], "ms"),
        Row("core", "eviction per 1000 pages", r["evict_ms_per_1000_pages"], "ms"),
        Row("core", "metadata per 128-token page", r["metadata_bytes_per_page"], "B", target="<= 600 B"),
    ]
