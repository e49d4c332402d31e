"""The figures of ``mmcache bench prefix``, from the rounds every engine played (``peers.protocol``).

The probe (cold / same / 1920 shared + 128 new / another cold; one request at a time; each repeat on fresh
tokens): every engine's figure is the same span, ``probe_figure``: the wall time of ``protocol.play``'s round
(building the request, generating, tearing down, building the record) less the time between the request's first
and last token stamps. The request asks for one token, so that is the round's wall time and the time to first
token; transformers' asks for two (``ProbeMethod``), and the decode step of its second token is what is left out.

Per workload: the time to first token (p50, p90; first token stamp minus arrival stamp), inter-token latency p50,
output tokens per second over the workload's wall time, and the share of prompt tokens served from a prefix cache.
A workload's figures pool its repeats (``summarize_repeats``).

Pairs: mmcache against another engine is the median of per-repeat ratios (``paired_probe``, ``paired_workloads``),
never a ratio of medians, since the engines of one repeat played minutes apart at most while the machine's speed
drifts between minutes; for a time, "better by" is the median of peer over mmcache (``better_by``). The median of
two values is their mean, and the JSON and the table say so (``middle_of``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from .peers.protocol import RoundResult

WORKLOADS = ("vllm_prefix_caching", "generated_shared_prefix", "multi_turn")
PROBE_KEYS = ("cold_s", "same_s", "shared1920_s", "cold2_s")


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize_repeats(repeats: list[list[RoundResult]]) -> dict:
    """One workload's figures over all its repeats pooled (every request's TTFT, every ITL, the summed wall
    time), and, with more than one repeat, each repeat's own figures under ``by_repeat`` for pairing."""
    if len(repeats) == 1:
        return summarize(repeats[0])
    out = summarize([rnd for rounds in repeats for rnd in rounds])
    out.pop("ttft_p50_s_by_round", None)  # rounds of different repeats; each repeat keeps its own
    out["by_repeat"] = [summarize(rounds) for rounds in repeats]
    return out


def summarize(rounds: list[RoundResult]) -> dict:
    recs = [r for rnd in rounds for r in rnd.records]
    ttft = [r.ttft_s for r in recs]
    itl = [x for r in recs for x in r.itls_s]
    wall = sum(rnd.wall_s for rnd in rounds)
    prompt_tokens = sum(r.prompt_len for r in recs)
    output_tokens = sum(len(r.output_ids) for r in recs)
    matched = sum(r.matched_tokens for r in recs)
    out = {"ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90), "itl_p50_s": percentile(itl, 50),
           "throughput_tok_s": output_tokens / wall, "matched_share": matched / prompt_tokens,
           "requests": len(recs), "prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "wall_s": wall}
    if len(rounds) > 1:
        out["ttft_p50_s_by_round"] = [percentile([r.ttft_s for r in rnd.records], 50) for rnd in rounds]
    return out


def middle_of(n: int) -> str:
    """What ``statistics.median`` of ``n`` values is, in words: of two values it is their mean, and says so."""
    return "the single value" if n == 1 else "mean of 2" if n == 2 else f"median of {n}"


@dataclass(frozen=True)
class ProbeMethod:
    """How many tokens an engine's probe request asks for: one, so the round ends at the first token.
    transformers publishes a request's blocks only while it is still running, so a one-token request never
    leaves a prefix to hit: it gets two. The figure is the same span for every engine (``probe_figure``)."""

    max_tokens: int = 1

    def describe(self, repeats: int) -> str:
        return (f"wall time of a round of one {self.max_tokens}-token request run alone, less the time from its "
                f"first to its last token stamp (= time to first token), {middle_of(repeats)}")


def probe_figure(rnd: RoundResult) -> float:
    """The probe figure of every engine: the round's wall time (``protocol.play``'s span, from building the
    request to its record) less the time between its one request's first and last token stamps. For a one-token
    request that is the wall time itself; for transformers' two-token request it leaves out the second token's
    decode step. Whatever else the engine does between those two stamps is left out with it, so the figure can
    only flatter that engine, never the one it is compared with."""
    rec = rnd.records[0]
    return rnd.wall_s - (rec.token_times[-1] - rec.token_times[0])


def summarize_probe(repeats: list[list[RoundResult]], method: ProbeMethod = ProbeMethod()) -> dict:
    """Per repeat, every engine's figure (``probe_figure``) and, beside it, the round's wall time, the engine's
    own first-token stamp minus its arrival stamp, and the prompt tokens it matched; the median of the figures."""
    rows = []
    for rounds in repeats:
        row = {}
        for key, rnd in zip(PROBE_KEYS, rounds):
            rec = rnd.records[0]
            row[key] = probe_figure(rnd)
            row[key.replace("_s", "_wall_s")] = rnd.wall_s
            row[key.replace("_s", "_ttft_s")] = rec.ttft_s
            row[key.replace("_s", "_matched")] = rec.matched_tokens
        rows.append(row)
    out = {k: statistics.median(r[k] for r in rows) for k in PROBE_KEYS}
    out["repeats"] = rows
    out["figure"] = method.describe(len(rows))
    return out


def ratio_stat(xs: list[float]) -> dict:
    """Per-repeat ratios, their median (``p50``; of two, their mean, which ``statistic`` says) and range."""
    return {"p50": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs, "statistic": middle_of(len(xs))}


def better_by(ratio: dict) -> float:
    """How many times faster mmcache is on a time, from its per-repeat ratios of mmcache over the peer
    (``ratio_stat``): the median of peer over mmcache, repeat by repeat. Not the inverse of the median of
    mmcache over peer, which differs from it wherever the median is a mean (an even count of repeats)."""
    return statistics.median(1.0 / r for r in ratio["runs"])


def paired_probe(engines: dict) -> dict:
    """Probe ratios taken repeat by repeat, then the median: each repeat's figures of all engines were measured
    within a minute of each other (``play_interleaved``), while this machine's speed drifts between minutes, so a
    ratio of two engines' medians mixes minutes and a median of per-repeat ratios does not.

    ``engines`` maps an engine name to its JSON entry (with ``probe.repeats``). Returns, per engine,
    ``same_vs_cold`` (cold over same, per repeat) and, for every other engine, ``over_<peer>``: mmcache's cold
    and hit (same) figures over the peer's, per repeat, with their median and range (``ratio_stat``)."""
    out = {}
    for name, e in engines.items():
        reps = e["probe"]["repeats"]
        out[name] = {"same_vs_cold": ratio_stat([r["cold_s"] / r["same_s"] for r in reps])}
    mm = engines.get("mmcache")
    if mm is not None:
        for name, e in engines.items():
            if name == "mmcache":
                continue
            pairs = list(zip(mm["probe"]["repeats"], e["probe"]["repeats"]))
            out["mmcache"][f"over_{name}"] = {
                "cold": ratio_stat([a["cold_s"] / b["cold_s"] for a, b in pairs]),
                "hit": ratio_stat([a["same_s"] / b["same_s"] for a, b in pairs])}
    return out


WORKLOAD_RATIOS = (("ttft_p50", "ttft_p50_s"), ("itl_p50", "itl_p50_s"), ("throughput", "throughput_tok_s"))


def paired_workloads(engines: dict) -> dict:
    """mmcache's workload figures over every other engine's, repeat by repeat (each repeat's engines played one
    after the other, minutes apart at most), then the median, as ``paired_probe`` does for the probe.

    Returns ``{"over_<peer>": {workload: {"ttft_p50" | "itl_p50" | "throughput": {"p50", "min", "max",
    "runs", "statistic"}}}}`` for the workloads both engines played with at least two repeats; a figure missing
    or zero in either engine's repeat (no ITL where every request asked for one token) is left out of that
    repeat. Times: below 1 means mmcache is faster (the table's "better by" is ``better_by``); throughput: above
    1 means mmcache is faster."""
    out: dict = {}
    mm = engines.get("mmcache")
    if mm is None:
        return out
    for name, e in engines.items():
        if name == "mmcache":
            continue
        per = {}
        for w in WORKLOADS:
            a, b = mm.get(w, {}).get("by_repeat"), e.get(w, {}).get("by_repeat")
            if not a or not b:
                continue
            figures = {}
            for label, key in WORKLOAD_RATIOS:
                runs = [x[key] / y[key] for x, y in zip(a, b) if x.get(key) and y.get(key)]
                if runs:
                    figures[label] = ratio_stat(runs)
            if figures:
                per[w] = figures
        out[f"over_{name}"] = per
    return out
