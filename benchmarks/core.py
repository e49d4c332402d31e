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
* eviction scaling: the same per 1000 pages from full pools of 4k, 64k and 256k cached one-page tails (one
  shared first page, distinct second pages): the cost of a batch must not grow with the pool.
* commit in-lock time: microseconds a decode commit holds the manager's lock at 1k and 32k tokens of context,
  for a commit that completes no page and for one that completes a generated page.
* metadata: bytes of pool and index metadata per page, measured with tracemalloc over a full index.
* digest: MB/s of the content digest (BLAKE2b-256) against xxh3_128 on 1 and 16 MB buffers, and the digest's
  share of a tiny-llava request's and a voice-cloning request's latency, cold and on a hit.
"""

from __future__ import annotations

import hashlib
import pickle
import statistics
import threading
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


EVICT_POOLS = (4096, 65536, 262144)
EVICT_BATCH = 1000  # pages a live request takes per timed round
COMMIT_CONTEXTS = (1024, 32768)


def _one_page_tails(num_pages: int) -> AllocationManager:
    """A full pool of cached one-page tails: one shared first page and ``num_pages - 1`` distinct second pages
    under it, stamped oldest first. That is the state ``num_pages - 1`` teardowns of two-page prompts leave;
    it is written in bulk through the index's arrays (a teardown each would take longer than the figure), and
    ``check_invariants`` confirms it."""
    mgr = _manager(num_pages)
    pool, index = mgr.pool, mgr.index
    pages = pool.take(num_pages)
    pool.ids[pages, 0] = np.arange(num_pages, dtype=np.int32)  # distinct pages; the rest of each page is 0
    material = mgr.namer.root_material(b"")
    head = mgr.namer.names(pool.ids[pages[0]], mgr.namer.root_of(material))
    index.insert_run(head, pages[:1], index.root_parent(material), [None])
    tails = pages[1:]
    names = np.fromiter((mgr.namer._hash(memoryview(pool.ids[t]).cast("B"), int(head[0])) for t in tails.tolist()),
                        dtype=np.uint64, count=len(tails))
    index._slots_insert(names, tails)
    index.name[tails], index.parent[tails], index.children[tails] = names, pages[0], 0
    index.in_index[tails], index.has_extras[tails] = True, False
    index.children[pages[0]] = len(tails)
    index.size += len(tails)
    index.stamp[tails] = index._clock + np.arange(len(tails))
    index._clock += len(tails)
    index.offer(tails)
    mgr.check_invariants()
    return mgr


def bench_evict_scaling(repeats: int) -> dict:
    """Milliseconds per 1000 pages evicted (one-page batches) from full pools of ``EVICT_POOLS`` pages: a live
    request reserves 1000 more pages per round, an untimed round first, then up to 3 timed ones (the 4k pool
    holds 4095 tails); the median."""
    out = {}
    rounds = 1 + min(3, max(1, repeats))
    for n in EVICT_POOLS:
        mgr = _one_page_tails(n)
        mgr.admit("live", [1])
        times = []
        for r in range(rounds):
            t0 = time.perf_counter()
            mgr.reserve("live", (r + 1) * EVICT_BATCH * PAGE)
            times.append(time.perf_counter() - t0)
        assert mgr.metrics.evicted_pages == mgr.metrics.eviction_batches == rounds * EVICT_BATCH
        times = times[1:]  # the first round warms the code paths up
        out[f"pages_{n}"] = statistics.median(times) * 1e3
    out["largest_over_smallest"] = out[f"pages_{EVICT_POOLS[-1]}"] / out[f"pages_{EVICT_POOLS[0]}"]
    return out


class _HeldLock:
    """A stand-in for the manager's lock that adds up how long it is held (``held_s``, ``holds``)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.held_s = 0.0
        self.holds = 0
        self._since = 0.0

    def acquire(self, *args) -> bool:
        got = self._lock.acquire(*args)
        self._since = time.perf_counter()
        return got

    def release(self) -> None:
        self.held_s += time.perf_counter() - self._since
        self.holds += 1
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    __enter__ = acquire

    def __exit__(self, *exc) -> None:
        self.release()


def bench_commit_in_lock(repeats: int) -> dict:
    """In-lock microseconds of decode commits at each of ``COMMIT_CONTEXTS`` tokens of context: the median of
    one-token commits that complete no page (``decode_us``) and of those that complete a generated page
    (``page_fill_us``), one of each per generated page over ``8 * repeats`` pages (the rest of each page is
    committed at once, untimed)."""
    out = {}
    pages_out = 8 * repeats
    rng = np.random.default_rng(3)
    for ctx in COMMIT_CONTEXTS:
        mgr = _manager(ctx // PAGE + pages_out + 2)
        prompt = rng.integers(0, 151_936, size=ctx).astype(np.int32)
        mgr.admit("r", prompt)
        mgr.reserve("r", ctx + pages_out * PAGE)
        mgr.commit("r", prompt)
        lock = mgr._lock = _HeldLock()
        decode, fill = [], []
        for _ in range(pages_out):
            mgr.commit("r", rng.integers(0, 151_936, size=PAGE - 2))
            for times in (decode, fill):
                before = lock.held_s
                mgr.commit("r", [int(rng.integers(0, 151_936))])
                times.append(lock.held_s - before)
        assert mgr.state("r").seq_len == ctx + pages_out * PAGE
        mgr.teardown("r")
        out[f"context_{ctx}"] = {"decode_us": statistics.median(decode) * 1e6,
                                 "page_fill_us": statistics.median(fill) * 1e6}
    return out


def eviction_rows(r: dict) -> list[Row]:
    rows = [Row("core", f"eviction per 1000 pages, pool of {n // 1024}k one-page tails",
                r["evict_scaling"][f"pages_{n}"], "ms") for n in EVICT_POOLS]
    for ctx in COMMIT_CONTEXTS:
        c = r["commit_in_lock_us"][f"context_{ctx}"]
        rows.append(Row("core", f"commit in-lock time, {ctx // 1024}k context, page fill", c["page_fill_us"], "us"))
        rows.append(Row("core", f"commit in-lock time, {ctx // 1024}k context, decode", c["decode_us"], "us"))
    return rows


DIGEST_BUFFERS_MB = (1, 16)


def bench_digest(repeats: int) -> dict:
    """Throughput of the content digest (``names.media_digest``: BLAKE2b-256) against xxh3_128, the digest it
    replaced, on the same random buffers of 1 and 16 MB, timed in turns; MB/s medians and the paired ratio."""
    import xxhash

    from mmcache.names import media_digest

    out = {}
    for mb in DIGEST_BUFFERS_MB:
        buf = np.random.default_rng(mb).integers(0, 256, size=mb << 20, dtype=np.uint8).tobytes()
        rates: dict[str, list] = {"blake2b_256": [], "xxh3_128": []}
        for _ in range(max(3, repeats)):
            for name, fn in (("blake2b_256", lambda: media_digest(buf)), ("xxh3_128", lambda: xxhash.xxh3_128(buf))):
                t0 = time.perf_counter()
                fn()
                rates[name].append(mb * 2**20 / 1e6 / (time.perf_counter() - t0))
        out[f"{mb}mb"] = {**{f"{k}_mb_s": statistics.median(v) for k, v in rates.items()},
                          "xxh3_over_blake2b": statistics.median(x / b for x, b in zip(rates["xxh3_128"],
                                                                                      rates["blake2b_256"]))}
    return out


def _digest_share(digest, request, repeats: int) -> dict:
    """Milliseconds of one request's content digests (``digest()``) and of the request (``request()``) cold (the
    first, encoder run) and on a hit (the median of the next ``repeats``), with the digest's share of each."""
    t0 = time.perf_counter()
    request()
    cold = time.perf_counter() - t0
    hit = _median_time(request, repeats)
    cost = _median_time(digest, max(5, repeats))
    return {"digest_ms": cost * 1e3, "cold_ms": cold * 1e3, "hit_ms": hit * 1e3,
            "share_cold": cost / cold, "share_hit": cost / hit}


def bench_digest_share_vlm(repeats: int) -> dict:
    """The digest's share of a tiny-llava request with one photo (``datasets/images/chelsea.png``, 8 new tokens)."""
    from pathlib import Path

    from mmcache.engine import EngineConfig, SamplingParams
    from mmcache.hosts.vlm import VLMRequest
    from mmcache.presets import vlm_from_preset
    from mmcache.names import media_digest

    image = (Path(__file__).resolve().parents[1] / "datasets" / "images" / "chelsea.png").read_bytes()
    eng = vlm_from_preset("tiny-llava", config=EngineConfig(page_size=16, num_pages=256))
    params = eng.builder.adapter.preprocess_params
    chat = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What is it?"}]}]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = _digest_share(lambda: media_digest(image, params),
                        lambda: eng.generate([VLMRequest(messages=chat, sampling=greedy)]), repeats)
    return {**out, "image_bytes": len(image)}


def bench_digest_share_voice(repeats: int) -> dict:
    """The digest's share of a voice-cloning request (CSM with the tiny codec, the voice benchmark's first
    reference clip, 1 frame): the codec's key digests the waveform it receives."""
    import torch

    from encoders.audio import decode_audio, read_audio
    from encoders.codec import CachedCodecEncode
    from encoders.voice import SAMPLING_RATE, voice_prompt
    from mmcache.presets.tts import csm_pipeline
    from mmcache.names import media_digest
    from mmcache.store import EncoderOutputStore

    from .voice import DATASET_FILES, load_cases

    case = load_cases()[0]
    vp = csm_pipeline(codec="tiny")
    enc = CachedCodecEncode(vp.codec, EncoderOutputStore(1 << 28))
    wave = decode_audio(read_audio(case.reference_wav, limits=DATASET_FILES), SAMPLING_RATE)

    def request():
        inputs = vp.processor(text=[voice_prompt(case.reference_text, case.target_text)], audio=[wave],
                              return_tensors="pt", sampling_rate=SAMPLING_RATE)
        with enc, torch.inference_mode():
            vp.model.generate(**inputs, max_new_tokens=1, do_sample=False, output_audio=True)

    out = _digest_share(lambda: media_digest(memoryview(wave)), request, repeats)
    return {**out, "waveform_bytes": wave.nbytes, "codec_hits": enc.hits}


def digest_figures(repeats: int) -> dict:
    """The ``digest`` part of the result: throughput and the shares of a VLM and a voice request."""
    return {"throughput": bench_digest(repeats), "vlm_request": bench_digest_share_vlm(repeats),
            "voice_request": bench_digest_share_voice(repeats)}


def digest_rows(d: dict) -> list[Row]:
    big = d["throughput"][f"{DIGEST_BUFFERS_MB[-1]}mb"]
    return [
        Row("core", f"content digest (BLAKE2b-256), {DIGEST_BUFFERS_MB[-1]} MB", big["blake2b_256_mb_s"], "MB/s",
            big["xxh3_128_mb_s"], "xxh3_128 (not collision-resistant)", higher_is_better=True,
            paired=1 / big["xxh3_over_blake2b"]),
        Row("core", "digest share of a tiny VLM hit request", 100 * d["vlm_request"]["share_hit"], "%"),
        Row("core", "digest share of a voice hit request", 100 * d["voice_request"]["share_hit"], "%"),
    ]


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
        "evict_scaling": bench_evict_scaling(repeats),
        "commit_in_lock_us": bench_commit_in_lock(repeats),
        "digest": digest_figures(repeats),
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
        *(eviction_rows(r) if "evict_scaling" in r else []),
        *(digest_rows(r["digest"]) if "digest" in r else []),
    ]
