"""What the repeated open-loop runs of ``mmcache bench serve`` add up to: per engine and workload the goodput over
repeats, per pair of engines the goodput ratio's median and range, whether a ratio rests on one ladder step, and
the table's rows.

Rules:

* A repeat runs every engine on every workload (``benchmarks.serve_open_loop``); one engine's sweep of one
  workload in one repeat is ``serve_sweep.sweep``'s dict. Over repeats an engine's goodput is the median of the
  repeats' goodputs (the mean of the middle two for an even count), a repeat with none counting as 0; a median of
  0 is None, as a sweep's goodput is.
* A ratio is mmcache's goodput over another engine's, taken within each repeat; its summary is the median, min and
  max over the repeats where both engines have a goodput; the repeats where one has none are counted beside.
* A ratio rests on one ladder step in a repeat when an attainment that decides it lies within ``MARGIN`` of the
  line (``serve_sweep.THRESHOLD``): either engine's at its goodput rate (a small loss would lower its goodput) or
  at the lowest rate it swept above that (a small gain would raise it).
"""

from __future__ import annotations

import statistics

from .serve_sweep import THRESHOLD
from .table import Row

MARGIN = 0.05
PEER_LABELS = {"mmcache_nocache": "cache off", "mmcache_tier": "mmcache with the host tier",
               "vllm_cpu": "vLLM at its defaults", "vllm_cpu_tuned": "vLLM tuned"}


def median_goodput(values: list[float | None]) -> float | None:
    """The median of per-repeat goodputs, None counting as 0; None when the median is 0."""
    if not values:
        return None
    middle = statistics.median(0.0 if v is None else v for v in values)
    return middle or None


def combine(runs: list[dict]) -> dict:
    """One engine's sweeps of one workload, one per repeat, as one dict: the median goodput (also under each TPOT
    multiple), each repeat's goodput, and every repeat's rows, each marked with its repeat."""
    first = runs[0]
    by_times = {key: median_goodput([r["goodput_by_tpot_times"][key] for r in runs])
                for key in first["goodput_by_tpot_times"]}
    return {"unit": first["unit"], "goodput_rps": median_goodput([r["goodput_rps"] for r in runs]),
            "goodput_runs": [r["goodput_rps"] for r in runs], "goodput_by_tpot_times": by_times,
            "rates": [dict(row, repeat=k) for k, r in enumerate(runs) for row in r["rates"]],
            "failed_requests": sum(r["failed_requests"] for r in runs)}


def near_line(rows: list[dict], goodput: float | None) -> list[dict]:
    """The attainments of one sweep that decide its goodput and lie within ``MARGIN`` of the line: at the goodput
    rate, and at the lowest rate swept above it (the lowest rate of all when there is no goodput)."""
    above = [r for r in rows if r["attainment"] is not None and (goodput is None or r["rate"] > goodput)]
    deciding = [r for r in rows if goodput is not None and r["rate"] == goodput]
    if above:
        deciding.append(min(above, key=lambda r: r["rate"]))
    return [{"rate": r["rate"], "attainment": r["attainment"]} for r in deciding
            if abs(r["attainment"] - THRESHOLD) <= MARGIN]


def ratio_summary(mine: list[dict], other: list[dict]) -> dict:
    """mmcache's goodput over another engine's on one workload, from both engines' sweeps per repeat (the same
    repeats, in order): per repeat the ratio (None where either has no goodput) and the attainments near the line
    that decide it; the median, min and max of the ratios there are; in how many repeats it rests on one step."""
    if len(mine) != len(other):
        raise ValueError(f"ratios need the same repeats on both engines, got {len(mine)} and {len(other)}")
    runs = []
    for a, b in zip(mine, other):
        ga, gb = a["goodput_rps"], b["goodput_rps"]
        close = {"mmcache": near_line(a["rates"], ga), "other": near_line(b["rates"], gb)}
        runs.append({"ratio": ga / gb if ga and gb else None, "near_line": close,
                     "one_step": bool(close["mmcache"] or close["other"])})
    finite = [r["ratio"] for r in runs if r["ratio"] is not None]
    return {"median": statistics.median(finite) if finite else None, "min": min(finite, default=None),
            "max": max(finite, default=None), "repeats": len(runs), "without_ratio": len(runs) - len(finite),
            "one_step_repeats": sum(r["one_step"] for r in runs), "runs": runs}


def ratios(per_repeat: list[dict], workload: str) -> dict:
    """mmcache over every other engine on ``workload``: ``{engine: ratio_summary}``, from the repeats'
    ``{engine: {workload: sweep}}``."""
    mine = [run["mmcache"][workload] for run in per_repeat if workload in run.get("mmcache", {})]
    out = {}
    for engine in per_repeat[0]:
        if engine != "mmcache" and mine and workload in per_repeat[0][engine]:
            out[engine] = ratio_summary(mine, [run[engine][workload] for run in per_repeat])
    return out


def attainment_by_rate(figures: dict, key: str = "attainment") -> dict[float, float]:
    """The median attainment (or another figure of the rows, ``key``) at each rate over the repeats that swept it."""
    seen: dict[float, list[float]] = {}
    for row in figures["rates"]:
        if row.get(key) is not None:
            seen.setdefault(row["rate"], []).append(row[key])
    return {rate: statistics.median(values) for rate, values in sorted(seen.items())}


def _spread(summary: dict) -> str:
    """The words after a goodput row's metric: the ratio's range over repeats, and the step it rests on."""
    words = []
    if summary["repeats"] > 1:
        words.append(f"median of {summary['repeats']} runs" + (
            f", ratio {summary['min']:.2f}-{summary['max']:.2f}x" if summary["median"] is not None else ""))
        if summary["without_ratio"]:
            words.append(f"no ratio in {summary['without_ratio']}")
    if summary["one_step_repeats"]:
        words.append("rests on one ladder step" + (f" in {summary['one_step_repeats']} of {summary['repeats']}"
                                                   if summary["repeats"] > 1 else ""))
    return f" [{'; '.join(words)}]" if words else ""


def open_loop_rows(result: dict) -> list[Row]:
    """Per workload: SLO attainment per rate (medians over repeats), cache on against cache off by rate; goodput
    against cache off and against each vLLM configuration, with the ratio's median over repeats (``paired``)."""
    engines, over = result.get("engines") or {}, result.get("mmcache_over") or {}
    rows = []
    for w, mine in (engines.get("mmcache") or {}).items():
        unit = mine["unit"]
        off = (engines.get("mmcache_nocache") or {}).get(w)
        base_at = attainment_by_rate(off) if off else {}
        for rate, value in attainment_by_rate(mine).items():
            rows.append(Row("serve", f"{w} at {rate:g} {unit}: SLO attainment", value, "", base_at.get(rate),
                            higher_is_better=True, target=">= 0.9 counts for goodput"))
        tier = (engines.get("mmcache_tier") or {}).get(w)
        if tier:  # the host tier's side: matched share (cached over prompt tokens) without it against with it
            with_tier = attainment_by_rate(tier, "matched_share")
            for rate, value in attainment_by_rate(mine, "matched_share").items():
                rows.append(Row("serve", f"{w} at {rate:g} {unit}: matched share", value, "", with_tier.get(rate),
                                versus="mmcache_tier", higher_is_better=True))
        for engine, summary in (over.get(w) or {}).items():
            theirs = engines[engine][w]["goodput_rps"] or 0.0
            paired = summary["median"] if summary["repeats"] > 1 else None
            if engine == "mmcache_nocache":
                metric = f"goodput, {w} (90% within SLOs; 0: no rate)"
                target = ">= 3x cache off" if w in ("vlm_chat", "multi_turn") else ""
            else:
                metric = f"goodput, {w}, against {PEER_LABELS.get(engine, engine)}"
                target = ">= 1.5x the better vLLM" if w in ("vlm_chat", "multi_turn") else ">= vLLM"
                if engine == "mmcache_tier":
                    target = ""
            rows.append(Row("serve", metric + _spread(summary), mine["goodput_rps"] or 0.0, unit, theirs,
                            versus=engine if engine != "mmcache_nocache" else "cache off", higher_is_better=True,
                            paired=paired, target=target))
    return rows
