"""``mmcache replay``: replay a trace through metadata-only pools and report what the cache would save.

    mmcache replay TRACE [--format mooncake|sessions|tracelab] [--pool-tokens N] [--host-tier-tokens N]
                         [--disk-tier-tokens N]
                         [--page-size P] [--replicas R]
                         [--routing random|affinity] [--store-at teardown|prefill|both]
                         [--sweep [--sweep-pools N,N,...]] [--json PATH] [--plot PNG] [cost/router options]

TRACE is a Mooncake JSONL trace, for ``--format sessions`` the sessions generator's parameter file (the
word ``default`` names the repository's ``datasets/sessions/agent_sessions.json``), or for ``--format tracelab``
a TraceLab session CSV, replayed closed-loop (``tracelab``). Without ``--format`` the format follows the
extension: ``.jsonl`` is Mooncake, ``.json`` (or ``default``) is sessions, ``.csv`` is TraceLab.
``--host-tier-tokens`` gives each replica's pool a second tier in host memory of that many tokens, and
``--disk-tier-tokens`` a disk level of that many below it (metadata only, as the pool: what the host level gives
up goes there instead of being lost).

The JSON holds the record of the run the options name (with ``--store-at both``, the teardown record, and
both under ``by_store_at``) and, with ``--sweep``, a ``sweep`` list of records for every pool size, for
one replica and for ``--replicas`` replicas routed randomly and by affinity, each storing at teardown and
at prefill; the plot shows realized share against pool size, one line per policy.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

from ..cli import count, positive_int, writable, write_json
from ..errors import MmcacheError
from ..manager import STORE_AT
from ..router import FALLBACKS
from .costmodel import CostModel
from .mooncake import MooncakeTrace
from .plot import can_plot, plot_sweep, policy_label
from .report import run_sweep, sweep_configs
from .sessions import DEFAULT_PARAMS, AgentSessions, load_params
from .simulate import ROUTINGS, ReplayConfig
from .tracelab import TraceLabSessions

DEFAULT_POOLS = (65_536, 131_072, 262_144, 524_288)


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the epilog's layout and shows each option's default."""


def _pools(text: str) -> list[int]:
    pools = [positive_int(p) for p in text.split(",") if p.strip()]
    if not pools:  # "," or "": a sweep of nothing would still write an empty plot
        raise argparse.ArgumentTypeError(f"names no pool size: {text!r}")
    return pools


def register(sub) -> None:
    d = ReplayConfig()
    c = CostModel()
    p = sub.add_parser("replay", help="replay a trace through metadata-only pools",
                       description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                       formatter_class=_Formatter)
    p.add_argument("trace", metavar="TRACE")
    p.add_argument("--format", choices=("mooncake", "sessions", "tracelab"),
                   help="from TRACE's extension when not given")
    _add_pool_options(p, d)
    _add_output_options(p)
    _add_cost_options(p, c)
    _add_router_options(p, d)
    p.add_argument("--limit", type=positive_int, help="Mooncake: replay only the first N requests")
    p.set_defaults(func=main)


def _add_pool_options(p: argparse.ArgumentParser, d: ReplayConfig) -> None:
    """Adds the options of the replayed pools (defaults from ``d``): size, pages, replicas, routing, storing."""
    p.add_argument("--pool-tokens", type=positive_int, default=d.pool_tokens, help="pool per replica")
    p.add_argument("--page-size", type=positive_int, default=d.page_size, help="tokens per page")
    p.add_argument("--replicas", type=positive_int, default=d.replicas, help="data-parallel replicas")
    p.add_argument("--host-tier-tokens", type=count(minimum=0), default=d.host_tier_tokens, metavar="N",
                   help="a second tier in host memory below each replica's pool (0: none)")
    p.add_argument("--disk-tier-tokens", type=count(minimum=0), default=d.disk_tier_tokens, metavar="N",
                   help="a disk level below the host tier of each replica (metadata only; 0: none)")
    p.add_argument("--routing", choices=ROUTINGS, default=d.routing, help="replica choice when R > 1")
    p.add_argument("--store-at", choices=STORE_AT + ("both",), default="both",
                   help="when pages enter the index; both replays each setting")


def _add_output_options(p: argparse.ArgumentParser) -> None:
    """Adds the options of what is run and written besides the named run: the sweep, the JSON, the plot."""
    p.add_argument("--sweep", action="store_true", help="also run every pool of --sweep-pools and policy")
    # The default is DEFAULT_POOLS itself, so that main can tell the option given (a new list) from not given.
    p.add_argument("--sweep-pools", type=_pools, default=DEFAULT_POOLS, metavar="N,N,...",
                   help="pool sizes of the sweep, tokens per replica (with --sweep)")
    p.add_argument("--json", metavar="PATH", help="write the records as JSON")
    p.add_argument("--plot", metavar="PNG",
                   help="the sweep plot (with --sweep; without this option it goes beside --json)")


def _add_cost_options(p: argparse.ArgumentParser, c: CostModel) -> None:
    """Adds the cost model's rates (defaults from ``c``), which turn tokens into simulated seconds."""
    p.add_argument("--prefill-tps", type=float, default=c.prefill_tps,
                   help="uncached prompt tokens per second per request (the default is a nominal GPU figure)")
    p.add_argument("--decode-tps", type=float, default=c.decode_tps,
                   help="output tokens per second per request (the default is a nominal GPU figure)")


def _add_router_options(p: argparse.ArgumentParser, d: ReplayConfig) -> None:
    """Adds the affinity router's options and the seed of random routing (defaults from ``d``)."""
    p.add_argument("--route-depth-tokens", type=positive_int, default=d.route_depth_tokens,
                   help="affinity routes by the name of the page ending at this depth (a shorter prompt by its "
                        "first page)")
    p.add_argument("--route-load-factor", type=float, default=d.route_load_factor,
                   help="affinity skips the preferred replica when its requests (running or waiting) exceed "
                        "max(--route-min-load, this x the mean over replicas)")
    p.add_argument("--route-min-load", type=float, default=d.route_min_load,
                   help="load below which the preferred replica is always used")
    p.add_argument("--route-fallback", choices=FALLBACKS, default=d.route_fallback,
                   help="where affinity sends a request past the threshold: deeper, the first replica under it "
                        "in the ranking of the page twice as deep (the prompt's last when shorter); random, the "
                        "runtime's own choice; or the least-loaded replica")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of random routing and of the router's uniform draws")


def _is_sessions(trace: str) -> bool:
    return trace == "default" or trace.endswith(".json")


def load_workload(trace: str, fmt: str | None, limit: int | None = None):
    if fmt is None:
        fmt = "sessions" if _is_sessions(trace) else "tracelab" if trace.endswith(".csv") else "mooncake"
    if fmt == "mooncake":
        return MooncakeTrace(trace, limit=limit)
    if fmt == "tracelab":
        return TraceLabSessions(trace)
    path = DEFAULT_PARAMS if trace == "default" else Path(trace)
    return AgentSessions(load_params(path), source=path.name)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.2f}"


def format_table(records: list[dict]) -> str:
    head = ("pool", "policy", "store", "ceiling%", "realized%", "forfeit%", "residual%", "dilution%",
            "evicted", "stalls", "waited", "rejected", "spread%", "wall_s")
    rows = [head]
    for r in records:
        rows.append((str(r["pool_tokens"]), policy_label(r), r["store_at"], _pct(r["ceiling_share"]),
                     _pct(r["realized_share"]), _pct(r["forfeit_share"]), _pct(r["residual_share"]),
                     _pct(r["dilution_share"]), str(r["evictions"]), str(r["stalls"]),
                     str(r["queue"]["waited_requests"]), str(r["rejected"]), _pct(r["spread"]),
                     f"{r['wall_s']:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows)


def _plot_path(args) -> str | None | bool:
    """Where the sweep plot goes: ``--plot``, else beside ``--json`` (with ``--sweep`` and matplotlib), else
    None; False (said on stderr) when that path cannot take a PNG or would replace the JSON."""
    if args.plot:
        plot = args.plot
        if Path(plot).suffix.lower() != ".png":
            print(f"mmcache replay: --plot writes a PNG: {plot} must end in .png", file=sys.stderr)
            return False
    elif args.sweep and args.json and can_plot():
        plot = str(Path(args.json).with_suffix(".png"))
    else:
        return None
    if args.json and os.path.abspath(plot) == os.path.abspath(args.json):
        print(f"mmcache replay: the plot would replace the JSON at {args.json}; give --plot another path",
              file=sys.stderr)
        return False
    return plot


def main(args) -> int:
    """Runs ``mmcache replay``: 0 when done, 2 for options refused before the replay, 1 for a replay error."""
    if _options_refused(args):
        return 2
    plot = _plot_path(args)
    if plot is False or not (writable(args.json, "mmcache replay") and writable(plot, "mmcache replay")):
        return 2
    if _limit_refused(args):
        return 2
    try:
        workload = load_workload(args.trace, args.format, args.limit)
        base = _base_config(args)
        store_ats = list(STORE_AT) if args.store_at == "both" else [args.store_at]
        mains = [replace(base, store_at=s) for s in store_ats]
        configs = list(mains)
        if args.sweep:
            configs += [c for c in sweep_configs(base, args.sweep_pools, store_ats) if c not in mains]
        records = run_sweep(workload, configs,
                            progress=lambda r: print(format_table([r]).split("\n")[1], file=sys.stderr, flush=True))
    except MmcacheError as e:
        print(f"mmcache replay: {e}", file=sys.stderr)
        return 1
    out = _output(args, dict(zip(configs, records)), mains, base, store_ats)
    print(format_table(records))
    write_json(args.json, out)  # replaced whole: a run stopped while writing leaves the previous file
    _finish_plot(args, plot, out, workload.description)
    return 0


def _options_refused(args) -> bool:
    """True, said on stderr, where a sweep option comes without ``--sweep`` or ``--plot`` without matplotlib."""
    for option, given in (("--plot", args.plot), ("--sweep-pools", args.sweep_pools is not DEFAULT_POOLS)):
        if given and not args.sweep:  # refused, not ignored
            print(f"mmcache replay: {option} needs --sweep", file=sys.stderr)
            return True
    if args.plot and not can_plot():  # refused before the replay, not after it
        print("mmcache replay: --plot needs matplotlib (pip install 'mmcache[bench]')", file=sys.stderr)
        return True
    return False


def _limit_refused(args) -> bool:
    """True, said on stderr, where ``--limit`` is given for a sessions or TraceLab trace (it applies to
    Mooncake's)."""
    guessed = args.format is None and (_is_sessions(args.trace) or args.trace.endswith(".csv"))
    if args.limit and (args.format in ("sessions", "tracelab") or guessed):
        print("mmcache replay: --limit applies to Mooncake traces; set `sessions` in the parameter file",
              file=sys.stderr)
        return True
    return False


def _base_config(args) -> ReplayConfig:
    """The replay the options name, before ``--store-at`` and the sweep vary it."""
    return ReplayConfig(pool_tokens=args.pool_tokens, host_tier_tokens=args.host_tier_tokens,
                        disk_tier_tokens=args.disk_tier_tokens,
                        page_size=args.page_size, replicas=args.replicas,
                        routing=args.routing, route_depth_tokens=args.route_depth_tokens,
                        route_load_factor=args.route_load_factor, route_min_load=args.route_min_load,
                        route_fallback=args.route_fallback, seed=args.seed,
                        cost=CostModel(args.prefill_tps, args.decode_tps))


def _output(args, by_config: dict, mains: list[ReplayConfig], base: ReplayConfig, store_ats: list[str]) -> dict:
    """The JSON: the first named run's record, every named run's ``by_store_at`` where several, the ``sweep``."""
    out = dict(by_config[mains[0]])
    if len(mains) > 1:
        out["by_store_at"] = {c.store_at: by_config[c] for c in mains}
    if args.sweep:
        out["sweep"] = [by_config[c] for c in sweep_configs(base, args.sweep_pools, store_ats)]
    return out


def _finish_plot(args, plot: str | None, out: dict, description: str) -> None:
    """Draws the sweep plot at ``plot``; or, where it would have gone beside ``--json``, says why it did not."""
    if plot is None and args.sweep and args.json:  # only the plot beside --json is left out this way
        print("mmcache replay: no plot beside the JSON: matplotlib is not installed", file=sys.stderr)
    elif plot:
        plot_sweep(out["sweep"], plot, title=f"{description}, page {args.page_size}, "
                                             f"prefill {args.prefill_tps:g} tok/s, decode {args.decode_tps:g} tok/s")
        print(f"wrote {plot}", file=sys.stderr)
