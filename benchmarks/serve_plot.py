"""The plot of ``mmcache bench serve --plot PATH``: one column per workload; on top SLO attainment against
request rate per engine (the goodput threshold drawn across), below TTFT p50 (solid), p90 (dashed) and p99
(dotted) against rate per engine, on a log scale; rates on a log-2 axis, as the ladder doubles. One line per
engine and open-loop repeat, in the engine's colour (a legend entry for the first repeat only, with the median
goodput). Drawn with matplotlib's Agg backend (no display); rates or percentiles that are None are left out of a
line."""

from __future__ import annotations

from .serve_sweep import ENGINES, THRESHOLD, WORKLOADS

COLOURS = {"mmcache": "tab:blue", "mmcache_nocache": "tab:orange", "vllm_cpu": "tab:green",
           "vllm_cpu_tuned": "tab:red"}
STYLES = {"ttft_p50_s": "-", "ttft_p90_s": "--", "ttft_p99_s": ":"}


def plot(result: dict, path: str) -> None:
    """Write the PNG of ``result`` (``{"slo", "engines"}`` as ``run`` returns) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = result["engines"]
    workloads = [w for w in WORKLOADS if any(w in per for per in engines.values())]
    if not workloads:
        raise ValueError("nothing to plot: no engine measured a workload")
    fig, axes = plt.subplots(2, len(workloads), figsize=(4.2 * len(workloads), 7.0), squeeze=False)
    for col, w in enumerate(workloads):
        _column(axes[0][col], axes[1][col], w, engines, result.get("slo", {}).get(w))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _column(top, bottom, w: str, engines: dict, slo: dict | None) -> None:
    """Workload ``w``'s column: attainment on ``top``, TTFT percentiles on ``bottom``, SLOs if known."""
    unit = ""
    for engine in ENGINES:
        figures = engines.get(engine, {}).get(w)
        if not figures:
            continue
        unit = figures.get("unit", unit)
        for k, rows in enumerate(by_repeat(figures["rates"])):
            named = k == 0
            _line(top, rows, "attainment", engine, "-o",
                  f"{engine} (goodput {figures['goodput_rps']})" if named else None)
            for key, style in STYLES.items():
                _line(bottom, rows, key, engine, style + "o", f"{engine} {key[5:8]}" if named else None)
    top.axhline(THRESHOLD, color="grey", linewidth=0.8)
    top.set_title(w if slo is None else f"{w}\nSLO TTFT {slo['ttft_s']:.3g} s, TPOT {slo['tpot_s']:.3g} s",
                  fontsize=9)
    top.set_ylim(-0.05, 1.05)
    top.set_ylabel("SLO attainment")
    top.legend(fontsize=7)
    if slo is not None:
        bottom.axhline(slo["ttft_s"], color="grey", linewidth=0.8)
    for ax in (top, bottom):
        ax.set_xscale("log", base=2)
    bottom.set_yscale("log")
    bottom.set_ylabel("TTFT (s)")
    bottom.set_xlabel(f"rate ({unit})")
    bottom.legend(fontsize=6)


def by_repeat(rows: list[dict]) -> list[list[dict]]:
    """``rows`` split by their ``repeat`` (rows without one are repeat 0), each in rising rate."""
    out: dict[int, list[dict]] = {}
    for row in rows:
        out.setdefault(row.get("repeat", 0), []).append(row)
    return [sorted(out[k], key=lambda r: r["rate"]) for k in sorted(out)]


def _line(ax, rates: list[dict], key: str, engine: str, style: str, label: str | None) -> None:
    points = [(r["rate"], r[key]) for r in rates if r.get(key) is not None]
    if points:
        xs, ys = zip(*points)
        ax.plot(xs, ys, style, color=COLOURS.get(engine), label=label, markersize=4)
