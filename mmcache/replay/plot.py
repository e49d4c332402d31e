"""The sweep plot: realized share against pool size, one line per routing policy and storing setting, with
the ceiling for reference. Rendered with matplotlib's non-interactive Agg backend."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence


def policy_label(record: dict) -> str:
    if record["num_replicas"] == 1:
        return "R=1"
    return f"R={record['num_replicas']} {record['routing']}"


def can_plot() -> bool:
    """Whether matplotlib (the ``bench`` extra) is importable."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_sweep(records: Sequence[dict], path: str | Path, title: str = "") -> None:
    """Write the plot of ``records`` (sweep records of one workload and page size) to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    lines: dict = {}
    for rec in records:
        lines.setdefault((policy_label(rec), rec["store_at"]), []).append(rec)
    colors = {}
    for (label, store_at), recs in sorted(lines.items()):
        recs = sorted(recs, key=lambda r: r["pool_tokens"])
        color = colors.setdefault(label, f"C{len(colors)}")
        ax.plot([r["pool_tokens"] for r in recs], [100 * r["realized_share"] for r in recs], marker="o",
                color=color, linestyle="-" if store_at == "teardown" else "--",
                label=f"{label}, store at {store_at}")
    # A closed-loop workload's request set can change with the pool (a rejected turn ends its session),
    # and so can its ceiling: draw the ceiling per pool size.
    pools = sorted({r["pool_tokens"] for r in records})
    ceiling = [100 * max(r["ceiling_share"] for r in records if r["pool_tokens"] == p) for p in pools]
    ax.plot(pools, ceiling, color="0.4", linestyle=":", label="ceiling (unlimited pool)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(pools)
    ax.set_xticklabels([f"{p // 1024}k" if p < 2**20 else f"{p / 2**20:g}M" for p in pools])
    ax.set_xlabel("pool per replica (tokens)")
    ax.set_ylabel("realized share of prompt tokens (%)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
