"""The comparison table printed by ``mmcache bench``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    bench: str
    metric: str
    value: float
    unit: str = ""
    baseline: float | None = None  # the same metric without mmcache (cache off, or a peer named in `versus`)
    versus: str = "cache off"
    target: str = ""
    higher_is_better: bool = False  # throughputs; times and bytes are better lower
    paired: float | None = None  # "better by" measured pair by pair (median of per-repeat ratios), if given

    @property
    def ratio(self) -> float | None:
        """How many times better mmcache is than the baseline (above 1: better): ``paired`` where given, else
        the ratio of the two figures shown."""
        if self.paired is not None:
            return self.paired
        if self.baseline is None or not self.value or not self.baseline:
            return None
        return self.value / self.baseline if self.higher_is_better else self.baseline / self.value


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if x == 0:
            return "0"
        if abs(x) >= 1000:
            return f"{x:,.0f}"
        if abs(x) >= 1:
            return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"
        return f"{x:.3g}"
    return str(x)


def render(rows: list[Row]) -> str:
    """Fixed-width table: bench, metric, mmcache, baseline, how many times better mmcache is, target. A ratio
    marked ``paired`` is the median of ratios taken pair by pair, not the ratio of the two figures shown."""
    header = ("bench", "metric", "mmcache", "baseline", "versus", "mmcache better by", "target")
    body = [(r.bench, r.metric, f"{_fmt(r.value)} {r.unit}".strip(),
             "-" if r.baseline is None else f"{_fmt(r.baseline)} {r.unit}".strip(),
             r.versus if r.baseline is not None else "-",
             "-" if r.ratio is None else f"{r.ratio:.2f}x" + (" paired" if r.paired is not None else ""),
             r.target) for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
    out = [line(header), line(["-" * w for w in widths])]
    out += [line(b) for b in body]
    return "\n".join(out)
