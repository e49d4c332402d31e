"""Playing the engines of ``mmcache bench prefix`` in turns, under one step budget.

Every engine is loaded and warmed up on unrelated tokens first (``warmup_workload``); then each probe repeat, and
then each repeat of each workload, is played by every engine in turn (``play_interleaved``), so that what one
engine is compared with was measured minutes, not a quarter of an hour, apart. The order changes from one play to
the next (``turn_order``, a Williams design): each engine plays in every position and right after every other
engine equally often, because the first request of a turn can pay for what the turn before left behind (on the
Intel AMX development machine a cold prefill that opened a turn right after vLLM's took 2.5-3% longer than the
same engine's second cold prefill of the turn, medians of 8 paired repeats); a plain rotation would put that cost
on the same engine every time.

Before each turn the driver idles ``TURN_SETTLE_S`` (0.3 s): Intel's OpenMP runtime, which vLLM preloads and the
``bench`` extra installs for mmcache and transformers, keeps a process's threads spinning for 200 ms after its
last parallel region (``KMP_BLOCKTIME``), so without the pause the engine whose turn has just ended shares the
cores with the first request of the next one (``benchmarks/RESULTS.md``).

Every engine schedules under the same limits, ``StepBudget``: mmcache's ``EngineConfig`` defaults for the tokens
one forward may hold and the sequences it may hold, given to transformers (``max_batch_tokens``,
``max_requests_per_batch``) and vLLM (``max_num_batched_tokens``, ``max_num_seqs``).

Invariant: engines run one at a time, never together (vLLM's process waits on its input while the others run).
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from . import text_workloads as tw
from .peers import protocol, vllm_cpu
from .peers.protocol import Record, Workload
from .prefix_figures import PROBE_KEYS, ProbeMethod, summarize_probe, summarize_repeats

if TYPE_CHECKING:
    from .prefix import Shape


#: Seconds the driver idles before each engine's turn: longer than Intel OpenMP's 200 ms of spinning threads.
TURN_SETTLE_S = 0.3


#: How ``play_interleaved`` orders the engines' turns, as the JSON records it (``turn_order``).
TURN_ORDER = "williams"

#: The warm-up's two short prompts and every warm-up request's output tokens (``warmup_workload``).
WARMUP_SHORT_LENS, WARMUP_NEW_TOKENS = (300, 364), 4


@dataclass(frozen=True)
class StepBudget:
    """What one forward of every engine may hold: ``max_tokens_per_step`` tokens (transformers'
    ``max_batch_tokens``, vLLM's ``max_num_batched_tokens``) of at most ``max_num_seqs`` sequences (transformers'
    ``max_requests_per_batch``). ``of_mmcache`` is the one source: mmcache's ``EngineConfig`` defaults."""

    max_tokens_per_step: int
    max_num_seqs: int

    @classmethod
    def of_mmcache(cls) -> "StepBudget":
        from mmcache.engine import EngineConfig

        c = EngineConfig()
        return cls(c.max_tokens_per_step, c.max_num_seqs)


@dataclass
class EngineResult:
    probe: dict
    workloads: dict
    outputs: dict  # request id -> output ids, for agreement between engines
    meta: dict


def probe_workloads(space: tw.TokenSpace, shape: Shape, seed: int, method: ProbeMethod) -> list[Workload]:
    return [tw.probe(space, seed * 1000 + rep, shape.probe_len, shape.probe_shared, method.max_tokens)
            for rep in range(shape.probe_repeats)]


def engine_result(probes, results: dict, meta, method: ProbeMethod = ProbeMethod()) -> EngineResult:
    """``results`` maps a workload's name to its repeats, each a list of rounds."""
    played = [rounds for repeats in results.values() for rounds in repeats]
    outputs = {rec.id: rec.output_ids for rounds in probes + played for rnd in rounds for rec in rnd.records}
    return EngineResult(summarize_probe(probes, method), {w: summarize_repeats(r) for w, r in results.items()},
                        outputs, meta)


class MmcacheRunner:
    """mmcache's engine as a round runner: one ``generate`` call per round, per-request sampling."""

    def __init__(self, model_dir: str, dtype: str, cache_mode: str, page_size: int, num_pages: int, **kw):
        from mmcache.engine import Engine, EngineConfig

        self.config = EngineConfig(page_size=page_size, cache_mode=cache_mode, num_pages=num_pages, **kw)
        self.engine = Engine.from_pretrained(model_dir, dtype=dtype, config=self.config)

    def run_round(self, ids, prompts, max_tokens) -> list[Record]:
        from mmcache.engine import Request, SamplingParams

        reqs = [Request(list(p), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), request_id=rid)
                for rid, p, n in zip(ids, prompts, max_tokens)]
        outs = self.engine.generate(reqs)
        records = []
        for o in outs:
            if o.error is not None:
                raise o.error
            records.append(Record(o.request_id, o.prompt_len, list(o.output_ids), o.arrival_time,
                                  o.first_token_time, list(o.token_times), o.matched_tokens))
        return records

    def close(self) -> None:
        self.engine.check_invariants()  # a run that leaked or double-owned a page is not a result


def _settle(seconds: float) -> None:
    time.sleep(seconds)


def turn_order(names: list[str], k: int) -> list[str]:
    """The order of play ``k``: row ``k`` of a Williams design over ``names`` (a Latin square whose rows, for an
    odd count followed by their reverses, put every engine right after every other engine equally often and in
    every position equally often; period ``n`` for an even count ``n``, ``2 n`` for an odd one; no names, no
    order). A plain rotation keeps each engine's predecessor fixed, so whatever a turn leaves behind for the next
    one (the module docstring) would land on the same engine every time."""
    n = len(names)
    if n == 0:
        return []
    base, low, high = [0], 1, n - 1  # 0, 1, n-1, 2, n-2, ...
    while len(base) < n:
        base.append(low)
        low += 1
        if len(base) < n:
            base.append(high)
            high -= 1
    row = [names[(i + k) % n] for i in base]
    return row[::-1] if n % 2 and (k // n) % 2 else row


@dataclass
class Player:
    """One engine of the run: ``play(workload)`` returns its rounds; ``close`` ends it (checking what it checks)."""

    name: str
    play: object
    close: object
    meta: dict
    method: ProbeMethod = ProbeMethod()
    final_meta: object = None  # called before close: figures known only at the end (engine metrics)


def in_process_player(name: str, runner, load_s: float, method: ProbeMethod = ProbeMethod()) -> Player:
    meta = {"load_s": load_s, "settings": getattr(runner, "settings", None) or _config_dict(runner)}
    engine = getattr(runner, "engine", None)
    if hasattr(engine, "backend"):  # mmcache's engines: the compute path, and why the linears were not packed
        meta.update(backend=engine.backend, packing_skipped=engine.packing_skipped,
                    row_products_skipped=engine.row_products_skipped)

    def final() -> dict:
        if hasattr(runner, "engine") and hasattr(runner.engine, "metrics"):
            return {"engine_metrics": _jsonable(runner.engine.metrics())}
        return {}

    return Player(name, lambda w: protocol.play(w, runner.run_round), runner.close, meta, method, final)


def vllm_player(model_dir, space, shape, workloads: list[Workload], seed, args, workdir,
                budget: StepBudget) -> Player:
    """vLLM's server, with a context long enough for every request and session, under ``budget`` (vLLM V1 chunks
    a prefill longer than its step budget, so a budget below the context is accepted)."""
    probes = probe_workloads(space, shape, seed, ProbeMethod())
    longest = max(len(r.tokens) + r.max_tokens for w in workloads + probes for rnd in w.rounds for r in rnd)
    history = max([session_len(w) for w in workloads] + [0])
    max_len = 1024 * -(-max(longest, history, 8192) // 1024)
    server = vllm_cpu.VllmServer(model_dir, warmup_workload(space, seed, shape.probe_len), workdir,
                                 dtype=args.dtype, block_size=args.page_size, max_model_len=max_len,
                                 max_num_batched_tokens=budget.max_tokens_per_step,
                                 max_num_seqs=budget.max_num_seqs, eager=args.vllm_eager)
    meta = {"version": server.version, "init_s": server.init_s, "settings": server.settings}
    return Player("vllm_cpu", server.play, server.close, meta)


def play_interleaved(players: list[Player], space: tw.TokenSpace, shape: Shape, repeats: list[list[Workload]],
                     seed: int, settle_s: float = TURN_SETTLE_S) -> dict[str, EngineResult]:
    """Every probe repeat, then every repeat of every workload (``workload_repeats``: repeat 1 of each, then
    repeat 2, ...), played by each engine in turn, in ``turn_order`` (its next row for every play), each turn
    after ``settle_s`` of idling (see the module docstring)."""
    names = [p.name for p in players]
    by_name = {p.name: p for p in players}
    for p in players:
        if p.name != "vllm_cpu":  # vLLM's server warmed up before it answered
            p.play(warmup_workload(space, seed, shape.probe_len))
    probe_sets = {p.name: probe_workloads(space, shape, seed, p.method) for p in players}
    probes: dict[str, list] = {n: [] for n in names}
    for rep in range(shape.probe_repeats):
        for name in turn_order(names, rep):
            _settle(settle_s)
            probes[name].append(by_name[name].play(probe_sets[name][rep]))
            progress(f"{name}: probe repeat {rep + 1}/{shape.probe_repeats}: "
                      + ", ".join(f"{k} {r.wall_s:.3f}" for k, r in zip(PROBE_KEYS, probes[name][-1])))
    results: dict[str, dict] = {n: {} for n in names}
    turn = 0
    for rep, workloads in enumerate(repeats):
        for w in workloads:
            for name in turn_order(names, turn):
                _settle(settle_s)
                rounds = by_name[name].play(w)
                results[name].setdefault(w.name, []).append(rounds)
                progress(f"{name}: {w.name} repeat {rep + 1}/{len(repeats)}: {sum(r.wall_s for r in rounds):.2f} s")
            turn += 1
    out = {}
    for p in players:
        meta = dict(p.meta, **(p.final_meta() if p.final_meta else {}))
        out[p.name] = engine_result(probes[p.name], results[p.name], meta, p.method)
    return out


def warmup_workload(space: tw.TokenSpace, seed: int, prompt_len: int) -> Workload:
    """A probe-sized prompt alone, then two short prompts together, on tokens no workload uses, so kernels,
    allocators and compiled graphs are warm for both shapes before anything is timed."""
    rng = tw.random.Random(f"warmup:{seed}")
    reqs = [protocol.Request(f"warmup{seed}-{i}", space.draw(rng, n), WARMUP_NEW_TOKENS)
            for i, n in enumerate((prompt_len,) + WARMUP_SHORT_LENS)]
    return Workload("warmup", ((reqs[0],), (reqs[1], reqs[2])))


def session_len(w: Workload) -> int:
    total: dict[str, int] = {}
    for rnd in w.rounds:
        for r in rnd:
            if r.session:
                total[r.session] = total.get(r.session, 0) + len(r.tokens) + r.max_tokens
    return max(total.values(), default=0)


def _config_dict(runner) -> dict | None:
    config = getattr(runner, "config", None)
    return asdict(config) if config is not None else None


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (int, float, str, bool)) or x is None:
        return x
    if hasattr(x, "as_dict"):
        return _jsonable(x.as_dict())
    return repr(x)


def progress(msg: str) -> None:
    print(f"[prefix] {msg}", file=sys.stderr, flush=True)
