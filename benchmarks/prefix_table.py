"""The rows ``mmcache bench prefix`` adds to the comparison table: bit-exactness, the probe, the workloads."""

from __future__ import annotations

from .prefix_figures import WORKLOADS, better_by, middle_of, paired_probe, paired_workloads
from .table import Row


def paired_note(repeats: int) -> str:
    """What a paired row's metric adds when its "median" of per-repeat ratios is one ratio or the mean of two."""
    return f" (paired: {middle_of(repeats)})" if repeats in (1, 2) else ""


#: The preset and dtype the probe's targets are stated for (the Qwen2.5-0.5B shape in bfloat16).
TARGET_SHAPE = ("qwen2.5-0.5b", "bfloat16")


def target_shape_note(result: dict) -> str:
    """What the table adds to a probe target when this run measured another preset or dtype: the targets are
    stated for ``TARGET_SHAPE``, and a smaller model's fixed costs weigh more (the quick preset's repeated
    prompt reaches a lower ratio than the full one), so its figure is shown beside the target, not
    against it."""
    shape = (result.get("preset"), result.get("dtype"))
    return "" if shape == TARGET_SHAPE else f" (on {TARGET_SHAPE[0]} {TARGET_SHAPE[1]})"


def table_rows(result: dict) -> list[Row]:
    e = result["engines"]
    mm = e.get("mmcache")
    rows: list[Row] = [Row("prefix", "bit-exact (exact schedule, on vs off)", float(result["bit_exact"]),
                           target="1")]
    if mm is None:
        return rows
    rows += probe_rows(result)
    work_pairs = paired_workloads(e)
    for w in WORKLOADS:
        if w in mm:
            rows += workload_rows(w, e, work_pairs)
    return rows


def probe_rows(result: dict) -> list[Row]:
    """The probe's rows: hit and shared prefix against cold, then against cache off and each peer."""
    e = result["engines"]
    p = e["mmcache"]["probe"]
    # "better by" on the probe rows is the median of per-repeat ratios (see paired_probe, better_by); the
    # figures shown are each engine's medians.
    ours = paired_probe(e)["mmcache"]

    def peer(name: str, key: str) -> float:
        return better_by(ours[f"over_{name}"][key])

    pn = paired_note(len(p["repeats"]))
    on = target_shape_note(result)
    rows = [Row("prefix", f"probe: same 2048 prompt, TTFT{pn}", p["same_s"], "s", p["cold_s"], "cold",
                ">= 12x" + on, paired=ours["same_vs_cold"]["p50"]),
            Row("prefix", "probe: 1920 shared + 128 new, TTFT", p["shared1920_s"], "s", p["cold_s"], "cold")]
    off = e.get("mmcache_nocache")
    if off:
        rows.append(Row("prefix", f"probe: cold 2048, TTFT{pn}", p["cold_s"], "s", off["probe"]["cold_s"], "cache off",
                        "~1x (overhead)", paired=peer("mmcache_nocache", "cold")))
    tcb = e.get("transformers_cb")
    if tcb:
        rows.append(Row("prefix", f"probe: hit TTFT{pn}", p["same_s"], "s", tcb["probe"]["same_s"], "transformers CB",
                        ">= 3x" + on, paired=peer("transformers_cb", "hit")))
    vl = e.get("vllm_cpu")
    if vl:
        rows.append(Row("prefix", f"probe: cold TTFT{pn}", p["cold_s"], "s", vl["probe"]["cold_s"], "vLLM CPU",
                        ">= 0.77x" + on, paired=peer("vllm_cpu", "cold")))
        rows.append(Row("prefix", f"probe: hit TTFT{pn}", p["same_s"], "s", vl["probe"]["same_s"], "vLLM CPU",
                        ">= 0.77x" + on, paired=peer("vllm_cpu", "hit")))
    return rows


def workload_rows(w: str, e: dict, work_pairs: dict) -> list[Row]:
    """Workload ``w``'s rows: TTFT, ITL, throughput against cache off and peers; its matched share."""
    mm = e["mmcache"]

    def better(peer: str, label: str) -> float | None:
        """``workload_better_by`` of this workload."""
        return workload_better_by(work_pairs, peer, w, label)

    def note(peer: str, label: str) -> str:
        """``workload_note`` of this workload."""
        return workload_note(work_pairs, peer, w, label)

    rows = []
    for peer, label in (("mmcache_nocache", "cache off"), ("transformers_cb", "transformers CB"),
                        ("vllm_cpu", "vLLM CPU")):
        if peer in e and w in e[peer]:
            rows.append(Row("prefix", f"{w}: TTFT p50{note(peer, 'ttft_p50')}", mm[w]["ttft_p50_s"], "s",
                            e[peer][w]["ttft_p50_s"], label, paired=better(peer, "ttft_p50")))
    for peer, label in (("mmcache_nocache", "cache off"), ("vllm_cpu", "vLLM CPU")):  # the decode step
        if peer in e and w in e[peer] and None not in (mm[w].get("itl_p50_s"), e[peer][w].get("itl_p50_s")):
            rows.append(Row("prefix", f"{w}: ITL p50{note(peer, 'itl_p50')}", mm[w]["itl_p50_s"], "s",
                            e[peer][w]["itl_p50_s"], label, paired=better(peer, "itl_p50")))
    if "mmcache_nocache" in e and w in e["mmcache_nocache"]:
        rows.append(Row("prefix", f"{w}: output tokens/s{note('mmcache_nocache', 'throughput')}",
                        mm[w]["throughput_tok_s"], "tok/s", e["mmcache_nocache"][w]["throughput_tok_s"],
                        "cache off", higher_is_better=True, paired=better("mmcache_nocache", "throughput")))
    rows.append(Row("prefix", f"{w}: matched share", mm[w]["matched_share"]))
    return rows


def workload_better_by(work_pairs: dict, peer: str, w: str, label: str) -> float | None:
    """The paired "better by" of a workload figure (None with a single repeat: the ratio shown is it)."""
    ratio = work_pairs.get(f"over_{peer}", {}).get(w, {}).get(label)
    if ratio is None:
        return None
    return ratio["p50"] if label == "throughput" else better_by(ratio)


def workload_note(work_pairs: dict, peer: str, w: str, label: str) -> str:
    """``paired_note`` of the pairs that figure rests on (a repeat missing a figure on either side is not one)."""
    ratio = work_pairs.get(f"over_{peer}", {}).get(w, {}).get(label)
    return "" if ratio is None else paired_note(len(ratio["runs"]))
