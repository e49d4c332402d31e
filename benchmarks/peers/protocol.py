"""Workloads as rounds of token-id requests, the driver that plays them, and their JSON form.

Every engine in the prefix benchmark (mmcache, transformers, vLLM in its own interpreter) is driven by
``play``, so every engine sees the same prompts in the same order and is timed the same way. Standard library
only: the vLLM runner imports this module from an interpreter that has neither mmcache nor its dependencies.

Invariants:

* A round is submitted to the engine as one batch; the next round starts after every request of the round
  finished. Requests of one round arrive together, so the time to first token includes queueing behind the
  others in the round.
* A request with a ``session`` extends that session's history: its prompt is the session's previous prompt,
  then that prompt's output ids, then the request's own ``tokens``. Without a session the prompt is ``tokens``.
* Times in a ``Record`` are ``time.perf_counter`` stamps of the process that ran the engine; only differences
  between stamps of one record (or one round) are meaningful.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence


class WorkloadFormatError(ValueError):
    """A workload (or a runner's answer) does not have the shape this module defines."""


@dataclass(frozen=True)
class Request:
    id: str
    tokens: tuple[int, ...]  # the whole prompt, or what this turn appends to its session's history
    max_tokens: int
    session: str | None = None

    def __post_init__(self):
        if not self.tokens:
            raise WorkloadFormatError(f"request {self.id!r}: no prompt tokens")
        if self.max_tokens < 1:
            raise WorkloadFormatError(f"request {self.id!r}: max_tokens must be at least 1, got {self.max_tokens}")


@dataclass(frozen=True)
class Workload:
    name: str
    rounds: tuple[tuple[Request, ...], ...]
    params: dict = field(default_factory=dict)  # the shape parameters it was generated with, for the report

    def __post_init__(self):
        ids = [r.id for rnd in self.rounds for r in rnd]
        if len(set(ids)) != len(ids):
            raise WorkloadFormatError(f"workload {self.name!r}: request ids repeat")
        if any(not rnd for rnd in self.rounds):
            raise WorkloadFormatError(f"workload {self.name!r}: empty round")

    @property
    def num_requests(self) -> int:
        return sum(len(rnd) for rnd in self.rounds)


@dataclass
class Record:
    """One finished request as the engine reported it."""

    id: str
    prompt_len: int
    output_ids: list[int]
    arrival: float  # perf_counter when the request was handed to the engine
    first_token: float  # perf_counter when its first output token was available
    token_times: list[float]  # perf_counter of every output token, the first included
    matched_tokens: int  # prompt tokens served from a prefix cache (0 when the engine has none)

    @property
    def ttft_s(self) -> float:
        return self.first_token - self.arrival

    @property
    def itls_s(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


@dataclass
class RoundResult:
    records: list[Record]
    wall_s: float  # from handing the round to the engine until its last request finished


# run_round(request ids, prompts, max_tokens) -> one Record per request, in the order given
RunRound = Callable[[Sequence[str], Sequence[list[int]], Sequence[int]], list[Record]]


def play(workload: Workload, run_round: RunRound) -> list[RoundResult]:
    """Runs every round of ``workload`` through ``run_round``, building session prompts from earlier outputs."""
    history: dict[str, list[int]] = {}
    results = []
    for rnd in workload.rounds:
        sessions = [r.session for r in rnd if r.session is not None]
        if len(set(sessions)) != len(sessions):
            raise WorkloadFormatError(f"workload {workload.name!r}: a session appears twice in one round")
        prompts = [history.get(r.session, []) + list(r.tokens) if r.session else list(r.tokens) for r in rnd]
        t0 = time.perf_counter()
        records = run_round([r.id for r in rnd], prompts, [r.max_tokens for r in rnd])
        wall = time.perf_counter() - t0
        if [rec.id for rec in records] != [r.id for r in rnd]:
            raise WorkloadFormatError(f"workload {workload.name!r}: the engine answered other requests than asked")
        for r, prompt, rec in zip(rnd, prompts, records):
            if len(rec.output_ids) != r.max_tokens:
                raise WorkloadFormatError(f"request {r.id!r}: {len(rec.output_ids)} output ids, asked {r.max_tokens}")
            if r.session:
                history[r.session] = prompt + list(rec.output_ids)
        results.append(RoundResult(records, wall))
    return results


def workload_to_json(w: Workload) -> dict:
    return {"name": w.name, "params": w.params,
            "rounds": [[{"id": r.id, "tokens": list(r.tokens), "max_tokens": r.max_tokens, "session": r.session}
                        for r in rnd] for rnd in w.rounds]}


def workload_from_json(d: dict) -> Workload:
    try:
        rounds = tuple(tuple(Request(str(r["id"]), tuple(int(t) for t in r["tokens"]), int(r["max_tokens"]),
                                     r.get("session")) for r in rnd) for rnd in d["rounds"])
        return Workload(str(d["name"]), rounds, dict(d.get("params", {})))
    except (KeyError, TypeError) as e:
        raise WorkloadFormatError(f"malformed workload: {e!r}") from e


def results_to_json(results: list[RoundResult]) -> list[dict]:
    return [{"wall_s": r.wall_s, "records": [asdict(rec) for rec in r.records]} for r in results]


def results_from_json(rows: list[dict]) -> list[RoundResult]:
    try:
        return [RoundResult([Record(**rec) for rec in row["records"]], float(row["wall_s"])) for row in rows]
    except (KeyError, TypeError) as e:
        raise WorkloadFormatError(f"malformed runner answer: {e!r}") from e


def dump(obj, path: str) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)


def load(path: str):
    with open(path) as f:
        return json.load(f)
