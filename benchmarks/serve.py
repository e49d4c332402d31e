"""``mmcache bench serve``: the OpenAI-compatible server (``mmcache serve``) as its clients see it.

    mmcache bench serve [--quick] [--peers [--peer-batched-tokens B]] [--rates R1,R2] [--duration S]
                        [--load-repeats N] [--near-line F1,F2] [--json PATH] [--plot PATH] [--workloads W1,W2]
                        [--preset P] [--text-preset P] [--repeats N] [--soak [N]] [--host-tier-bytes N] ...
    mmcache bench serve --tune-peer B1,B2,... [--rates R1,R2] [--workloads W]     (vLLM's step budget only)
    mmcache bench serve --replicas N [--routers R1,R2] [--route-depth-tokens N] [--ray-address ADDR] ...
                                                 (the open loop through replicas on Ray Serve, routers compared)

Each part starts a server (``mmcache.presets.serve``: loopback, a free port) and drives it with the async
``openai`` client, streaming, except where the low-load part says otherwise. The low-load part runs the server in
its own process (``benchmarks.serve_process``), as ``mmcache serve`` runs, so the client shares no interpreter
with it; the other parts run it in this process.

* Low load (with ``vlm_chat``): the multi-turn VLM chats of ``benchmarks.vlm`` (its photos of
  ``datasets/images`` and LLaVA-Bench questions; each turn sends the whole history, the earlier answers as the
  text the server returned), one request at a time. Each request goes over HTTP through a lean client
  (``benchmarks.sse_client``: aiohttp, the body encoded with orjson), over HTTP through the ``openai`` client,
  and to an in-process ``VLMEngine`` of the same preset, engine config and store budget: the same messages,
  sampling (greedy, end of turn ignored) and salt (the ``openai`` client's suffixed, so that it meets the same
  cache state), the order rotating from request to request. Time to first token is what a caller sees: from
  sending the request (or calling ``stream``) to the first chunk with text (in process: the first token whose
  decode, done as the server does it, adds text); the time to the first chunk of any kind (in process: the
  first token event) is reported beside it. What HTTP adds is the median over a repeat's requests of the
  paired difference (lean client against in process), then the median over repeats; the target is at most
  max(5 ms, 5% of the in-process median). The same figure through the ``openai`` client is reported beside it:
  the difference is that client's own work. Each repeat has its own ``cache_salt``, so it starts cold on every
  side. The cached-token share is the sum of ``usage.prompt_tokens_details.cached_tokens`` over the sum of
  prompt tokens, beside the in-process engine's matched share on the same requests.
* Open loop (``benchmarks.serve_open_loop``, ``serve_sweep``, ``serve_summary``): every workload of
  ``--workloads`` on every engine at every rate of ``--rates``, through one load generator (Poisson arrivals
  from a seed, or the Mooncake trace's own times scaled to the rate; streaming, ``cache_salt`` per rate so each
  rate starts cold). Workloads: ``vlm_chat`` (the chats above, as sessions, each pass over them under its own
  salt; rate in sessions/s), ``multi_turn`` (vLLM's multi-turn shape; sessions/s), ``shared_prefix`` (SGLang's
  generated-shared-prefix shape; requests/s), ``mooncake`` (a slice of the Mooncake conversation trace, one
  token run per hash block; requests/s) and, named only, ``agent`` (the repository's agent sessions, each turn
  sent its tool wait after the previous answer ended; sessions/s), the text ones as token ids over ``/v1/completions``
  (``benchmarks.serve_workloads``) to ``--text-preset`` written as a model folder (``benchmarks.serve_model``),
  ``vlm_chat`` as chat messages to ``--preset`` written as a model folder with its chat template (``mmcache
  export-model``). Engines: ``mmcache_nocache`` (no page reuse, every encoder output bypasses the store; its
  unloaded latency in the first repeat sets each workload's SLOs), ``mmcache``, with ``--host-tier-bytes N``
  ``mmcache_tier`` (``mmcache`` with a host tier of N bytes below its pool), and with ``--peers`` vLLM's own
  OpenAI server on the same folders (the VLM's with ``--preset bench-llava``: vLLM takes no head size of 16, the
  tiny presets'), at its CPU server's defaults (``vllm_cpu``) and with ``--peer-batched-tokens``
  (``vllm_cpu_tuned``; ``benchmarks.serve_vllm``, whose ``--tune-peer`` sweep finds that value); both mmcache
  servers run ``mmcache serve``'s schedule (``mmcache.server.config.serve_engine_config``). After every rate an
  mmcache server must be idle with nothing held and ``check_invariants`` clean. Goodput per engine and workload:
  the highest rate at which 90% of requests meet both SLOs, over the ladder (default 0.0625 to 2, doubling, 16
  sessions a rate), the foot (for an engine that meets them at none of its rates, half the lowest rate and so
  on down to ``--min-rate``, default a quarter of the lowest; none in quick mode) and the rates near the line
  (``--near-line``: 0.75x and 1.5x the goodput rate; none in quick mode). ``--load-repeats N`` (default 3, quick
  1) runs all of it N times, seed ``--seed + k``: goodput is the median over repeats, each ratio of mmcache's
  goodput over another engine's is taken within each repeat and reported as median and range, and a ratio that
  rests on one ladder step (an attainment deciding it within 0.05 of the line) says so. The JSON has issue 44's
  shape (``slo``, ``engines.ENGINE.WORKLOAD``, every repeat's rows marked with it), with ``mmcache_over``
  (ratios), ``runs`` (seeds and engine order) and ``peer`` (what vLLM ran with); ``--plot`` writes SLO
  attainment and TTFT percentiles against rate (``benchmarks.serve_plot``).
* Replicas (``--replicas N``): only the open loop, through N replicas on Ray Serve, once per router of
  ``--routers``, compared (``benchmarks.serve_replicas``).
* Soak (``--soak N``): ``benchmarks.serve_soak``.
* Image, video and voice streams, store on against off (``--no-generation`` skips them):
  ``benchmarks.serve_generation``.
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
from mmcache.launcher.openmp import loaded_runtime

from . import loadgen, sse_client
from . import serve_generation as generation
from . import serve_replicas as replicas
from . import serve_sweep as sweep
from . import serve_workloads as sw
from .kernel_harness import order
from .options import (MAX_PAGE_SIZE, MAX_REPEATS, MAX_REQUESTS, MAX_THREADS, MAX_TOKENS, count, fill_sizes, real,
                      seed)
from .serve_summary import open_loop_rows
from .serve_vllm import TUNE_RATES, batched_tokens, batched_tokens_list, tune_rows
from .table import Row
from .text_workloads import WorkloadShapeError

DESCRIPTION = ("the OpenAI-compatible server from its clients: TTFT added by HTTP at low load, cached_tokens share "
               "on multi-turn VLM chat, open-loop SLO attainment, and a soak of mixed requests")

PRESETS = ("tiny-llava", "bench-llava")
STORE_BYTES = 256 * 2**20
MAX_POOL_TOKENS = MAX_TOKENS
MAX_HOST_TIER_BYTES = 2**40
TTFT_FLOOR_S = 0.005  # the target: HTTP adds at most this or TTFT_SHARE of the in-process TTFT, the larger
TTFT_SHARE = 0.05
MAX_RATE = 1000.0
MAX_DURATION_S = 3600.0
MAX_FACTOR = 16.0  # --near-line: a rate near the line is within a few ladder steps of the goodput rate
TEXT_PRESETS = ("tiny", "tiny-qwen2", "tiny-llama", "small", "qwen2.5-0.5b")
SIDES = ("http", "openai", "local")  # the low-load part's clients: lean HTTP, the openai client, in-process
MAX_WAITING = MAX_REQUESTS  # open loop: an arrival queues rather than being refused, as vLLM's server does

# The full sweep: a ladder of doublings low enough that the cache-off server meets the SLOs at its foot, and 16
# sessions (64 requests of 4 turns) per rate, so that one request moves attainment by under 2 points.
FULL = dict(preset="bench-llava", images=4, users=2, turns=4, max_tokens=8, repeats=5,
            rates="0.0625,0.125,0.25,0.5,1,2", sessions=16, soak=0, time_limit=600.0,
            workloads=",".join(sweep.WORKLOADS), text_preset="small", text_sessions=16, text_requests=16,
            text_turns=4, text_max_tokens=12, load_repeats=3, near_line="0.75,1.5")
# The quick run: two rates of one second of arrivals each (--duration 1). The lower sends one session, which overlaps
# none, so the cache-off server can meet its own SLOs there, as in the full run it meets them only where sessions
# hardly overlap; the higher sends four, where the cache-off server's repeated prefills stall the others' decodes
# and the cache-on server's short ones need not: a goodput ratio is then a number. Answers of 12 tokens, so that
# the TPOT SLO (2x the unloaded p50) spreads one interleaved prefill over many tokens.
QUICK = dict(preset="tiny-llava", images=2, users=2, turns=3, max_tokens=12, repeats=4, rates="1,4", sessions=4,
             duration=1.0, soak=60, time_limit=120.0, workloads=",".join(sweep.WORKLOADS), text_preset="tiny",
             text_sessions=3, text_requests=4, text_turns=2, text_max_tokens=8, load_repeats=1, near_line="none")
# Text workload shapes (lengths scaled from the published shapes so that a CPU serves them at a few per second)
# (a Mooncake block of at least a page, so that a shared block can be a cache hit)
TEXT_SHAPES = {"full": dict(scale=0.125, sp_per_group=6, sp_system=256, sp_question=32, mc_start=0, mc_block=16,
                            mc_prompt=1024),
               "quick": dict(scale=0.03, sp_per_group=2, sp_system=48, sp_question=8, mc_start=0, mc_block=16,
                             mc_prompt=256)}
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


def factors_list(text: str) -> tuple[float, ...]:
    """An argparse ``type``: comma-separated distinct factors of a goodput rate, each in (0, MAX_FACTOR] and
    not 1; ``none`` for none."""
    if text.strip() == "none":
        return ()
    out = []
    for part in text.split(","):
        factor = real(0.0)(part)
        if not 0 < factor <= MAX_FACTOR or factor == 1 or factor in out:
            raise argparse.ArgumentTypeError(f"give distinct factors in (0, {MAX_FACTOR:g}] other than 1, or none; "
                                             f"got {text!r}")
        out.append(factor)
    return tuple(out)


def duration_s(text: str) -> float:
    """An argparse ``type``: seconds of arrivals per rate, in (0, MAX_DURATION_S]."""
    value = real(0.0)(text)
    if not 0 < value <= MAX_DURATION_S:
        raise argparse.ArgumentTypeError(f"a duration must lie in (0, {MAX_DURATION_S:g}] seconds, got {text!r}")
    return value


def workloads_list(text: str) -> list[str]:
    """An argparse ``type``: comma-separated workload names, each one of ``serve_sweep.WORKLOADS``,
    ``serve_workloads.OPT_IN_WORKLOADS`` or (with ``--replicas``) ``serve_workloads.REPLICA_WORKLOADS``, no
    repeats."""
    known = sweep.WORKLOADS + sw.OPT_IN_WORKLOADS + sw.REPLICA_WORKLOADS
    names = [w.strip() for w in text.split(",") if w.strip()]
    bad = [w for w in names if w not in known]
    if not names or bad or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"give distinct names of {', '.join(known)}, got {text!r}")
    return names


def add_arguments(p: argparse.ArgumentParser) -> None:
    _server_options(p)
    _text_and_peer_options(p)
    s = p.add_argument_group("sizes (default: the full run's, or the quick one's with --quick)")
    _size_options(s)
    _open_loop_options(s)
    _soak_options(s)
    generation.add_arguments(p)
    replicas.add_arguments(p)


def _server_options(p) -> None:
    """The VLM preset served and the schedule of both mmcache servers; threads and seed."""
    p.add_argument("--preset", choices=PRESETS, default=None,
                   help=f"the VLM preset served (default {FULL['preset']}, quick {QUICK['preset']})")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="default bfloat16 for bench-llava, float32 for tiny-llava")
    p.add_argument("--page-size", type=count(MAX_PAGE_SIZE), default=16)
    p.add_argument("--num-pages", type=count(MAX_POOL_TOKENS), default=2048,
                   help=f"KV pages per engine (pages times page size at most {MAX_POOL_TOKENS})")
    p.add_argument("--prefill-chunk-tokens", type=count(MAX_POOL_TOKENS), default=None, metavar="N",
                   help="tokens of a prompt prefilled in one step, a multiple of --page-size (default: the "
                        "server's, the largest multiple of the page size up to 2048)")
    p.add_argument("--mixed-prefill-tokens", type=count(MAX_POOL_TOKENS), default=None, metavar="N",
                   help="prompt tokens of a step that also decodes, a multiple of --page-size (default: the "
                        "server's, mmcache serve --mixed-prefill-tokens)")
    p.add_argument("--host-tier-bytes", type=count(MAX_HOST_TIER_BYTES, minimum=0), default=0, metavar="N",
                   help="the open loop also runs mmcache_tier: the mmcache engine with a host tier of N bytes below "
                        "its pool (mmcache serve --host-tier-bytes), beside mmcache without one, on the same "
                        "workloads and rates (default 0: no mmcache_tier); pair it with a --num-pages below the "
                        "sessions' contexts so that evictions happen")
    p.add_argument("--threads", type=count(MAX_THREADS), default=1, help="torch CPU threads while measuring")
    p.add_argument("--seed", type=seed, default=0)


def _text_and_peer_options(p) -> None:
    """vLLM's server as a peer, the plot, and the text model of the text workloads."""
    p.add_argument("--peers", action="store_true",
                   help="also vLLM's CPU build through its own OpenAI server on the text workloads, at its defaults "
                        "(vllm_cpu) and with --peer-batched-tokens (vllm_cpu_tuned) (needs VLLM_PEER_PYTHON: "
                        "source peers/vllm_cpu/env.sh DIR)")
    p.add_argument("--peer-batched-tokens", type=batched_tokens, default=None, metavar="B",
                   help="with --peers, also vLLM with B batched tokens a step (vllm_cpu_tuned; B from --tune-peer)")
    p.add_argument("--tune-peer", type=batched_tokens_list, default=None, metavar="B1,B2",
                   help=f"only sweep vLLM's batched tokens a step: the first text workload of --workloads at "
                        f"--rates (default {TUNE_RATES}) for each B, under the cache-off server's SLOs (needs "
                        f"VLLM_PEER_PYTHON)")
    p.add_argument("--vllm-client", action="store_true",
                   help="with --peers, also drive every text server with vLLM's own benchmark client (vllm bench "
                        "serve, prefix_repetition; benchmarks.peers.vllm_bench_client) once a repeat, after the "
                        "load generator's sweep")
    p.add_argument("--plot", metavar="PATH", help="write SLO attainment and TTFT percentiles against rate (PNG)")
    p.add_argument("--text-preset", choices=TEXT_PRESETS, default=None,
                   help=f"the text model of the text workloads (default {FULL['text_preset']}, "
                        f"quick {QUICK['text_preset']})")
    p.add_argument("--text-dtype", choices=sorted(DTYPES), default=None,
                   help="default bfloat16, float32 for the tiny presets")


def _size_options(s) -> None:
    """The chats' sizes and the text workloads' (each defaults to the full run's or the quick one's)."""
    for name, high, what in (("images", 4, "photos the chats use"), ("users", 64, "chats per photo"),
                             ("turns", 64, "turns per chat"), ("max_tokens", 4096, "tokens per answer"),
                             ("repeats", MAX_REPEATS, "low-load repeats, each under its own salt"),
                             ("sessions", MAX_REQUESTS, "chats per open-loop rate")):
        s.add_argument("--" + name.replace("_", "-"), type=count(high), default=None, metavar="N",
                       help=f"{what} (default {FULL[name]}, quick {QUICK[name]}; at most {high})")
    for name, high, what in (("text_sessions", MAX_REQUESTS, "multi_turn sessions per open-loop rate"),
                             ("text_requests", MAX_REQUESTS, "shared_prefix and mooncake requests per rate"),
                             ("text_turns", 64, "user turns per multi_turn conversation at most"),
                             ("text_max_tokens", 4096, "tokens per text answer at most")):
        s.add_argument("--" + name.replace("_", "-"), type=count(high), default=None, metavar="N",
                       help=f"{what} (default {FULL[name]}, quick {QUICK[name]}; at most {high})")


def _open_loop_options(s) -> None:
    """The open-loop part: its workloads, its rates and how long each rate sends; or none of it."""
    s.add_argument("--workloads", type=workloads_list, default=None, metavar="W1,W2",
                   help=f"open-loop workloads (default: {FULL['workloads']}; also agent, the repository's agent "
                        f"sessions scaled as multi_turn, each turn sent its tool wait after the previous answer)")
    s.add_argument("--rates", type=rates_list, default=None, metavar="R1,R2",
                   help=f"open-loop rates, sessions (chats) or requests (one-turn workloads) per second "
                        f"(default {FULL['rates']}, quick {QUICK['rates']})")
    s.add_argument("--duration", type=duration_s, default=None, metavar="S",
                   help="seconds of arrivals per rate: each rate sends rate x S sessions (at least 1; default: "
                        f"--sessions, --text-sessions or --text-requests; quick {QUICK['duration']:g}, so there "
                        f"those counts size only the unloaded runs)")
    s.add_argument("--min-rate", type=real(1e-6), default=None, metavar="R",
                   help="the lowest rate the ladder's foot may move down to, halving, for an engine that meets the "
                        "SLOs at none of the rates (default: a quarter of the lowest rate; quick: the lowest rate, "
                        "so no rate is added)")
    s.add_argument("--near-line", type=factors_list, default=None, metavar="F1,F2",
                   help=f"after the ladder, also these factors of each engine's goodput rate (default "
                        f"{FULL['near_line']}, quick {QUICK['near_line']}; none: no rate added)")
    s.add_argument("--load-repeats", type=count(MAX_REPEATS), default=None, metavar="N",
                   help=f"open-loop repeats, every engine on every workload in each, seed --seed + k (default "
                        f"{FULL['load_repeats']}, quick {QUICK['load_repeats']}): medians and ratio ranges")
    s.add_argument("--no-load", action="store_true", help="skip the open-loop part")


def _soak_options(s) -> None:
    """The soak: its requests, preset and concurrency; and the time limit of each open-loop rate and the soak."""
    s.add_argument("--soak", type=count(MAX_REQUESTS, minimum=0), nargs="?", const=SOAK_DEFAULT, default=None,
                   metavar="N", help=f"requests of the soak (alone: {SOAK_DEFAULT}; default {FULL['soak']}, "
                                     f"quick {QUICK['soak']}; 0: no soak)")
    s.add_argument("--soak-preset", choices=PRESETS, default="tiny-llava",
                   help="the preset the soak's server serves (it checks what requests leave held, not speed)")
    s.add_argument("--soak-concurrency", type=count(1024), default=16, metavar="N",
                   help="soak requests in flight at most")
    s.add_argument("--time-limit", type=real(1.0), default=None, metavar="S",
                   help=f"seconds each open-loop rate may run after its last arrival, and the soak "
                        f"(default {FULL['time_limit']:g}, quick {QUICK['time_limit']:g})")


def settle(args) -> None:
    """Fill sizes and defaults, and check what argparse could not (typed errors); with ``--peers`` or
    ``--tune-peer``, that vLLM's interpreter is configured (``VllmUnavailable`` before anything is built)."""
    replicas.settle_replicas(args)
    full, quick = dict(FULL), dict(QUICK)
    for d in (full, quick):
        d["rates"], d["workloads"] = rates_list(d["rates"]), workloads_list(d["workloads"])
        d["near_line"] = factors_list(d["near_line"])
    if args.tune_peer and args.rates is None:
        args.rates = rates_list(TUNE_RATES)
    fill_sizes(args, full, quick)
    if args.min_rate is None:
        args.min_rate = min(args.rates) / (1 if args.quick else 4)
    if args.dtype is None:
        args.dtype = default_dtype(args.preset)
    if args.text_dtype is None:
        args.text_dtype = "float32" if args.text_preset.startswith("tiny") else "bfloat16"
    if args.plot is not None:
        from mmcache.cli import writable

        if not writable(args.plot, "mmcache bench serve"):
            raise WorkloadShapeError(f"--plot {args.plot!r} cannot be written")
    if args.peer_batched_tokens is not None and not args.peers:
        raise WorkloadShapeError("--peer-batched-tokens sets the tuned vLLM of --peers: give --peers too")
    if args.vllm_client and not (args.peers and any(w in sw.TEXT_WORKLOADS for w in args.workloads)):
        raise WorkloadShapeError("--vllm-client drives the text servers of --peers: give --peers and a text workload")
    if args.tune_peer and not any(w in sw.TEXT_WORKLOADS for w in args.workloads):
        raise WorkloadShapeError(f"--tune-peer sweeps a text workload: --workloads {','.join(args.workloads)} "
                                 f"names none of {', '.join(sw.TEXT_WORKLOADS)}")
    if args.host_tier_bytes:
        moot = [o for o, v in (("--replicas", args.replicas), ("--tune-peer", args.tune_peer),
                               ("--no-load", args.no_load)) if v]
        if moot:
            raise WorkloadShapeError(f"--host-tier-bytes adds mmcache_tier to the open loop, which {moot[0]} does "
                                     f"not run: leave one of them out")
    if args.peers or args.tune_peer:
        from .peers.vllm_cpu import interpreter

        interpreter()
    if args.num_pages * args.page_size > MAX_POOL_TOKENS:
        raise WorkloadShapeError(f"a pool of {args.num_pages} pages of {args.page_size} tokens is above "
                                 f"{MAX_POOL_TOKENS} tokens")


def default_dtype(preset: str) -> str:
    return "bfloat16" if preset == "bench-llava" else "float32"


def progress(msg: str) -> None:
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
def engine_config(args, cache_mode: str = "on", host_tier_bytes: int = 0):
    """``mmcache serve``'s engine config (its schedule defaults) at this run's sizes, with a host tier of
    ``host_tier_bytes`` below the pool (0: none; ``mmcache serve --host-tier-bytes``)."""
    from mmcache.server.config import serve_engine_config, tiered_engine_config

    config = serve_engine_config(page_size=args.page_size, num_pages=args.num_pages, cache_mode=cache_mode,
                                 prefill_chunk_tokens=args.prefill_chunk_tokens,
                                 mixed_prefill_tokens=args.mixed_prefill_tokens)
    return tiered_engine_config(config, host_tier_bytes) if host_tier_bytes else config


def server_config(args, cache_mode: str = "on", **changes):
    """The server of ``args``' preset; ``cache_mode`` "off": no KV page reuse and a store of one byte, which
    every encoder output bypasses (the vision tower runs for every image of every request)."""
    from mmcache.server import ServerConfig

    return ServerConfig(preset=args.preset, dtype=args.dtype, engine_config=engine_config(args, cache_mode),
                        store_bytes=STORE_BYTES if cache_mode == "on" else 1, **changes)


def in_process(args):
    """A ``VLMEngine`` built by the server's own builder from the server's config: same preset, dtype, engine
    config, store budget and image limits."""
    from mmcache.presets.serving import build_engine

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
    from mmcache.hosts.vlm import VLMRequest
    from mmcache.server.text_output import TextAssembler

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
    """Every turn of every chat, ``args.repeats`` times: one request at a time on each side, in an order that
    rotates from turn to turn. The sides: ``http`` (the lean client, ``sse_client``), ``openai`` (the official
    client, under its own salt so that it finds the same cache state as the others) and ``local`` (the
    in-process engine)."""
    import aiohttp

    api = client(srv.base_url)
    fields = dict(sampling_fields(args), model=srv.config.model_name)
    warm = [{"role": "user", "content": [{"type": "text", "text": "Describe the photo."},
                                         openai_user_message(plan[0], 0)["content"][0]]}]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300.0)) as http:
        turn_on = {"http": lambda m, salt: _http_turn(http, srv.base_url, m, fields, salt),
                   "openai": lambda m, salt: _openai_turn(api, m, fields, salt + "-openai"),
                   "local": lambda m, salt: _local_turn(front, m, args, salt)}
        for side in SIDES:  # connections, first forwards, allocators: not measured
            await turn_on[side](warm, "warm-up")
        pairs = await _turns(plan, args, turn_on)
    await api.close()
    return pairs


async def _local_turn(front, messages: list, args, salt: str) -> dict:
    return in_process_turn(front, messages, args, salt)


async def _turns(plan, args, turn_on: dict) -> list[dict]:
    pairs, k = [], 0
    for rep in range(args.repeats):
        salt = f"serve-bench-{args.seed}-{rep}"
        histories = [[{"role": "system", "content": c.system}] for c in plan]
        for turn in range(args.turns):
            for ci, chat in enumerate(plan):
                messages = histories[ci] + [openai_user_message(chat, turn)]
                sides = {}
                for side in order(SIDES, k):
                    sides[side] = await turn_on[side](messages, salt)
                k += 1
                pairs.append(dict(repeat=rep, turn=turn, chat=ci, **sides))
                histories[ci] = messages + [{"role": "assistant", "content": sides["http"]["text"]}]
    return pairs


async def _http_turn(http, base_url: str, messages: list, fields: dict, salt: str) -> dict:
    record = loadgen.Record(0, 0, "", time.perf_counter())
    body = dict(fields, messages=messages, cache_salt=salt, ignore_eos=True)
    return _turn_figures(await sse_client.stream_chat(http, base_url + "/chat/completions", body, record))


async def _openai_turn(api, messages: list, fields: dict, salt: str) -> dict:
    record = loadgen.Record(0, 0, "", time.perf_counter())
    body = dict(fields, messages=messages, extra_body={"cache_salt": salt, "ignore_eos": True})
    return _turn_figures(await loadgen.stream_chat(api, body, record))


def _turn_figures(record) -> dict:
    if record.outcome != "ok" or record.first_chunk is None:
        raise RequestFailed(f"a low-load request failed over HTTP: {record.status} {record.error}")
    return {"ttft": record.ttft, "first_event": record.first_chunk - record.send, "e2e": record.e2e,
            "tpot": record.tpot, "prompt_tokens": record.prompt_tokens, "matched": record.cached_tokens,
            "output_tokens": record.output_tokens, "text": record.text}


def paired(pairs: list[dict], key: str, side: str = "http") -> dict | None:
    """``side`` (an HTTP client) against in-process on ``key`` (``ttft``: first text; ``first_event``: first
    chunk or token event) over the pairs where both sides have it: per repeat the median of the paired
    differences and ratios, and the medians of those over repeats. None when no pair has it."""
    med = statistics.median
    both = [dict(p, http=p[side]) for p in pairs if p[side][key] is not None and p["local"][key] is not None]
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
        "per_turn": per_turn, "openai_client": openai_client(pairs),
    }


def openai_client(pairs: list[dict]) -> dict:
    """The same figures through the ``openai`` client: what its own work per request adds on top."""
    head = paired(pairs, "ttft", "openai") or paired(pairs, "first_event", "openai")
    return {"added_ttft_p50_s": head["added_p50_s"], "http_ttft_p50_s": head["http_p50_s"],
            "in_process_ttft_p50_s": head["in_process_p50_s"], "target_met": head["target_met"],
            "cached_tokens_equal": all(p["openai"]["matched"] == p["local"]["matched"] for p in pairs),
            "outputs_equal_share": sum(p["openai"]["text"] == p["local"]["text"] for p in pairs) / len(pairs)}


# ---- entry points ----------------------------------------------------------------------------------------
def run(args) -> dict:
    settle(args)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    load_before, t0 = os.getloadavg(), time.perf_counter()
    try:
        result = measure_parts(args)
    finally:
        torch.set_num_threads(threads)
    result["config"] = run_config(args)
    result["machine"] = {"cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                         "seconds": time.perf_counter() - t0, "openmp": loaded_runtime()}
    return result


def measure_parts(args) -> dict:
    """Each part the options ask for, in order: low load, the open loop (and its plot), the soak, generation."""
    result: dict = {}
    if args.replicas:
        return replicas.run(args)
    if args.tune_peer:
        from .serve_vllm import tune

        progress(f"tuning vLLM's step budget: {', '.join(map(str, args.tune_peer))} batched tokens")
        result["tune_peer"] = tune(args)
        return result
    plan = chat_plan(args) if "vlm_chat" in args.workloads else None
    if plan is not None:
        result["low_load"] = low_load_part(args, plan)
    if not args.no_load:
        from .serve_open_loop import open_loop

        result.update(open_loop(args, plan))
        if args.plot:
            from .serve_plot import plot

            plot(result, args.plot)
            progress(f"wrote {args.plot}")
    if args.soak:
        from .serve_soak import soak

        progress(f"soak: {args.soak} requests on {args.soak_preset}")
        result["soak"] = soak(args)
    if not args.no_generation:
        progress("generation: image, video and voice streams, store on vs off")
        result["generation"] = generation.run(args)
    return result


def run_config(args) -> dict:
    """The options the run took, the store budget, the text shape and the mmcache servers' schedule."""
    config = {k: getattr(args, k) for k in ("preset", "dtype", "page_size", "num_pages", "threads", "seed",
                                            "images", "users", "turns", "max_tokens", "repeats",
                                            "rates", "min_rate", "sessions", "soak", "soak_preset",
                                            "soak_concurrency", "time_limit", "workloads", "duration",
                                            "text_preset", "text_dtype", "text_sessions", "text_requests",
                                            "text_turns",
                                            "text_max_tokens", "peers", "prefill_chunk_tokens",
                                            "mixed_prefill_tokens", "load_repeats", "near_line", "host_tier_bytes",
                                            "peer_batched_tokens", "tune_peer", "vllm_client", "replicas",
                                            "routers", "route_depth_tokens", "ray_address", "replica_slo")}
    schedule = engine_config(args)  # what both mmcache servers ran with (None in the options: the server's)
    config.update(store_bytes=STORE_BYTES, quick=bool(args.quick), no_load=bool(args.no_load),
                  text_shape=TEXT_SHAPES["quick" if args.quick else "full"],
                  schedule={k: getattr(schedule, k) for k in ("page_size", "max_tokens_per_step",
                                                              "prefill_chunk_tokens", "mixed_prefill_tokens",
                                                              "max_num_seqs")})
    return config


def low_load_part(args, plan) -> dict:
    """HTTP beside the in-process engine on the chats, one request at a time (cache on); the server in its own
    process, as ``mmcache serve`` runs (``serve_process``), the in-process engine in this one; neither process's
    idle OpenMP threads spin while the other one works (``serve_process.quiet_openmp``)."""
    from .serve_process import ServerProcess, quiet_openmp

    progress(f"building {args.preset} ({args.dtype}): the server's engine (its own process) and the in-process one")
    front = in_process(args)
    with quiet_openmp(), ServerProcess(server_config(args), args.threads) as srv:
        progress(f"low load: {args.repeats} x {len(plan)} chats x {args.turns} turns, HTTP beside in-process")
        pairs = asyncio.run(low_load(srv, front, plan, args))
        srv.check_idle()
    front.check_invariants()
    return dict(summarise_low_load(pairs, args.turns), server="own process")


def check_idle(srv) -> dict:
    """After a measured part: the server's engine holds nothing and its invariants hold (else ``LeftHeld``)."""
    from .serve_soak import LeftHeld, held_after, wait_idle

    idle = wait_idle(srv.host, 30.0)
    held = held_after(srv.host)
    if not idle or any(held.values()):
        raise LeftHeld(f"after a measured part: idle {idle}, held {held}")
    return held


def vllm_client_rows(result: dict) -> list[Row]:
    """vLLM's benchmark client on each text server: median TTFT and TPOT over the repeats."""
    from .serve_summary import median_goodput

    rows = []
    for engine, runs in (result.get("vllm_client") or {}).items():
        for metric, unit in (("ttft_median_ms", "ms"), ("ttft_p99_ms", "ms"), ("tpot_median_ms", "ms")):
            value = median_goodput([r[metric] for r in runs])
            if value is not None:
                rows.append(Row("serve", f"vllm bench serve (prefix_repetition) on {engine}: {metric}", value, unit))
    return rows


def table_rows(result: dict) -> list[Row]:
    if "replicas" in result:
        return replicas.rows(result)
    rows = []
    ll = result.get("low_load")
    if ll:
        rows.append(Row("serve", "TTFT p50 over HTTP, one request at a time", ll["http_ttft_p50_s"], "s",
                        ll["in_process_ttft_p50_s"], versus="in-process engine",
                        paired=1 / ll["ttft_ratio_p50"] if ll["ttft_ratio_p50"] else None))
        rows.append(Row("serve", "TTFT added by HTTP (median of paired differences)", 1000 * ll["added_ttft_p50_s"],
                        "ms", target=f"<= {1000 * ll['target_added_ttft_s']:.3g} ms (5 ms or 5%)"))
        official = ll["openai_client"]
        rows.append(Row("serve", "TTFT added by HTTP through the openai client", 1000 * official["added_ttft_p50_s"],
                        "ms"))
        rows.append(Row("serve", "cached_tokens share, multi-turn VLM chat", ll["cached_tokens_share"], "",
                        ll["in_process_matched_share"], versus="in-process matched", higher_is_better=True))
    rows += open_loop_rows(result)
    rows += vllm_client_rows(result)
    if "tune_peer" in result:
        rows += tune_rows(result)
    soak = result.get("soak")
    if soak:
        rows.append(Row("serve", f"soak: {soak['requests']} requests, unexpected outcomes",
                        float(soak["unexpected"]), "", target="0"))
        rows.append(Row("serve", "soak: requests, pages and leases held after", float(sum(soak["held_after"].values())),
                        "", target="0"))
    rows += generation.rows(result.get("generation") or {})
    return rows
