"""``mmcache bench serve``: the OpenAI-compatible server (``mmcache serve``) as its clients see it.

    mmcache bench serve [--quick] [--json PATH] [--preset P] [--repeats N] [--rates R1,R2] [--soak [N]] ...

Each part starts a server in this process (``mmcache.server.start_server``: loopback, a free port) and drives
it with the async ``openai`` client, streaming.

* Low load: the multi-turn VLM chats of ``benchmarks.vlm`` (its photos of ``datasets/images`` and LLaVA-Bench
  questions; each turn sends the whole history, the earlier answers as the text the server returned), one
  request at a time. Each request goes both over HTTP and to an in-process ``VLMEngine`` of the same preset,
  engine config and store budget: the same messages, sampling (greedy, end of turn ignored) and salt, the
  order alternating pair by pair. Time to first token is what a caller sees: from sending the request (or
  calling ``stream``) to the first chunk with text (in process: the first token whose decode, done as the
  server does it, adds text); the time to the first chunk of any kind (in process: the first token event) is
  reported beside it. What HTTP adds is the median over a repeat's requests of the paired difference, then
  the median over repeats; the target is at most max(5 ms, 5% of the in-process median).
  Each repeat has its own ``cache_salt``, so it starts cold on both sides. The cached-token share is the sum
  of ``usage.prompt_tokens_details.cached_tokens`` over the sum of prompt tokens, beside the in-process
  engine's matched share on the same requests.
* Open loop (``--rates``): the same chats as sessions arriving at Poisson times (``benchmarks.loadgen``), each
  rate under its own salt (more sessions than chats: the chats again, in order), on the server above
  (``mmcache``) and then on one with the cache off (``mmcache_nocache``: no page reuse, every encoder output
  bypasses the store); SLOs from the low-load run (5x its HTTP p50 TTFT, 2x the in-process p50 time per
  output token, the same for both engines); attainment, p50/p90/p99 per rate and goodput (the highest rate
  at which 90% of requests meet both). The JSON has issue 44's shape (``load.engines.ENGINE.vlm_chat``).
* Soak (``--soak N``): ``benchmarks.serve_soak``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import statistics
import sys
import time

import torch

from mmcache.engine.models import DTYPES
from mmcache.errors import MmcacheError
from mmcache.openmp import loaded_runtime

from . import loadgen
from .options import (MAX_PAGE_SIZE, MAX_REPEATS, MAX_REQUESTS, MAX_THREADS, MAX_TOKENS, count, fill_sizes, real,
                      seed)
from .table import Row
from .text_workloads import WorkloadShapeError

DESCRIPTION = ("the OpenAI-compatible server from its clients: TTFT added by HTTP at low load, cached_tokens share "
               "on multi-turn VLM chat, open-loop SLO attainment, and a soak of mixed requests")

PRESETS = ("tiny-llava", "bench-llava")
STORE_BYTES = 256 * 2**20
MAX_POOL_TOKENS = MAX_TOKENS
TTFT_FLOOR_S = 0.005  # the target: HTTP adds at most this or TTFT_SHARE of the in-process TTFT, the larger
TTFT_SHARE = 0.05
SLO_TTFT_TIMES, SLO_TPOT_TIMES = 5.0, 2.0  # open-loop SLOs, times the low-load p50s (see slos)
MAX_RATE = 1000.0

FULL = dict(preset="bench-llava", images=4, users=2, turns=4, max_tokens=8, repeats=5, rates="0.5,1,2",
            sessions=12, soak=0, time_limit=600.0)
QUICK = dict(preset="tiny-llava", images=2, users=2, turns=3, max_tokens=4, repeats=4, rates="4", sessions=4,
             soak=60, time_limit=120.0)
SOAK_DEFAULT = 3000  # --soak without a count


class RequestFailed(MmcacheError, RuntimeError):
    """A request the benchmark measures failed (over HTTP or in process): its figures would mean nothing."""


def rates_list(text: str) -> list[float]:
    """An argparse ``type``: comma-separated request rates (sessions per second), each in (0, MAX_RATE]."""
    out = []
    for part in text.split(","):
        rate = real(0.0)(part)
        if not 0 < rate <= MAX_RATE:
            raise argparse.ArgumentTypeError(f"a rate must lie in (0, {MAX_RATE:g}], got {part!r}")
        out.append(rate)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=PRESETS, default=None,
                   help=f"the VLM preset served (default {FULL['preset']}, quick {QUICK['preset']})")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="default bfloat16 for bench-llava, float32 for tiny-llava")
    p.add_argument("--page-size", type=count(MAX_PAGE_SIZE), default=16)
    p.add_argument("--num-pages", type=count(MAX_POOL_TOKENS), default=2048,
                   help=f"KV pages per engine (pages times page size at most {MAX_POOL_TOKENS})")
    p.add_argument("--threads", type=count(MAX_THREADS), default=1, help="torch CPU threads while measuring")
    p.add_argument("--seed", type=seed, default=0)
    s = p.add_argument_group("sizes (default: the full run's, or the quick one's with --quick)")
    for name, high, what in (("images", 4, "photos the chats use"), ("users", 64, "chats per photo"),
                             ("turns", 64, "turns per chat"), ("max_tokens", 4096, "tokens per answer"),
                             ("repeats", MAX_REPEATS, "low-load repeats, each under its own salt"),
                             ("sessions", MAX_REQUESTS, "chats per open-loop rate")):
        s.add_argument("--" + name.replace("_", "-"), type=count(high), default=None, metavar="N",
                       help=f"{what} (default {FULL[name]}, quick {QUICK[name]}; at most {high})")
    s.add_argument("--rates", type=rates_list, default=None, metavar="R1,R2",
                   help=f"open-loop rates, sessions per second (default {FULL['rates']}, quick {QUICK['rates']})")
    s.add_argument("--no-load", action="store_true", help="skip the open-loop part")
    s.add_argument("--soak", type=count(MAX_REQUESTS, minimum=0), nargs="?", const=SOAK_DEFAULT, default=None,
                   metavar="N", help=f"requests of the soak (alone: {SOAK_DEFAULT}; default {FULL['soak']}, "
                                     f"quick {QUICK['soak']}; 0: no soak)")
    s.add_argument("--soak-preset", choices=PRESETS, default="tiny-llava",
                   help="the preset the soak's server serves (it checks what requests leave held, not speed)")
    s.add_argument("--soak-concurrency", type=count(1024), default=16, metavar="N",
                   help="soak requests in flight at most")
    s.add_argument("--time-limit", type=real(1.0), default=None, metavar="S",
                   help=f"seconds each open-loop rate and the soak may run (default {FULL['time_limit']:g}, "
                        f"quick {QUICK['time_limit']:g})")


def settle(args) -> None:
    """Fill sizes and defaults, and check what argparse could not (typed errors)."""
    full, quick = dict(FULL), dict(QUICK)
    full["rates"], quick["rates"] = rates_list(full["rates"]), rates_list(quick["rates"])
    fill_sizes(args, full, quick)
    if args.dtype is None:
        args.dtype = default_dtype(args.preset)
    if args.num_pages * args.page_size > MAX_POOL_TOKENS:
        raise WorkloadShapeError(f"a pool of {args.num_pages} pages of {args.page_size} tokens is above "
                                 f"{MAX_POOL_TOKENS} tokens")


def default_dtype(preset: str) -> str:
    return "bfloat16" if preset == "bench-llava" else "float32"


def _progress(msg: str) -> None:
    print(f"[serve] {msg}", file=sys.stderr, flush=True)


# ---- workload --------------------------------------------------------------------------------------------
def data_url(image: bytes) -> str:
    """``image`` (PNG or JPEG bytes) as a data URL."""
    mime = "image/png" if image[:8] == b"\x89PNG\r\n\x1a\n" else "image/jpeg" if image[:2] == b"\xff\xd8" else None
    if mime is None:
        raise WorkloadShapeError("only PNG and JPEG images are sent")
    return f"data:{mime};base64," + base64.b64encode(image).decode("ascii")


def openai_user_message(chat, turn: int) -> dict:
    """Turn ``turn`` of a ``benchmarks.vlm.Chat`` as an OpenAI user message: images as data-URL parts."""
    parts = []
    for part in chat.user_message(turn)["content"]:
        if part["type"] == "image":
            parts.append({"type": "image_url", "image_url": {"url": data_url(part["image"])}})
        else:
            parts.append(part)
    return {"role": "user", "content": parts}


def chat_plan(args) -> list:
    """The chats of ``benchmarks.vlm`` at this run's sizes."""
    from . import vlm

    shape = vlm.Shape(images=args.images, users=args.users, turns=args.turns, max_tokens=args.max_tokens, runs=1,
                      guard_requests=0, guard_runs=0)
    return vlm.chats(shape)[0]


def sessions(plan, options: dict) -> list[loadgen.Session]:
    return [loadgen.Session([{"role": "system", "content": c.system}],
                            [openai_user_message(c, t) for t in range(len(c.questions))], options) for c in plan]


# ---- engines ---------------------------------------------------------------------------------------------
def engine_config(args, cache_mode: str = "on"):
    from mmcache.engine import EngineConfig

    return EngineConfig(page_size=args.page_size, num_pages=args.num_pages, cache_mode=cache_mode)


def server_config(args, cache_mode: str = "on", **changes):
    """The server of ``args``' preset; ``cache_mode`` "off": no KV page reuse and a store of one byte, which
    every encoder output bypasses (the vision tower runs for every image of every request)."""
    from mmcache.server import ServerConfig

    return ServerConfig(preset=args.preset, dtype=args.dtype, engine_config=engine_config(args, cache_mode),
                        store_bytes=STORE_BYTES if cache_mode == "on" else 1, **changes)


def in_process(args):
    """A ``VLMEngine`` built by the server's own builder from the server's config: same preset, dtype, engine
    config, store budget and image limits."""
    from mmcache.server import build_engine

    return build_engine(server_config(args))


def client(base_url: str, api_key: str = "none"):
    import openai

    return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=300.0)


def sampling_fields(args) -> dict:
    """The request fields of every measured turn (greedy, a fixed length: end of turn ignored)."""
    return {"max_tokens": args.max_tokens, "temperature": 0.0}


def in_process_turn(front, messages: list, args, salt: str) -> dict:
    """One request to the in-process engine, timed as a caller sees it: from calling ``stream`` to the first
    token event, to the first token that makes text (decoded as the server decodes, held-back text included:
    the server's own ``TextAssembler``), and to the finished event."""
    from mmcache.engine import SamplingParams
    from mmcache.engine.vlm import VLMRequest
    from mmcache.server.generation import TextAssembler

    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    text = TextAssembler(front.engine.tokenizer, [])
    start = time.perf_counter()
    first_event = last_event = first_text = out = None
    for ev in front.stream([VLMRequest(messages=messages, sampling=sampling, salt=salt)]):
        if ev.finished:
            out = ev.output
            continue
        now = time.perf_counter()
        first_event, last_event = first_event or now, now
        if text.add(ev.token_id) and first_text is None:
            first_text = now
    end = time.perf_counter()
    if out is None or out.error is not None:
        raise out.error if out is not None else RequestFailed("the in-process request ended without output")
    if first_text is None and text.flush():
        first_text = end
    return {"ttft": None if first_text is None else first_text - start, "first_event": first_event - start,
            "e2e": end - start, "prompt_tokens": out.prompt_len, "matched": out.matched_tokens,
            "output_tokens": len(out.output_ids), "text": text.text,
            "tpot": (last_event - first_event) / (len(out.output_ids) - 1) if len(out.output_ids) > 1 else None}


# ---- low load: HTTP beside the in-process engine ---------------------------------------------------------
async def low_load(srv, front, plan, args) -> list[dict]:
    """Every turn of every chat, ``args.repeats`` times: one pair (HTTP, in-process) at a time."""
    api = client(srv.base_url)
    fields = dict(sampling_fields(args), model=srv.config.model_name)
    warm = [{"role": "user", "content": [{"type": "text", "text": "Describe the photo."},
                                         openai_user_message(plan[0], 0)["content"][0]]}]
    await _http_turn(api, warm, fields, "warm-up")  # connection, first forward, allocator: not measured
    in_process_turn(front, warm, args, "warm-up")
    pairs, k = [], 0
    for rep in range(args.repeats):
        salt = f"serve-bench-{args.seed}-{rep}"
        histories = [[{"role": "system", "content": c.system}] for c in plan]
        for turn in range(args.turns):
            for ci, chat in enumerate(plan):
                messages = histories[ci] + [openai_user_message(chat, turn)]
                sides = {}
                for side in (("http", "local") if k % 2 == 0 else ("local", "http")):
                    if side == "http":
                        sides[side] = await _http_turn(api, messages, fields, salt)
                    else:
                        sides[side] = in_process_turn(front, messages, args, salt)
                k += 1
                pairs.append(dict(repeat=rep, turn=turn, chat=ci, http=sides["http"], local=sides["local"]))
                histories[ci] = messages + [{"role": "assistant", "content": sides["http"]["text"]}]
    await api.close()
    return pairs


async def _http_turn(api, messages: list, fields: dict, salt: str) -> dict:
    record = loadgen.Record(0, 0, "", time.perf_counter())
    body = dict(fields, messages=messages, extra_body={"cache_salt": salt, "ignore_eos": True})
    await loadgen.stream_chat(api, body, record)
    if record.outcome != "ok" or record.first_chunk is None:
        raise RequestFailed(f"a low-load request failed over HTTP: {record.status} {record.error}")
    return {"ttft": record.ttft, "first_event": record.first_chunk - record.send, "e2e": record.e2e,
            "tpot": record.tpot, "prompt_tokens": record.prompt_tokens, "matched": record.cached_tokens,
            "output_tokens": record.output_tokens, "text": record.text}


def paired(pairs: list[dict], key: str) -> dict | None:
    """HTTP against in-process on ``key`` (``ttft``: first text; ``first_event``: first chunk or token event)
    over the pairs where both sides have it: per repeat the median of the paired differences and ratios, and
    the medians of those over repeats. None when no pair has it."""
    med = statistics.median
    both = [p for p in pairs if p["http"][key] is not None and p["local"][key] is not None]
    if not both:
        return None
    per_repeat = []
    for rep in sorted({p["repeat"] for p in both}):
        mine = [p for p in both if p["repeat"] == rep]
        per_repeat.append(dict(repeat=rep, pairs=len(mine),
                               added_p50_s=med(p["http"][key] - p["local"][key] for p in mine),
                               http_p50_s=med(p["http"][key] for p in mine),
                               in_process_p50_s=med(p["local"][key] for p in mine),
                               ratio_p50=med(p["http"][key] / p["local"][key] for p in mine)))
    local = med(p["local"][key] for p in both)
    added = med(r["added_p50_s"] for r in per_repeat)
    target = max(TTFT_FLOOR_S, TTFT_SHARE * local)
    return {"pairs": len(both), "added_p50_s": added,
            "added_share_p50": med(r["added_p50_s"] / r["in_process_p50_s"] for r in per_repeat),
            "added_all_pairs_p50_s": med(p["http"][key] - p["local"][key] for p in both),
            "ratio_p50": med(r["ratio_p50"] for r in per_repeat),
            "http_p50_s": med(p["http"][key] for p in both), "in_process_p50_s": local,
            "target_added_s": target, "target_met": added <= target, "per_repeat": per_repeat}


def summarise_low_load(pairs: list[dict], turns: int) -> dict:
    """The HTTP path against the in-process engine: time to first text (the headline, what a client sees) and
    to the first chunk or token event, cached-token shares overall and per turn, and whether both sides saw
    the same prompts and gave the same answers."""
    med = statistics.median
    share = lambda ps, side: sum(p[side]["matched"] for p in ps) / sum(p[side]["prompt_tokens"] for p in ps)
    per_turn = []
    for t in range(turns):
        mine = [p for p in pairs if p["turn"] == t]
        text = paired(mine, "ttft")
        per_turn.append(dict(turn=t + 1, cached_tokens_share=share(mine, "http"),
                             in_process_matched_share=share(mine, "local"),
                             http_ttft_p50_s=text and text["http_p50_s"],
                             in_process_ttft_p50_s=text and text["in_process_p50_s"],
                             added_ttft_p50_s=text and text["added_p50_s"]))
    tpots = lambda side: [p[side]["tpot"] for p in pairs if p[side]["tpot"] is not None]
    ttft, first = paired(pairs, "ttft"), paired(pairs, "first_event")
    head = ttft or first  # a model that never makes text: the first event stands in
    return {
        "requests": len(pairs), "repeats": len({p["repeat"] for p in pairs}),
        "ttft_rule": "first text" if ttft else "first event",
        "added_ttft_p50_s": head["added_p50_s"], "added_ttft_share_p50": head["added_share_p50"],
        "http_ttft_p50_s": head["http_p50_s"], "in_process_ttft_p50_s": head["in_process_p50_s"],
        "ttft_ratio_p50": head["ratio_p50"], "target_added_ttft_s": head["target_added_s"],
        "target_met": head["target_met"],
        "time_to_first_text": ttft, "time_to_first_event": first,
        "http_tpot_p50_s": med(tpots("http")) if tpots("http") else None,
        "in_process_tpot_p50_s": med(tpots("local")) if tpots("local") else None,
        "http_e2e_p50_s": med(p["http"]["e2e"] for p in pairs),
        "in_process_e2e_p50_s": med(p["local"]["e2e"] for p in pairs),
        "cached_tokens_share": share(pairs, "http"), "in_process_matched_share": share(pairs, "local"),
        "cached_tokens_share_later_turns": share([p for p in pairs if p["turn"] > 0], "http") if turns > 1 else None,
        "prompt_tokens_equal": all(p["http"]["prompt_tokens"] == p["local"]["prompt_tokens"] for p in pairs),
        "cached_tokens_equal": all(p["http"]["matched"] == p["local"]["matched"] for p in pairs),
        "outputs_equal_share": sum(p["http"]["text"] == p["local"]["text"] for p in pairs) / len(pairs),
        "per_turn": per_turn,
    }


# ---- open loop -------------------------------------------------------------------------------------------
def slos(low_load: dict) -> dict:
    """The open-loop SLOs from the unloaded figures: TTFT as a client saw it over HTTP, TPOT as the engine made
    tokens (over HTTP, at low load, a request's few tokens can arrive in one burst, which says nothing of the
    pace a loaded server keeps)."""
    tpot = low_load["in_process_tpot_p50_s"] or low_load["http_tpot_p50_s"] or low_load["http_ttft_p50_s"]
    return {"ttft_s": SLO_TTFT_TIMES * low_load["http_ttft_p50_s"], "tpot_s": SLO_TPOT_TIMES * tpot,
            "rule": f"{SLO_TTFT_TIMES:g}x the low-load HTTP p50 TTFT, {SLO_TPOT_TIMES:g}x the in-process p50 TPOT"}


async def open_loop_rates(srv, plan, args, slo: dict) -> dict:
    """Every rate of ``args.rates`` on ``srv``: its figures per rate and the goodput."""
    fields = dict(sampling_fields(args), model=srv.config.model_name)
    api = client(srv.base_url)
    rows = []
    for i, rate in enumerate(args.rates):
        options = dict(fields, extra_body={"cache_salt": f"serve-load-{args.seed}-{i}", "ignore_eos": True})
        work = [s for _ in range(-(-args.sessions // len(plan))) for s in sessions(plan, options)][: args.sessions]
        _progress(f"open loop, cache {srv.config.engine_config.cache_mode}: {rate:g} sessions/s, "
                  f"{len(work)} sessions")
        records = await loadgen.open_loop(lambda key: api, work, rate, args.seed + i, args.time_limit)
        s = loadgen.summarise(records, slo["ttft_s"], slo["tpot_s"])
        rows.append(dict(rate=rate, attainment=s["attainment"], ttft_p50_s=s["ttft_p50_s"],
                         ttft_p90_s=s["ttft_p90_s"], ttft_p99_s=s["ttft_p99_s"], tpot_p50_s=s["tpot_p50_s"],
                         tpot_p90_s=s["tpot_p90_s"], tpot_p99_s=s["tpot_p99_s"], e2e_p50_s=s["e2e_p50_s"],
                         e2e_p99_s=s["e2e_p99_s"], throughput_tok_s=s["throughput_tok_s"],
                         matched_share=s["matched_share"], requests=s["requests"], outcomes=s["outcomes"],
                         statuses=s["statuses"]))
    await api.close()
    return {"slo": slo, "goodput_rps": loadgen.goodput(rows), "rates": rows}


# ---- entry points ----------------------------------------------------------------------------------------
def run(args) -> dict:
    from mmcache.server import start_server

    settle(args)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    load_before, t0 = os.getloadavg(), time.perf_counter()
    result: dict = {}
    try:
        plan = chat_plan(args)
        _progress(f"building {args.preset} ({args.dtype}): the server's engine and the in-process one")
        front = in_process(args)
        with start_server(server_config(args)) as srv:
            _progress(f"low load: {args.repeats} x {len(plan)} chats x {args.turns} turns, HTTP beside in-process")
            pairs = asyncio.run(low_load(srv, front, plan, args))
            result["low_load"] = summarise_low_load(pairs, args.turns)
            ll = result["low_load"]
            slo = slos(ll)
            engines = {}
            if not args.no_load:
                engines["mmcache"] = {"vlm_chat": asyncio.run(open_loop_rates(srv, plan, args, slo))}
            _check_idle(srv)
        front.check_invariants()
        if not args.no_load:
            with start_server(server_config(args, cache_mode="off")) as srv:
                engines["mmcache_nocache"] = {"vlm_chat": asyncio.run(open_loop_rates(srv, plan, args, slo))}
                _check_idle(srv)
            result["load"] = {"slo": slo, "engines": engines}
        if args.soak:
            from .serve_soak import soak

            _progress(f"soak: {args.soak} requests on {args.soak_preset}")
            result["soak"] = soak(args)
    finally:
        torch.set_num_threads(threads)
    result["config"] = {k: getattr(args, k) for k in ("preset", "dtype", "page_size", "num_pages", "threads", "seed",
                                                      "images", "users", "turns", "max_tokens", "repeats",
                                                      "rates", "sessions", "soak", "soak_preset",
                                                      "soak_concurrency", "time_limit")}
    result["config"].update(store_bytes=STORE_BYTES, quick=bool(args.quick), no_load=bool(args.no_load))
    result["machine"] = {"cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                         "seconds": time.perf_counter() - t0, "openmp": loaded_runtime()}
    return result


def _check_idle(srv) -> None:
    """After the measured parts: the server's engine holds nothing and its invariants hold."""
    from .serve_soak import LeftHeld, held_after, wait_idle

    idle = wait_idle(srv.host, 30.0)
    held = held_after(srv.host)
    if not idle or any(held.values()):
        raise LeftHeld(f"after the low-load and open-loop parts: idle {idle}, held {held}")


def table_rows(result: dict) -> list[Row]:
    rows = []
    ll = result.get("low_load")
    if ll:
        rows.append(Row("serve", "TTFT p50 over HTTP, one request at a time", ll["http_ttft_p50_s"], "s",
                        ll["in_process_ttft_p50_s"], versus="in-process engine",
                        paired=1 / ll["ttft_ratio_p50"] if ll["ttft_ratio_p50"] else None))
        rows.append(Row("serve", "TTFT added by HTTP (median of paired differences)", 1000 * ll["added_ttft_p50_s"],
                        "ms", target=f"<= {1000 * ll['target_added_ttft_s']:.3g} ms (5 ms or 5%)"))
        rows.append(Row("serve", "cached_tokens share, multi-turn VLM chat", ll["cached_tokens_share"], "",
                        ll["in_process_matched_share"], versus="in-process matched", higher_is_better=True))
    load = result.get("load")
    if load:
        on, off = (load["engines"][e]["vlm_chat"] for e in ("mmcache", "mmcache_nocache"))
        for r, r_off in zip(on["rates"], off["rates"]):
            if r["attainment"] is not None:
                rows.append(Row("serve", f"open loop {r['rate']:g} sessions/s: SLO attainment", r["attainment"], "",
                                r_off["attainment"], higher_is_better=True, target=">= 0.9 counts for goodput"))
        rows.append(Row("serve", "goodput, VLM chat (90% within SLOs; 0: no rate)", on["goodput_rps"] or 0.0,
                        "sessions/s", off["goodput_rps"] or 0.0, higher_is_better=True))
    soak = result.get("soak")
    if soak:
        rows.append(Row("serve", f"soak: {soak['requests']} requests, unexpected outcomes",
                        float(soak["unexpected"]), "", target="0"))
        rows.append(Row("serve", "soak: requests, pages and leases held after", float(sum(soak["held_after"].values())),
                        "", target="0"))
    return rows
