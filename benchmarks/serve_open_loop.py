"""The open-loop part of ``mmcache bench serve``: every workload on every engine, repeated.

Rules:

* A repeat runs every engine on every workload (``mmcache_nocache``, ``mmcache``, with ``--host-tier-bytes N``
  ``mmcache_tier`` (``mmcache`` with a host tier of N bytes below its pool), then with ``--peers`` vLLM at its
  defaults and tuned: ``benchmarks.serve_vllm``), each engine's server started afresh. Repeat k uses seed
  ``--seed + k`` for the text workloads' sessions, the arrival times and the salts (``serve_sweep`` salts by seed
  and rate), so no repeat reuses another's pages; the engines' order rotates by one per repeat, so drift in the
  machine's load does not always fall on the same engine.
* A workload's SLOs are measured once, on the cache-off engine unloaded in the first repeat (it runs first there),
  and held for every repeat: the repeats measure goodput against one bar.
* Each sweep runs the ladder (``--rates``), the foot (down to ``--min-rate``) and the rates near the line
  (``--near-line``); the summary (``benchmarks.serve_summary``) gives the median goodput per engine and the
  ratios' medians and ranges, taken within each repeat.
"""

from __future__ import annotations

import asyncio

from . import serve_summary as summary
from . import serve_sweep as sweep
from . import serve_workloads as sw
from .kernel_harness import order
from .options import MAX_REQUESTS

MMCACHE_ENGINES = ("mmcache_nocache", "mmcache", "mmcache_tier")  # served by ``mmcache serve`` in this process


def per_rate(args, rate: float, default: int) -> int:
    """Sessions a rate sends: ``rate x --duration`` (at least 1, at most MAX_REQUESTS), else ``default``."""
    if args.duration is None:
        return default
    return max(1, min(MAX_REQUESTS, round(rate * args.duration)))


def vlm_workload(args, plan) -> sweep.Workload:
    """The chats as open-loop sessions. More sessions than chats: the chats again, in order, each pass under its
    own ``cache_salt`` (the rate's, suffixed), so a pass shares no page and no store entry with the passes before
    it, as the rate shares none with other rates: repeating a chat word for word must not count as reuse."""
    from .serve import sampling_fields, sessions

    def make(options: dict, n: int) -> list:
        return [s for k in range(-(-n // len(plan))) for s in sessions(plan, pass_options(options, k))][:n]

    return sweep.Workload("vlm_chat", "sessions/s", make, lambda rate: per_rate(args, rate, args.sessions),
                          sampling_fields(args), params={"chats": len(plan), "turns": args.turns,
                                                         "images": args.images, "max_tokens": args.max_tokens})


def pass_options(options: dict, k: int) -> dict:
    """``options`` for pass ``k`` over the chats: pass 0 as given, a later one with its salt suffixed."""
    extra = options.get("extra_body") or {}
    if k == 0 or "cache_salt" not in extra:
        return options
    return dict(options, extra_body=dict(extra, cache_salt=f"{extra['cache_salt']}-pass{k}"))


def text_workloads(args, space, seed: int, names: list[str]) -> dict[str, sweep.Workload]:
    """The text workloads ``names`` on ``space`` from ``seed``, each sized for the largest rate's count."""
    from .serve import TEXT_SHAPES

    shape = TEXT_SHAPES["quick" if args.quick else "full"]
    default = {"multi_turn": args.text_sessions, "shared_prefix": args.text_requests, "mooncake": args.text_requests,
               "agent": args.text_sessions}
    most = {w: max(per_rate(args, r, n) for r in args.rates) for w, n in default.items()}
    per_group = shape["sp_per_group"]
    builders = {
        "multi_turn": lambda n: sw.multi_turn(space, seed, n, args.text_turns, shape["scale"], args.text_max_tokens),
        "shared_prefix": lambda n: sw.shared_prefix(space, seed, -(-n // per_group), per_group, shape["sp_system"],
                                                    shape["sp_question"], args.text_max_tokens),
        "mooncake": lambda n: sw.mooncake(space, shape["mc_start"], n, shape["mc_block"], args.text_max_tokens,
                                          shape["mc_prompt"]),
        "agent": lambda n: sw.agent(space, seed, n, args.text_turns, shape["scale"], args.text_max_tokens),
    }
    out = {}
    for name in names:
        plan = builders[name](most[name])
        count = (lambda n: lambda rate: per_rate(args, rate, n))(default[name])
        out[name] = sweep.Workload(name, f"{plan.unit}/s", plan.sessions, count,
                                   {"temperature": 0.0, "max_tokens": args.text_max_tokens}, plan.offsets,
                                   dict(plan.params, unit=f"{plan.unit}/s"))
    return out


def text_folder(args, tmp: str) -> tuple:
    """``--text-preset`` written as a model folder under ``tmp``, and its token space."""
    from pathlib import Path

    from .prefix import token_space
    from .serve_model import export_text_model

    sweep.progress(f"writing {args.text_preset} ({args.text_dtype}) as a model folder")
    folder = export_text_model(args.text_preset, Path(tmp) / args.text_preset, args.text_dtype)
    return folder, token_space(str(folder))


def mmcache_target(srv, engine: str) -> sweep.Target:
    from .serve import check_idle

    def after_rate() -> dict:
        held = check_idle(srv)
        return {"invariants": "ok", "held_after": held}

    return sweep.Target(engine, srv.base_url, srv.config.model_name, after_rate)


def text_server_config(args, folder, cache_mode: str, host_tier_bytes: int = 0):
    from mmcache.server import ServerConfig

    from .serve import MAX_WAITING, engine_config

    return ServerConfig(model=str(folder), dtype=args.text_dtype,
                        engine_config=engine_config(args, cache_mode, host_tier_bytes),
                        served_model_name=args.text_preset, max_waiting=MAX_WAITING)


def vlm_folder(args, tmp: str):
    """``--preset`` written as a model folder under ``tmp`` (``mmcache export-model``), which mmcache's servers and
    vLLM's all load for ``vlm_chat``: one set of weights, one image processor, one chat template."""
    from pathlib import Path

    from mmcache.presets.export import export_model

    sweep.progress(f"writing {args.preset} ({args.dtype}) as a model folder")
    return export_model(args.preset, Path(tmp) / args.preset, args.dtype)


def vlm_server_config(args, folder, cache_mode: str, host_tier_bytes: int = 0):
    """The VLM server over ``folder``; cache ``off``: no page reuse and a store of one byte, which every encoder
    output bypasses (the vision tower runs for every image of every request)."""
    from .serve import MAX_WAITING, STORE_BYTES, engine_config
    from mmcache.server import ServerConfig

    return ServerConfig(model=str(folder), dtype=args.dtype,
                        engine_config=engine_config(args, cache_mode, host_tier_bytes),
                        store_bytes=STORE_BYTES if cache_mode == "on" else 1, max_waiting=MAX_WAITING)


def images_per_request(plan) -> int:
    """The most images one request of the chats carries (a turn sends the whole history)."""
    return max(1, max(len(chat.new_images) for chat in plan))


def vllm_client(args, clients: dict, folder, tmp: str, seed: int):
    """With ``--vllm-client``: a function that drives a text server (base URL, engine, served name) with vLLM's own
    benchmark client once, its figures appended to ``clients[engine]``; else None."""
    if not args.vllm_client:
        return None
    from pathlib import Path

    from .peers.vllm_bench_client import BenchShape, run

    def drive(base_url: str, engine: str, model: str) -> None:
        result = Path(tmp) / f"vllm-client-{engine}-{seed}.json"
        clients.setdefault(engine, []).append(run(base_url, model, str(folder), str(result), BenchShape(seed=seed)))

    return drive


def measure(target: sweep.Target, work: sweep.Workload, args, slo: dict, seed: int, extra_rates: bool = True) -> dict:
    """SLOs first where ``slo`` lacks the workload (its unloaded run here), else a warm-up; then the sweep, with the
    foot and the rates near the line unless ``extra_rates`` is False."""
    if work.name not in slo:
        slo[work.name] = asyncio.run(sweep.unloaded(target, work, seed, args.time_limit))
        sweep.progress(f"SLOs of {work.name}: TTFT {slo[work.name]['ttft_s']:.3g} s, "
                       f"TPOT {slo[work.name]['tpot_s']:.3g} s")
    else:
        asyncio.run(sweep.warm_up(target, work, seed))
    floor, between = (args.min_rate, tuple(args.near_line)) if extra_rates else (None, ())
    return asyncio.run(sweep.sweep(target, work, args.rates, slo[work.name], seed, args.time_limit, floor=floor,
                                   between=between))


def engine_names(args) -> list[str]:
    """The engines of a repeat, in the first repeat's order: cache off first (its unloaded run sets the SLOs)."""
    from .serve_vllm import peer_configs

    tier = ["mmcache_tier"] if args.host_tier_bytes else []
    return ["mmcache_nocache", "mmcache"] + tier + ([c.engine for c in peer_configs(args)] if args.peers else [])


def open_loop(args, plan) -> dict:
    """Every workload on every engine, ``--load-repeats`` times (module docstring): ``{"slo", "engines",
    "mmcache_over", "runs", "peer", "workloads"}``; ``engines`` in issue 44's shape with the median goodput."""
    import tempfile

    texts = [w for w in args.workloads if w in sw.TEXT_WORKLOADS]
    names = engine_names(args)
    slo: dict = {}
    peer: dict = {}
    runs, per_repeat, clients = [], [], {}
    vlm = plan is not None and "vlm_chat" in args.workloads
    with tempfile.TemporaryDirectory(prefix="mmcache-serve-") as tmp:
        folder, space = text_folder(args, tmp) if texts else (None, None)
        folders = {"text": folder, "vlm": vlm_folder(args, tmp) if vlm else None}
        for k in range(args.load_repeats):
            seed = args.seed + k
            works = text_workloads(args, space, seed, texts) if texts else {}
            if vlm:
                works["vlm_chat"] = vlm_workload(args, plan)
            engines = order(names, k)
            sweep.progress(f"open loop, repeat {k + 1} of {args.load_repeats} (seed {seed}): {', '.join(engines)}")
            measured = {}
            drive = vllm_client(args, clients, folder, tmp, seed)
            for engine in engines:
                per = measured[engine] = {}
                if engine in MMCACHE_ENGINES:
                    sweep_mmcache(engine, works, texts, folders, args, slo, per, seed, drive)
                else:
                    ran = _sweep_vllm(engine, args, folders, works, texts, plan, slo, per, seed, tmp, drive)
                    peer.setdefault(engine, ran)
            runs.append({"repeat": k, "seed": seed, "order": engines})
            per_repeat.append({e: measured[e] for e in names})
    engines_out = {e: {w: summary.combine([run[e][w] for run in per_repeat]) for w in per_repeat[0][e]}
                   for e in names}
    return {"slo": slo, "engines": engines_out, "vllm_client": clients,
            "mmcache_over": {w: summary.ratios(per_repeat, w) for w in args.workloads}, "runs": runs,
            "peer": peer, "workloads": {w: dict(works[w].params, unit=works[w].unit) for w in works}}


def _sweep_vllm(engine: str, args, folders: dict, works: dict, texts: list[str], plan, slo: dict, per: dict,
                seed: int, tmp: str, drive=None) -> dict:
    """One vLLM configuration on the text workloads (the text folder) and on ``vlm_chat`` (the VLM folder), each
    on a server of its own; what each server ran with, by folder kind."""
    from .serve_vllm import peer_configs, sweep_peer

    config = next(c for c in peer_configs(args) if c.engine == engine)
    ran = {}
    if texts:
        ran["text"] = sweep_peer(args, config, folders["text"], args.text_preset, args.text_dtype,
                                 [works[w] for w in texts], slo, per, seed, tmp, after=drive)
    if "vlm_chat" in works:
        ran["vlm"] = sweep_peer(args, config, folders["vlm"], args.preset, args.dtype, [works["vlm_chat"]], slo, per,
                                seed, tmp, images_per_prompt=images_per_request(plan))
    return ran


def sweep_mmcache(engine: str, works: dict, texts: list[str], folders: dict, args, slo: dict, per: dict,
                  seed: int, drive=None) -> None:
    """One mmcache engine (cache off for ``mmcache_nocache``, a host tier of ``--host-tier-bytes`` for
    ``mmcache_tier``) on every workload, into ``per``; ``drive`` (vLLM's client) runs on the text server after its
    sweeps."""
    from mmcache.presets import serve

    mode = "off" if engine == "mmcache_nocache" else "on"
    tier = args.host_tier_bytes if engine == "mmcache_tier" else 0
    if "vlm_chat" in works:
        with serve(vlm_server_config(args, folders["vlm"], mode, tier)) as srv:
            per["vlm_chat"] = measure(mmcache_target(srv, engine), works["vlm_chat"], args, slo, seed)
    if texts:
        with serve(text_server_config(args, folders["text"], mode, tier)) as srv:
            for w in texts:
                per[w] = measure(mmcache_target(srv, engine), works[w], args, slo, seed)
            if drive is not None:
                drive(srv.base_url, engine, srv.config.model_name)
