"""Turning a replay log into the reported record, and running the pool-size and routing sweep.

Every share is matched prompt tokens over all prompt tokens of the requests that arrived (a rejected request
counts in the denominator and matches nothing):

* ``ceiling_share``: an unlimited pool, same page size, same order (``ceiling``);
* ``realized_share``: what the replicas' managers seeded at the admissions that ran;
* ``forfeit_share``: pages right after the realized match that a request still in flight held, written but
  not yet stored (``AdmitResult.forfeit_tokens``): the price of storing at teardown;
* ``replica_ceiling_share``: the ceiling when each replica only sees what was routed to it, so
  ``dilution_share = ceiling_share - replica_ceiling_share`` is the repeat-prefix share routing sent to a
  replica that never saw the prefix;
* ``residual_share = ceiling_share - realized_share - forfeit_share``: the gap to the ceiling that the
  forfeit does not explain. It holds ``dilution_share`` (0 with one replica) as well as what the pool size
  costs (evictions, queueing, rejections), so residual and dilution overlap and are not to be added.

``stalls`` counts allocations that failed while cached data still held pages (must be 0); a request held
because live requests alone filled its pool is counted in ``queue`` instead.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable, Sequence

import numpy as np

from .ceiling import ceiling_from_names
from .simulate import ReplayConfig, RunLog, simulate
from .workload import Workload


def _share(tokens, total: int) -> float:
    return float(np.sum(tokens)) / total if total else 0.0


def _stats(values: np.ndarray) -> dict:
    if len(values) == 0:
        return {"mean": None, "p50": None, "p99": None}
    return {"mean": float(values.mean()), "p50": float(np.percentile(values, 50)),
            "p99": float(np.percentile(values, 99))}


def duplicate_media_rate(log: RunLog) -> float | None:
    """Of the media items arrived requests bring anew, the share whose digest an earlier request brought; None
    when no request brings any. A request brings anew every item but those it carries from its chat's history:
    an item with the same digest at the same position as in an earlier request of the same session (the spec's
    ``session``; a spec without one has no history) was brought by that earlier request, and a chat re-sending
    its history repeats no medium. The same image sent again later in a chat, or in another chat, is a
    duplicate: the encoder-output store would serve it."""
    seen: set = set()  # digests brought anew so far
    history: dict = {}  # session -> (digest, position) of every item its requests carried
    items = repeats = 0
    for spec in log.specs:
        session = getattr(spec, "session", None)
        carried = history.setdefault(session, set()) if session is not None else set()
        media = [(m.digest, m.position) for m in spec.media()]
        fresh = [digest for digest, position in media if (digest, position) not in carried]
        items += len(fresh)
        repeats += sum(d in seen for d in fresh)
        seen.update(fresh)
        carried.update(media)
    return repeats / items if items else None


def build_record(log: RunLog, ceiling: np.ndarray, workload: str) -> dict:
    """The JSON record of one replay of ``workload`` (its description). ``ceiling`` is the unlimited pool's
    match per request of ``log`` (``ceiling_from_names`` over ``log.final_names``)."""
    cfg = log.config
    prompt = np.asarray([s.prompt_len for s in log.specs], dtype=np.int64)
    total = int(prompt.sum())
    matched, forfeit = log.array("matched", np.int64), log.array("forfeit", np.int64)
    replica, rejected, waited = log.array("replica", np.int64), log.array("rejected", bool), log.array("waited", bool)
    replica_ceiling = (ceiling_from_names(log.final_names, prompt, cfg.page_size, groups=replica.tolist())
                       if cfg.replicas > 1 else ceiling)
    served = ~rejected
    admit, arrival = log.array("admit_s", float), log.array("arrival_s", float)
    wait = (admit - arrival)[served]
    ttft = wait + log.array("prefill_s", float)[served]
    per_replica = _per_replica(log, prompt, matched, forfeit, replica, waited)
    shares = [r["realized_share"] for r in per_replica if r["requests"]]
    return {
        "workload": workload,
        "pool_tokens": cfg.pool_tokens, "host_tier_tokens": cfg.host_tier_tokens,
        "disk_tier_tokens": cfg.disk_tier_tokens, "page_size": cfg.page_size,
        "num_replicas": cfg.replicas,
        "routing": cfg.routing if cfg.replicas > 1 else "single", "store_at": cfg.store_at,
        "requests": len(log.specs), "rejected": int(rejected.sum()), "prompt_tokens": total,
        **_shares(ceiling, replica_ceiling, matched, forfeit, total),
        **_pool_events(log, waited, wait),
        "ttft_s": _stats(ttft),
        "duplicate_media_rate": duplicate_media_rate(log),
        "replicas": per_replica,
        "spread": (max(shares) - min(shares)) if shares else 0.0,
        "simulated_s": float(np.nanmax(log.array("end_s", float))) if served.any() else 0.0,
        "cost_model": {"prefill_tps": cfg.cost.prefill_tps, "decode_tps": cfg.cost.decode_tps},
        "router": {"depth_tokens": cfg.route_depth_tokens, "load_factor": cfg.route_load_factor,
                   "min_load": cfg.route_min_load, "fallback": cfg.route_fallback},
    }


def _shares(ceiling: np.ndarray, replica_ceiling: np.ndarray, matched: np.ndarray, forfeit: np.ndarray,
            total: int) -> dict:
    """The record's shares of all prompt tokens, as the module's docstring defines them."""
    ceiling_share, realized, forfeited = _share(ceiling, total), _share(matched, total), _share(forfeit, total)
    return {
        "ceiling_share": ceiling_share, "realized_share": realized, "forfeit_share": forfeited,
        "residual_share": ceiling_share - realized - forfeited,
        "replica_ceiling_share": _share(replica_ceiling, total),
        "dilution_share": ceiling_share - _share(replica_ceiling, total),
    }


def _pool_events(log: RunLog, waited: np.ndarray, wait: np.ndarray) -> dict:
    """The record's eviction, stall and queue counts, summed over the replicas' managers."""
    managers = log.managers
    return {
        "evictions": sum(m.metrics.evicted_pages for m in managers),
        "tier_hit_pages": _tier_hits(managers, "host"),
        "disk_tier_hit_pages": _tier_hits(managers, "disk"),
        "eviction_batches": sum(m.metrics.eviction_batches for m in managers),
        "stalls": sum(m.metrics.alloc_failures_cache_held for m in managers),
        "queue": {"waited_requests": int(waited.sum()),
                  "failed_admissions": sum(m.metrics.alloc_failures_uncached for m in managers),
                  "wait_s": _stats(wait)},
    }


def _tier_hits(managers: list, level: str) -> int:
    """Pages the replicas' tier ``level`` gave back to their pools."""
    return sum(m.tiers.metrics()[level]["hits"] for m in managers
               if m.tiers is not None and m.tiers.level(level) is not None)


def _per_replica(log: RunLog, prompt: np.ndarray, matched: np.ndarray, forfeit: np.ndarray, replica: np.ndarray,
                 waited: np.ndarray) -> list[dict]:
    """One entry per replica: its requests, prompt tokens, shares, evictions, stalls and waits."""
    per_replica = []
    for r, m in enumerate(log.managers):
        sel = replica == r
        tokens = int(prompt[sel].sum())
        per_replica.append({
            "replica": r, "requests": int(sel.sum()), "prompt_tokens": tokens,
            "realized_share": _share(matched[sel], tokens), "forfeit_share": _share(forfeit[sel], tokens),
            "evictions": m.metrics.evicted_pages, "stalls": m.metrics.alloc_failures_cache_held,
            "waited_requests": int((waited & sel).sum()),
        })
    return per_replica


class CeilingCache:
    """Ceilings by (page size, arrival order): a sweep replays one order many times."""

    def __init__(self):
        self._memo: dict = {}

    def get(self, log: RunLog) -> np.ndarray:
        key = (log.config.page_size, tuple(s.request_id for s in log.specs))
        if key not in self._memo:
            self._memo[key] = ceiling_from_names(log.final_names, [s.prompt_len for s in log.specs],
                                                 log.config.page_size)
        return self._memo[key]


def replay(workload: Workload, config: ReplayConfig, ceilings: CeilingCache | None = None) -> dict:
    """Replay once and report; ``wall_s`` covers the replay and its ceilings."""
    t0 = time.perf_counter()
    log = simulate(workload, config)
    record = build_record(log, (ceilings or CeilingCache()).get(log), workload.description)
    record["wall_s"] = time.perf_counter() - t0
    return record


def sweep_configs(base: ReplayConfig, pools: Sequence[int], store_ats: Sequence[str]) -> list[ReplayConfig]:
    """Single replica, plus random and affinity routing when ``base.replicas > 1``, at every pool size and
    storing setting."""
    policies = [(1, "affinity")]
    if base.replicas > 1:
        policies += [(base.replicas, "random"), (base.replicas, "affinity")]
    return [replace(base, pool_tokens=pool, replicas=r, routing=routing, store_at=store_at)
            for pool in pools for r, routing in policies for store_at in store_ats]


def run_sweep(workload: Workload, configs: Sequence[ReplayConfig],
              progress: Callable[[dict], None] | None = None) -> list[dict]:
    ceilings = CeilingCache()
    records = []
    for config in configs:
        records.append(replay(workload, config, ceilings))
        if progress is not None:
            progress(records[-1])
    return records
