"""``mmcache bench serve --replicas N --routers R1,R2``: the open loop through N engine replicas on Ray Serve
(``mmcache serve --replicas``), once per request router, compared.

Rules:

* Every router serves the same workloads from the same model folders with the same server config (the open loop's
  cache-on server: ``serve_open_loop.vlm_server_config`` and ``text_server_config``), each router's application
  started afresh (``mmcache.replicas.launch.start_replicas``: a local Ray instance, or ``--ray-address``), one
  application for the VLM workload and one for the text workloads. Repeat k uses seed ``--seed + k`` and the
  routers in an order rotated by k (``kernel_harness.order``), so machine drift does not always fall on one router.
* SLOs come first, by the single-server bench's rule (``serve_sweep.unloaded``: 5x the p50 TTFT and 2x the p50
  TPOT of the workload's first sessions one at a time), once per workload, held for every router and repeat; on
  the replicas routed by power-of-two choices (``--replica-slo power-of-two``, the default: a stream through Ray
  Serve takes a few milliseconds a token more than the single process, on a tiny model more than its TPOT), or on
  the single-process cache-off server (``--replica-slo single``).
* Each sweep is the ladder of ``--rates`` alone (no foot, no rates near the line unless asked): the routers are
  compared at the same rates. Per router and workload a repeat gives: the matched share (the sum of
  ``cached_tokens`` over the sum of prompt tokens, every rate's requests together), the goodput at the SLOs (and
  with a TPOT SLO of 5x the unloaded p50), and TTFT p50 and p99 at the top rate of the ladder (the loaded one). Over repeats each is the median; a ratio of
  mmcache's router over another is taken within each repeat, then its median and range.
* Beside the measured figures, each text workload's bounds from its prompts' arithmetic (``affinity_bounds``,
  per repeat as that repeat sends it, medians): the matched share of perfect affinity (every request on one
  replica, no eviction), of each chat whole on one replica, and of random placement (a chat's next turn on its
  replica half the time with two replicas), and so the largest ratio any router could show over a random one.
* The prefix-text router runs with the installed Ray's settings, unless ``--prefix-text-imbalance N`` sets its
  ``imbalanced_threshold`` (Ray 2.60's default is infinite: it then never spreads by load, whatever the rate).
* ``vlm_chat`` here is not the single server's chats: every chat sends an image of its own (a crop of the photos)
  with no system prompt and the same questions, so chats differ only in their images. A router that reads text
  alone cannot tell them apart; mmcache's routing key carries the image's digest.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics

from . import serve_open_loop as ol
from . import serve_sweep as sweep
from . import serve_workloads as sw
from .kernel_harness import order
from .table import Row
from .text_workloads import WorkloadShapeError

BASELINES = ("power-of-two", "prefix-text")
SLO_SOURCES = ("power-of-two", "single")  # --replica-slo  # the routers mmcache's is compared with, where they ran
MAX_REPLICAS = 64
# The replicas run's sizes: tiny models and short ladders, so that three routers on three workloads take about
# a quarter of an hour on two cores (every option given on the command line wins).
REPLICAS = dict(preset="tiny-llava", text_preset="tiny", turns=3, max_tokens=8, rates="1,2,4", duration=6.0,
                sessions=4, text_sessions=4, text_requests=8, text_turns=3, text_max_tokens=8,
                workloads="vlm_chat,multi_turn,hot_prefix", load_repeats=1, near_line="none", time_limit=120.0,
                images=4, users=2, repeats=1)
REPLICAS_QUICK = dict(rates="1", duration=4.0)  # a smoke: one rate, four sessions
HOT_PREFIX = dict(system_len=256, user_len=32, hot_share=0.8)
IMAGE_SIDE = 96  # pixels of each chat's crop: small requests; the tiny VLM resizes every image anyway
METRICS = ("matched_share", "goodput_rps", "goodput_tpot5_rps", "ttft_p50_s", "ttft_p99_s")
HIGHER_IS_BETTER = {"matched_share": True, "goodput_rps": True, "goodput_tpot5_rps": True, "ttft_p50_s": False,
                    "ttft_p99_s": False}
GOODPUTS = ("goodput_rps", "goodput_tpot5_rps")  # a goodput of None (no rate met the SLOs) counts as 0


def routers_list(text: str) -> list[str]:
    """An argparse ``type``: comma-separated distinct router names of ``mmcache serve --router``."""
    from mmcache.replicas.routing import ROUTERS

    names = [r.strip() for r in text.split(",") if r.strip()]
    bad = [r for r in names if r not in ROUTERS]
    if not names or bad or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"give distinct names of {', '.join(ROUTERS)}, got {text!r}")
    return names


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .options import count, real

    g = p.add_argument_group("replicas (mmcache serve --replicas on Ray Serve, routers compared)")
    g.add_argument("--replicas", type=count(MAX_REPLICAS), default=None, metavar="N",
                   help="only the open loop, through N engine replicas on Ray Serve, once per router of --routers")
    g.add_argument("--routers", type=routers_list, default=None, metavar="R1,R2",
                   help="with --replicas, the routers compared (default mmcache,power-of-two,prefix-text)")
    g.add_argument("--route-depth-tokens", type=count(1 << 20), default=None, metavar="N",
                   help="with --replicas, where the routing key's page ends (default: mmcache serve's)")
    g.add_argument("--replica-slo", choices=SLO_SOURCES, default=None,
                   help="with --replicas, the server whose unloaded latency sets the SLOs: the replicas routed by "
                        "power-of-two choices (default), or the single-process cache-off server, as without "
                        "--replicas (its TPOT lies below what a stream through Ray Serve takes on a tiny model)")
    g.add_argument("--prefix-text-imbalance", type=real(0.0), default=None, metavar="N",
                   help="with --replicas, the prefix-text router's imbalanced_threshold: past this gap between "
                        "the replicas' queues it routes by power-of-two choices (default: the installed Ray's, "
                        "infinite in Ray 2.60: it never spreads by load; Ray's docs name 10)")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="with --replicas, an existing Ray cluster (default: a local instance per router)")


def settle_replicas(args) -> None:
    """Before the shared ``settle``: with ``--replicas``, the replicas run's sizes where no option was given, and
    the refusals of options that mean nothing there; without it, the refusals of the replicas' own options."""
    from mmcache.replicas.launch import ReplicaOptions

    if args.replicas is None:
        given = [o for o, v in (("--routers", args.routers), ("--route-depth-tokens", args.route_depth_tokens),
                                ("--ray-address", args.ray_address), ("--replica-slo", args.replica_slo),
                                ("--prefix-text-imbalance", args.prefix_text_imbalance))
                 if v is not None]
        if given:
            raise WorkloadShapeError(f"{', '.join(given)} sets the replicas run: give --replicas too")
        if args.workloads and set(args.workloads) & set(sw.REPLICA_WORKLOADS):
            raise WorkloadShapeError(f"{', '.join(sw.REPLICA_WORKLOADS)} runs through replicas only: give --replicas")
        return
    refused = [o for o, v in (("--peers", args.peers), ("--tune-peer", args.tune_peer),
                            ("--vllm-client", args.vllm_client), ("--plot", args.plot), ("--soak", args.soak),
                            ("--no-load", args.no_load), ("--near-line", args.near_line is not None),
                            ("--min-rate", args.min_rate is not None)) if v]
    if refused:
        raise WorkloadShapeError(f"--replicas runs the open loop of mmcache's routers only: {', '.join(refused)} "
                                 f"does not apply")
    if args.routers is None:
        args.routers = ["mmcache", *BASELINES]
    if args.prefix_text_imbalance is not None and "prefix-text" not in args.routers:
        raise WorkloadShapeError("--prefix-text-imbalance sets the prefix-text router: give it in --routers")
    if args.replica_slo is None:
        args.replica_slo = SLO_SOURCES[0]
    if args.route_depth_tokens is None:
        args.route_depth_tokens = ReplicaOptions(1).route_depth_tokens
    sizes = dict(REPLICAS, **(REPLICAS_QUICK if args.quick else {}))
    sizes["rates"] = [float(r) for r in sizes["rates"].split(",")]
    sizes["workloads"] = sizes["workloads"].split(",")
    sizes["near_line"] = ()
    for name, value in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.min_rate = min(args.rates)  # no foot: every router at the same rates
    args.soak, args.no_generation = 0, True


# ---- workloads -------------------------------------------------------------------------------------------
def distinct_images(n: int, seed: int) -> list[bytes]:
    """``n`` distinct PNG images of ``IMAGE_SIDE`` pixels a side: seeded crops of the photos, scaled down."""
    from .vlm import guard_images

    return guard_images(n, seed, least=4, side=IMAGE_SIDE)


def image_chats(args, count: int, seed: int) -> list:
    """``count`` chats (``benchmarks.vlm.Chat``) that differ only in their image: each sends its own at turn 1, no
    system prompt (the image then lies in the prompt's first page), the same ``--turns`` questions."""
    from .vlm import Chat, questions

    qs = questions()[:args.turns]
    return [Chat(i, 0, "", {0: image}, list(qs)) for i, image in enumerate(distinct_images(count, seed))]


def vlm_workload(args, seed: int) -> sweep.Workload:
    """The image chats as open-loop sessions, one chat per session of a rate (as many as the largest rate sends)."""
    from . import loadgen
    from .serve import openai_user_message, sampling_fields

    most = max(ol.per_rate(args, r, args.sessions) for r in args.rates)
    chats = image_chats(args, max(most, sweep.UNLOADED_SESSIONS), seed)

    def make(options: dict, n: int) -> list:
        return [loadgen.Session([], [openai_user_message(c, t) for t in range(len(c.questions))], options)
                for c in chats[:n]]

    return sweep.Workload("vlm_chat", "sessions/s", make, lambda rate: ol.per_rate(args, rate, args.sessions),
                          sampling_fields(args), params={"chats": len(chats), "turns": args.turns,
                                                         "image_side": IMAGE_SIDE, "max_tokens": args.max_tokens,
                                                         "shape": "one distinct image per chat, no system prompt, "
                                                                  "the same questions"})


def hot_prefix_workload(args, space, seed: int) -> sweep.Workload:
    most = max(ol.per_rate(args, r, args.text_sessions) for r in args.rates)
    plan = sw.hot_prefix(space, seed, max(most, sweep.UNLOADED_SESSIONS), args.text_turns,
                         HOT_PREFIX["system_len"], HOT_PREFIX["user_len"], args.text_max_tokens,
                         HOT_PREFIX["hot_share"])
    return sweep.Workload("hot_prefix", "sessions/s", plan.sessions,
                          lambda rate: ol.per_rate(args, rate, args.text_sessions),
                          {"temperature": 0.0, "max_tokens": args.text_max_tokens}, plan.offsets,
                          dict(plan.params, unit="sessions/s"))


def workloads(args, space, seed: int) -> dict[str, sweep.Workload]:
    """The workloads of ``--workloads`` for repeat seed ``seed``, by name."""
    texts = [w for w in args.workloads if w in sw.TEXT_WORKLOADS]
    works = ol.text_workloads(args, space, seed, texts) if texts else {}
    if "hot_prefix" in args.workloads:
        works["hot_prefix"] = hot_prefix_workload(args, space, seed)
    if "vlm_chat" in args.workloads:
        works["vlm_chat"] = vlm_workload(args, seed)
    return {w: works[w] for w in args.workloads}


# ---- the run ---------------------------------------------------------------------------------------------
def run(args) -> dict:
    """SLOs on the single-process cache-off server, then every router on every workload, ``--load-repeats``
    times (module docstring): ``{"slo", "routers", "summary", "ratios", "runs", "workloads"}``."""
    import tempfile

    from mmcache.replicas.launch import ray_missing

    missing = ray_missing()
    if missing:
        raise WorkloadShapeError(missing)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # Ray's logging setup would print every request
    texts = [w for w in args.workloads if w != "vlm_chat"]
    slo: dict = {}
    per_repeat, runs, bounds = [], [], []
    with tempfile.TemporaryDirectory(prefix="mmcache-replicas-") as tmp:
        folder, space = ol.text_folder(args, tmp) if texts else (None, None)
        folders = {"text": folder, "vlm": ol.vlm_folder(args, tmp) if "vlm_chat" in args.workloads else None}
        slos(args, folders, workloads(args, space, args.seed), slo)
        for k in range(args.load_repeats):
            seed = args.seed + k
            works = workloads(args, space, seed)
            bounds.append({w: workload_bounds(works[w], args.rates, args.page_size, args.replicas, seed)
                           for w in texts})
            routers = order(args.routers, k)
            sweep.progress(f"replicas, repeat {k + 1} of {args.load_repeats} (seed {seed}): {', '.join(routers)}")
            measured = {r: sweep_router(r, works, folders, args, slo, seed) for r in routers}
            runs.append({"repeat": k, "seed": seed, "order": routers})
            per_repeat.append({r: measured[r] for r in args.routers})
    figures = [{r: {w: figures_of(s) for w, s in run.items()} for r, run in rep.items()} for rep in per_repeat]
    return {"replicas": {"slo": slo, "routers": per_repeat, "summary": summarise(figures),
                         "ratios": ratios(figures), "runs": runs,
                         "bounds": {w: {m: _median([b[w][m] for b in bounds]) for m in bounds[0][w]}
                                    for w in texts},
                         "workloads": {w: dict(works[w].params, unit=works[w].unit) for w in works},
                         "options": {"replicas": args.replicas, "routers": args.routers,
                                     "route_depth_tokens": args.route_depth_tokens, "ray_address": args.ray_address,
                                     "slo_from": args.replica_slo, "hot_prefix": HOT_PREFIX,
                                     "prefix_text_imbalance": args.prefix_text_imbalance}}}


def by_model(works: dict) -> dict[str, list[str]]:
    """The workloads by the model folder that serves them (``vlm`` or ``text``), those without any left out."""
    kinds = {"vlm": [w for w in works if w == "vlm_chat"], "text": [w for w in works if w != "vlm_chat"]}
    return {kind: names for kind, names in kinds.items() if names}


def slos(args, folders: dict, works: dict, slo: dict) -> None:
    """Each workload's SLOs (``serve_sweep.unloaded``: its first sessions one at a time) on the server
    ``--replica-slo`` names: the replicas routed by power-of-two choices, or the single-process cache-off server,
    as the single-server bench takes them."""
    from mmcache.presets import serve
    from mmcache.presets.serving import build_models
    from mmcache.replicas.launch import ReplicaOptions, start_replicas

    for kind, names in by_model(works).items():
        server_config = ol.vlm_server_config if kind == "vlm" else ol.text_server_config
        if args.replica_slo == "single":
            config = server_config(args, folders[kind], "off")
            running, engine, what = serve(config), "mmcache_nocache", "single-process cache-off server"
        else:
            config = server_config(args, folders[kind], "on")
            options = ReplicaOptions(args.replicas, ray_address=args.ray_address, router="power-of-two",
                                     route_depth_tokens=args.route_depth_tokens)
            running = start_replicas(config, options, build_models)
            engine, what = "power-of-two", f"{args.replicas} replicas routed by power-of-two"
        with running as srv:
            target = sweep.Target(engine, srv.base_url, config.model_name)
            for w in names:
                slo[w] = asyncio.run(sweep.unloaded(target, works[w], args.seed, args.time_limit))
                sweep.progress(f"SLOs of {w} ({what}, unloaded): TTFT {slo[w]['ttft_s']:.3g} s, "
                               f"TPOT {slo[w]['tpot_s']:.3g} s")


def sweep_router(router: str, works: dict, folders: dict, args, slo: dict, seed: int) -> dict:
    """One router's application on every workload: ``{workload: sweep}``, each sweep with the requests each
    replica had served after each rate (``check``)."""
    from mmcache.presets.serving import build_models
    from mmcache.replicas.launch import ReplicaOptions, start_replicas

    options = ReplicaOptions(args.replicas, ray_address=args.ray_address, router=router,
                             route_depth_tokens=args.route_depth_tokens,
                             prefix_imbalance=args.prefix_text_imbalance if router == "prefix-text" else None)
    out = {}
    for kind, names in by_model(works).items():
        config = (ol.vlm_server_config if kind == "vlm" else ol.text_server_config)(args, folders[kind], "on")
        sweep.progress(f"starting {args.replicas} replicas routed by {router} ({kind})")
        with start_replicas(config, options, build_models) as srv:
            target = sweep.Target(router, srv.base_url, config.model_name, lambda: requests_by_replica(srv.url))
            for w in names:
                before = requests_by_replica(srv.url)
                out[w] = dict(ol.measure(target, works[w], args, slo, seed, extra_rates=False), before=before)
    return out


def requests_by_replica(url: str) -> dict:
    """Requests each replica has ended so far (``mmcache:request_success`` and ``request_errors`` by ``replica``
    label, from the application's ``/metrics``)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=30) as reply:
        text = reply.read().decode("utf-8")
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in ("mmcache:request_success", "mmcache:request_errors"):
            for sample in family.samples:
                if sample.name.endswith("_total") and "replica" in sample.labels:
                    out[sample.labels["replica"]] = out.get(sample.labels["replica"], 0.0) + sample.value
    return {"requests_by_replica": out}


# ---- summary ---------------------------------------------------------------------------------------------
def figures_of(swept: dict) -> dict:
    """One router's sweep of one workload as the compared figures: the matched share over every rate's requests,
    the goodput (also under a TPOT SLO of 5x the unloaded p50, as the single-server bench reports beside), and
    TTFT p50 and p99 at the top rate."""
    rows = swept["rates"]
    prompt = sum(r["prompt_tokens"] or 0 for r in rows)
    top = max(rows, key=lambda r: r["rate"])
    return {"matched_share": sum(r["cached_tokens"] or 0 for r in rows) / prompt if prompt else None,
            "goodput_rps": swept["goodput_rps"], "goodput_tpot5_rps": swept["goodput_by_tpot_times"].get("5"),
            "ttft_p50_s": top["ttft_p50_s"], "ttft_p99_s": top["ttft_p99_s"],
            "top_rate": top["rate"], "failed_requests": swept["failed_requests"],
            "busiest_replica_share": busiest_share(swept)}


def busiest_share(swept: dict) -> float | None:
    """The share of the sweep's requests (its warm-up too) that the busiest replica served: the replicas' counts
    after its last rate (the top one) less those before it; None without counts."""
    before = (swept.get("before") or {}).get("requests_by_replica")
    after = (swept["rates"][-1].get("check") or {}).get("requests_by_replica")
    if before is None or after is None:
        return None
    served = [after[r] - before.get(r, 0.0) for r in after]
    return max(served) / sum(served) if sum(served) > 0 else None


def _median(values: list) -> float | None:
    """The median of the values that are not None (None when none is); goodput's None counts as 0 (no rate met)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarise(figures: list[dict]) -> dict:
    """Per router and workload the median over repeats of each figure (a goodput of None counts as 0)."""
    out: dict = {}
    for router in figures[0]:
        for w in figures[0][router]:
            runs = [rep[router][w] for rep in figures]
            row = {m: _median([(r[m] or 0.0) if m in GOODPUTS else r[m] for r in runs]) for m in METRICS}
            row.update(repeats=len(runs), top_rate=runs[0]["top_rate"],
                       failed_requests=sum(r["failed_requests"] for r in runs),
                       busiest_replica_share=_median([r["busiest_replica_share"] for r in runs]))
            out.setdefault(router, {})[w] = row
    return out


def ratios(figures: list[dict]) -> dict:
    """mmcache's router over each baseline that ran, per workload and figure: each repeat's ratio (None where
    the baseline's figure is 0 or missing), their median, min and max."""
    out: dict = {}
    if "mmcache" not in figures[0]:
        return out
    for other in (r for r in BASELINES if r in figures[0]):
        for w in figures[0]["mmcache"]:
            for m in METRICS:
                per = [_ratio(rep["mmcache"][w][m], rep[other][w][m]) for rep in figures]
                finite = [r for r in per if r is not None]
                out.setdefault(other, {}).setdefault(w, {})[m] = {
                    "median": statistics.median(finite) if finite else None, "min": min(finite, default=None),
                    "max": max(finite, default=None), "runs": per}
    return out


def _ratio(mine, theirs) -> float | None:
    mine = 0.0 if mine is None else mine
    return mine / theirs if theirs else None


# issue 55's targets, by (figure, baseline, workload)
TARGETS = {("matched_share", "power-of-two", "multi_turn"): ">= 1.8x",
           ("matched_share", "power-of-two", "hot_prefix"): ">= 1.8x",
           ("matched_share", "prefix-text", "vlm_chat"): "> 1x",
           ("ttft_p99_s", "power-of-two", "hot_prefix"): "no worse",
           **{("goodput_rps", "power-of-two", w): ">= 1x" for w in ("vlm_chat", "multi_turn", "hot_prefix")}}
LABELS = {"matched_share": ("matched share (cached_tokens / prompt tokens)", ""),
          "goodput_rps": ("goodput (90% within the SLOs; 0: no rate)", None),
          "goodput_tpot5_rps": ("goodput with a TPOT SLO of 5x (not 2x) the unloaded p50", None),
          "ttft_p50_s": ("TTFT p50 at the top rate", "s"), "ttft_p99_s": ("TTFT p99 at the top rate", "s")}


def rows(result: dict) -> list[Row]:
    """Per router and workload the busiest replica's share of requests; per workload and figure, mmcache's router
    against each baseline (the ratio's median over repeats), or without mmcache's router each router on its own."""
    rep = result["replicas"]
    summary, over = rep["summary"], rep["ratios"]
    out = [Row("serve", f"replicas: {w} routed by {router}: the busiest replica's share of requests",
               figs["busiest_replica_share"], "", versus="") for router, by_w in summary.items()
           for w, figs in by_w.items() if figs.get("busiest_replica_share") is not None]
    for router, by_w in summary.items():
        if "mmcache" in summary:  # the comparisons below show every router's figures
            break
        for w, figs in by_w.items():
            for m in METRICS:
                label, unit = LABELS[m]
                out.append(Row("serve", f"replicas: {w} routed by {router}: {label}", figs[m] or 0.0,
                               unit if unit is not None else rep["workloads"][w]["unit"],
                               higher_is_better=HIGHER_IS_BETTER[m], versus=""))
    for w, b in rep.get("bounds", {}).items():
        if b.get("max_ratio") is not None:
            out.append(Row("serve", f"replicas: {w}: the most any router's matched share could be over random "
                                    f"placement's (one replica {b['one_replica']:.3f}, random {b['random']:.3f})",
                           b["max_ratio"], "x", versus=""))
    if "mmcache" not in summary:
        return out
    mine = summary["mmcache"]
    for other, by_w in over.items():
        for w, by_m in by_w.items():
            for m, r in by_m.items():
                label, unit = LABELS[m]
                spread = ""
                if len(r["runs"]) > 1 and r["median"] is not None:
                    ends = sorted(_better_by(x, HIGHER_IS_BETTER[m]) or 0.0 for x in (r["min"], r["max"]))
                    spread = f" [better by {ends[0]:.2f}-{ends[1]:.2f}x over {len(r['runs'])} runs]"
                out.append(Row("serve", f"replicas: {w}, {label}, mmcache router{spread}", mine[w][m] or 0.0,
                               unit if unit is not None else rep["workloads"][w]["unit"],
                               summary[other][w][m], versus=other, higher_is_better=HIGHER_IS_BETTER[m],
                               paired=_better_by(r["median"], HIGHER_IS_BETTER[m]),
                               target=TARGETS.get((m, other, w), "")))
    return out


def _better_by(ratio: float | None, higher_is_better: bool) -> float | None:
    """A ratio mmcache over baseline as the table's "better by" (above 1: better)."""
    if ratio is None:
        return None
    if higher_is_better:
        return ratio
    return 1 / ratio if ratio else None


# ---- what any router could reach --------------------------------------------------------------------------
def affinity_bounds(sessions: list[list[list[int]]], answers: list[list[int]], page_size: int, replicas: int,
                    draws: int = 200, seed: int = 0, answers_cached: bool = True) -> dict:
    """The matched share of a text workload's sessions (each its turns' token ids, as ``Plan.turns``; ``answers``:
    each turn's answer length) under three placements, from the prompts' arithmetic: ``one_replica`` (every
    request on one replica: perfect affinity, the shared prefixes computed once), ``chat_affinity`` (each chat
    whole on one of ``replicas`` replicas, chats dealt in turn: a shared prefix computed once a replica), and
    ``random`` (each request on a replica drawn uniformly, the mean over ``draws`` draws: with two replicas a
    chat's next turn stays on its replica half the time, as power-of-two choices do at low load). No eviction.
    A replica holds the full pages of every prompt it served (and of the prompt with its answer, when
    ``answers_cached``); a prompt matches the full pages it holds (its leading ones: what a replica holds of
    one chain is a prefix), so the share does not depend on the order the requests came in. Answers are tokens
    of their session's own, which no other session sends."""
    import random

    if page_size < 1 or replicas < 1 or draws < 1:
        raise WorkloadShapeError(f"affinity_bounds: page_size, replicas, draws >= 1, got {page_size}, {replicas}, "
                                 f"{draws}")
    requests = []  # per session, per turn: (prompt's page names, the page names its answer adds, prompt length)
    for s, (turns, lengths) in enumerate(zip(sessions, answers)):
        prompt: list = []
        chat = []
        for t, (ids, answer) in enumerate(zip(turns, lengths)):
            prompt = prompt + list(ids)
            whole = _page_names(prompt, page_size)
            prompt = prompt + [("answer", s, t, i) for i in range(answer)]
            after = _page_names(prompt, page_size) if answers_cached else whole
            chat.append((whole, after[len(whole):], len(prompt) - answer))
        requests.append(chat)
    total = sum(n for chat in requests for _, _, n in chat)

    def share(place) -> float:
        held = [set() for _ in range(replicas)]
        matched = 0
        for s, chat in enumerate(requests):
            for t, (names, added, _) in enumerate(chat):
                pages = held[place(s, t)]
                matched += page_size * sum(1 for n in names if n in pages)
                pages.update(names)
                pages.update(added)
        return matched / total if total else 0.0

    rng = random.Random(seed)
    draws_of = [share(lambda s, t: rng.randrange(replicas)) for _ in range(draws)]
    return {"one_replica": share(lambda s, t: 0), "chat_affinity": share(lambda s, t: s % replicas),
            "random": sum(draws_of) / len(draws_of), "random_min": min(draws_of), "random_max": max(draws_of),
            "prompt_tokens": total, "requests": sum(len(chat) for chat in requests)}


def workload_bounds(work: sweep.Workload, rates, page_size: int, replicas: int, seed: int) -> dict:
    """``affinity_bounds`` of a text workload as the sweep sends it: every rate's sessions (each rate under its
    own salt, so each starts cold), their shares weighted by their prompt tokens; ``max_ratio``: perfect
    affinity (one replica) over random placement, the most any router's matched share could show over a router
    that keeps a chat's next turn on its replica no more often than a uniform draw does."""
    sums: dict = {}
    total = 0
    for rate in rates:
        sessions = work.make({}, work.count(rate))
        b = affinity_bounds([x.turns for x in sessions], [x.max_tokens for x in sessions], page_size, replicas,
                            draws=50, seed=seed)
        for k in ("one_replica", "chat_affinity", "random"):
            sums[k] = sums.get(k, 0.0) + b[k] * b["prompt_tokens"]
        total += b["prompt_tokens"]
    out = {k: v / total if total else 0.0 for k, v in sums.items()}
    out["max_ratio"] = out["one_replica"] / out["random"] if out["random"] else None
    return out


def _page_names(ids: list, page_size: int) -> list:
    """The names of ``ids``' full pages, each naming its page and every page before it."""
    names, name = [], None
    for k in range(len(ids) // page_size):
        name = hash((name, tuple(ids[k * page_size:(k + 1) * page_size])))
        names.append(name)
    return names
