"""The open-loop sweep of ``mmcache bench serve``: each workload on each engine at each request rate, through
one load generator (``benchmarks.loadgen``), SLOs from the cache-off engine's unloaded latency, and goodput.

Rules:

* An engine is a ``Target``: a base URL of an OpenAI-compatible server, the model name it serves, and a check
  run after every rate (the in-process engines: idle, nothing held, ``check_invariants`` clean; vLLM: none
  beyond its answers). Every engine gets the same sessions, the same arrival times (seed or trace) and the
  same ``cache_salt`` per rate, so each rate starts cold on every engine and none reuses another rate's pages.
* A workload's SLOs come from its unloaded run on the cache-off engine: its first sessions one at a time
  (``UNLOADED_SESSIONS``), after a warm-up request; TTFT SLO ``SLO_TTFT_TIMES`` x their p50 TTFT, TPOT SLO
  ``SLO_TPOT_TIMES`` x their p50 TPOT (their p50 TTFT when no answer has two tokens).
* Goodput is DistServe's: the highest swept rate at which at least ``THRESHOLD`` of the requests meet both SLOs
  (``loadgen.goodput``); a failed or timed-out request misses both. Attainment and goodput under TPOT SLOs of
  ``TPOT_TIMES_SEEN`` x the unloaded p50 are reported beside (same records, same TTFT SLO).
* The ladder's foot moves down for an engine that meets the SLOs at none of its rates: half the lowest rate is
  swept next, and so on while none is met and the rate stays at or above the floor, so that a goodput ratio is a
  number where the floor allows. The k-th rate swept on any engine has the k-th salt and arrival seed, so two
  engines that sweep the same rate in the same place get the same requests.
* Then rates near the line (``near_line_rates``): each factor of ``between`` (the bench's 0.75 and 1.5) times the
  goodput rate, where not swept already, so that goodput is not quantized to the ladder's doublings. Each row
  says how it came (``step``: ladder, foot or near line).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from mmcache.errors import MmcacheError

from . import loadgen

ENGINES = ("mmcache", "mmcache_nocache", "vllm_cpu", "vllm_cpu_tuned")
WORKLOADS = ("vlm_chat", "multi_turn", "shared_prefix", "mooncake")
THRESHOLD = 0.9
SLO_TTFT_TIMES, SLO_TPOT_TIMES = 5.0, 2.0
TPOT_TIMES_SEEN = (2.0, 3.0, 5.0)  # attainment and goodput also reported under these TPOT SLOs (TTFT SLO kept)
UNLOADED_SESSIONS = 4
UNLOADED_RATE = 1000.0  # with one session in flight at a time, the arrivals only set the order


@dataclass
class Target:
    """One engine as its clients see it."""

    engine: str
    base_url: str
    model: str
    after_rate: Callable[[], dict] = lambda: {}


@dataclass
class Workload:
    """A workload the sweep can send at any rate: ``make(options, count)`` gives ``count`` sessions whose
    requests carry ``options``; ``offsets(rate, count)`` their arrival offsets (None: Poisson at ``rate``);
    ``count(rate)`` how many sessions a rate sends."""

    name: str
    unit: str  # what the rate counts: "sessions/s" or "requests/s"
    make: Callable[[dict, int], list]
    count: Callable[[float], int]
    fields: dict  # sampling fields of every request (model and salt are added per engine and rate)
    offsets: Callable[[float, int], list | None] = lambda rate, count: None
    params: dict = field(default_factory=dict)


def progress(msg: str) -> None:
    print(f"[serve] {msg}", file=sys.stderr, flush=True)


def options(target: Target, work: Workload, salt: str) -> dict:
    extra = {"cache_salt": salt, "ignore_eos": True}
    return dict(work.fields, model=target.model, extra_body=extra)


def client(base_url: str):
    import openai

    return openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600.0)


async def warm_up(target: Target, work: Workload, seed: int) -> None:
    """One request of the workload's first session under its own salt: connection, first forward, allocator."""
    api = client(target.base_url)
    try:
        (session,) = work.make(options(target, work, f"serve-warm-{seed}"), 1)
        first = _first_turn(session)
        records = await loadgen.open_loop(lambda key: api, [first], UNLOADED_RATE, seed, 600.0)
    finally:
        await api.close()
    bad = [r for r in records if r.outcome != "ok"]
    if bad:
        raise SweepFailed(f"{target.engine} {work.name}: the warm-up request failed: {bad[0].status} {bad[0].error}")


def _first_turn(session):
    """``session`` cut to its first turn."""
    import copy

    one = copy.copy(session)
    one.turns = session.turns[:1]
    if getattr(session, "max_tokens", None) is not None:
        one.max_tokens = session.max_tokens[:1]
    return one


class SweepFailed(MmcacheError, RuntimeError):
    """A request the sweep needs (warm-up, unloaded) failed: its figures would mean nothing."""


async def unloaded(target: Target, work: Workload, seed: int, time_limit_s: float) -> dict:
    """The workload's first sessions one at a time on ``target``, and the SLOs they give."""
    await warm_up(target, work, seed)
    n = min(UNLOADED_SESSIONS, work.count(UNLOADED_RATE))
    api = client(target.base_url)
    try:
        sessions = work.make(options(target, work, f"serve-unloaded-{seed}"), n)
        records = await loadgen.open_loop(lambda key: api, sessions, UNLOADED_RATE, seed, time_limit_s,
                                          max_in_flight=1)
    finally:
        await api.close()
    s = loadgen.summarise(records)
    if s["outcomes"]["ok"] != len(records) or s["ttft_p50_s"] is None:
        raise SweepFailed(f"{target.engine} {work.name}: unloaded requests failed: {s['outcomes']} {s['statuses']}")
    tpot = s["tpot_p50_s"] if s["tpot_p50_s"] is not None else s["ttft_p50_s"]
    return {"ttft_s": SLO_TTFT_TIMES * s["ttft_p50_s"], "tpot_s": SLO_TPOT_TIMES * tpot,
            "rule": f"{SLO_TTFT_TIMES:g}x p50 TTFT and {SLO_TPOT_TIMES:g}x p50 TPOT of {target.engine} unloaded "
                    f"(its first {n} sessions one at a time)",
            "engine": target.engine, "unloaded_requests": len(records), "unloaded_ttft_p50_s": s["ttft_p50_s"],
            "unloaded_tpot_p50_s": s["tpot_p50_s"], "unloaded_e2e_p50_s": s["e2e_p50_s"],
            "unloaded_matched_share": s["matched_share"], "threshold": THRESHOLD}


async def sweep(target: Target, work: Workload, rates: list[float], slo: dict, seed: int, drain_s: float,
                floor: float | None = None, between: tuple[float, ...] = ()) -> dict:
    """Every rate on ``target``, then the foot moved down towards ``floor`` while none met the SLOs, then the
    rates ``between`` near the line (module docstring); per rate the figures and ``target.after_rate()``'s
    check, rows in rising rate; then the goodput."""
    rows = [await _one_rate(target, work, rate, slo, seed, i, drain_s, "ladder") for i, rate in enumerate(rates)]
    while floor is not None and loadgen.goodput(rows, THRESHOLD) is None:
        lower = min(r["rate"] for r in rows) / 2
        if lower < floor:
            break
        rows.append(await _one_rate(target, work, lower, slo, seed, len(rows), drain_s, "foot"))
    for rate in near_line_rates(rows, between):
        rows.append(await _one_rate(target, work, rate, slo, seed, len(rows), drain_s, "near line"))
    rows.sort(key=lambda r: r["rate"])
    by_times = {k: loadgen.goodput([{"rate": r["rate"], "attainment": r["attainment_by_tpot_times"][k]}
                                    for r in rows], THRESHOLD) for k in rows[0]["attainment_by_tpot_times"]}
    return {"unit": work.unit, "goodput_rps": loadgen.goodput(rows, THRESHOLD), "rates": rows,
            "goodput_by_tpot_times": by_times, "failed_requests": sum(r["failed"] for r in rows)}


def near_line_rates(rows: list[dict], between: tuple[float, ...]) -> list[float]:
    """The rates to sweep after ``rows`` (each with ``rate`` and ``attainment``): each factor of ``between`` times
    the goodput rate (the highest that met the SLOs), leaving out rates already swept (to a part in a million)
    and repeats; none when no rate met them."""
    good = loadgen.goodput(rows, THRESHOLD)
    if good is None:
        return []
    out: list[float] = []
    for factor in between:
        rate = factor * good
        if not any(math.isclose(rate, r, rel_tol=1e-6) for r in [row["rate"] for row in rows] + out):
            out.append(rate)
    return out


async def _one_rate(target: Target, work: Workload, rate: float, slo: dict, seed: int, k: int, drain_s: float,
                    step: str = "ladder") -> dict:
    """The ``k``-th rate swept: its sessions (salted by ``k``) at ``rate``, their figures and the check after."""
    n = work.count(rate)
    sessions = work.make(options(target, work, f"serve-{work.name}-{seed}-{k}"), n)
    offsets = work.offsets(rate, n)
    span = offsets[-1] if offsets else n / rate
    tell = _teller(target.engine, work.name, rate, work.unit)
    tell(0, n)
    api = client(target.base_url)
    try:
        records = await loadgen.open_loop(lambda key: api, sessions, rate, seed + k, span + drain_s,
                                          progress=tell, offsets=offsets)
    finally:
        await api.close()
    row = rate_row(rate, loadgen.summarise(records, slo["ttft_s"], slo["tpot_s"]))
    row["attainment_by_tpot_times"] = {f"{t:g}": attainment(records, slo, t) for t in TPOT_TIMES_SEEN}
    row["sessions"] = n
    row["step"] = step
    row["check"] = target.after_rate()
    return row


def attainment(records, slo: dict, tpot_times: float) -> float | None:
    """The attainment under the same TTFT SLO and a TPOT SLO of ``tpot_times`` x the unloaded p50 TPOT: how
    much the goodput hangs on the TPOT multiple, which queueing behind other requests' prefills moves most."""
    tpot = slo["tpot_s"] / SLO_TPOT_TIMES * tpot_times
    return loadgen.summarise(records, slo["ttft_s"], tpot)["attainment"]


def _teller(engine: str, workload: str, rate: float, unit: str):
    def tell(done: int, total: int) -> None:
        step = max(1, total // 4)
        if done == 0 or done == total or done % step == 0:
            progress(f"{engine} {workload} {rate:g} {unit}: {done}/{total} sessions done")
    return tell


def rate_row(rate: float, s: dict) -> dict:
    """One rate's figures in issue 44's shape (and more)."""
    keys = ("attainment", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_p50_s", "tpot_p90_s", "tpot_p99_s",
            "e2e_p50_s", "e2e_p90_s", "e2e_p99_s", "throughput_tok_s", "matched_share", "requests", "outcomes",
            "statuses", "prompt_tokens", "cached_tokens", "output_tokens", "span_s")
    row = {"rate": rate, **{k: s.get(k) for k in keys}}
    row["failed"] = s["outcomes"]["error"] + s["outcomes"]["timeout"]
    return row
