"""The text workloads of ``mmcache bench serve``, as token-id sessions for ``/v1/completions``.

* ``multi_turn``: vLLM's multi-turn generator shape (``benchmarks.text_workloads.multi_turn`` on the
  configuration in ``datasets/traces``), every length scaled by ``scale`` so that a CPU can serve it; each
  conversation is one session whose turns extend the previous prompt and the model's own answer.
* ``shared_prefix``: SGLang's generated-shared-prefix shape (``text_workloads.generated_shared_prefix``): a few
  random system prompts, questions behind each, shuffled; every request its own one-turn session.
* ``mooncake``: a slice of the Mooncake conversation trace (``mmcache.replay.mooncake`` parses and checks it).
  Each hash id names one fixed run of ``block_tokens`` token ids (the same id, the same run, in every process),
  so two requests sharing the first i ids share their first i runs, as the trace promises; a request's
  prompt is its blocks' runs, the last cut in the trace's proportion (``input_length`` over 512-token blocks).
  Arrivals keep the trace's own times, scaled so that the slice arrives at the asked mean rate.
* ``hot_prefix`` (``mmcache bench serve --replicas`` only): a skew where most sessions (``hot_share``) open with
  one long system prompt and the rest with a system prompt of their own, each session then multi-turn, so that
  affinity routing meets one hot prefix and also has each chat's own turns to keep together.
* ``agent`` (opt-in: ``--workloads agent``): the repository's agent sessions (``mmcache.replay.sessions`` on
  ``datasets/sessions/agent_sessions.json``, its seed replaced by the run's), every length scaled by ``scale`` as
  ``multi_turn``'s, turns cut to ``max_turns``. A session's first turn is its system prompt and task, each later
  turn the previous tool result; the model's own answer stands where the generator's output stood. Each later
  turn waits the generator's tool latency after the previous answer ended (``TokenSession.waits_s``: the
  closed-loop rule, as ``mmcache replay`` replays sessions).

Invariants: the same arguments give the same sessions (seeded ``random.Random`` and hash-keyed streams, no
global state); every token id lies in the given ``TokenSpace``; a session's per-turn ``max_tokens`` is at least 1;
a wait is finite and non-negative.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import text_workloads as tw
from .loadgen import TokenSession
from .text_workloads import TokenSpace, WorkloadShapeError

MOONCAKE_TRACE = Path(__file__).resolve().parents[1] / "datasets" / "traces" / "conversation_trace.jsonl"
TRACE_BLOCK = 512  # the trace's own block size: len(hash_ids) == ceil(input_length / 512)
TEXT_WORKLOADS = ("multi_turn", "shared_prefix", "mooncake", "agent")
OPT_IN_WORKLOADS = ("agent",)  # named in --workloads only: not in the default run
REPLICA_WORKLOADS = ("hot_prefix",)  # served only through replicas (``benchmarks.serve_replicas``)


@dataclass(frozen=True)
class Plan:
    """One text workload: its sessions (each a list of turns' token ids and per-turn answer lengths), and for a
    trace its arrival times at its own pace (``times_s``; None: Poisson arrivals at the asked rate)."""

    name: str
    turns: list[list[list[int]]]
    max_tokens: list[list[int]]
    times_s: list[float] | None = None
    unit: str = "requests"  # what a rate counts per second: "sessions" or "requests"
    params: dict = field(default_factory=dict)
    waits_s: list[list[float]] | None = None  # per session, per turn: the pause after the previous answer

    def sessions(self, options: dict, count: int | None = None) -> list[TokenSession]:
        """The first ``count`` sessions (all when None; the list again, in order, beyond its length) with
        ``options`` (model, salt, sampling ...) on every request."""
        n = len(self.turns) if count is None else count
        waits = lambda j: None if self.waits_s is None else list(self.waits_s[j])
        return [TokenSession([list(t) for t in self.turns[i % len(self.turns)]], dict(options),
                             max_tokens=list(self.max_tokens[i % len(self.turns)]),
                             waits_s=waits(i % len(self.turns))) for i in range(n)]

    def offsets(self, rate: float, count: int) -> list[float] | None:
        """Arrival offsets of the first ``count`` sessions at mean ``rate`` per second (None for Poisson)."""
        return None if self.times_s is None else trace_offsets(self.times_s[:count], rate)


def scaled(dist: tw.Distribution, factor: float) -> tw.Distribution:
    """``dist`` with every length multiplied by ``factor`` (at least 1 where it was at least 1)."""
    grow = lambda x: max(1, round(x * factor)) if x else x
    # a lognormal given by mu and sigma scales by shifting mu: exp(mu + log f + sigma z) = f exp(mu + sigma z)
    mu = dist.mu + math.log(factor) if dist.kind == "lognormal" and not dist.average else dist.mu
    return dataclasses.replace(dist, value=grow(dist.value), low=grow(dist.low), high=grow(dist.high),
                               average=dist.average * factor if dist.average else 0.0, mu=mu,
                               cap=grow(dist.cap) if dist.cap else dist.cap)


def multi_turn(space: TokenSpace, seed: int, conversations: int, max_turns: int, scale: float,
               max_answer: int) -> Plan:
    """vLLM's multi-turn shape, lengths times ``scale`` (the number of turns is not scaled, only capped)."""
    if not 0 < scale <= 1:
        raise WorkloadShapeError(f"multi_turn: scale must lie in (0, 1], got {scale}")
    shape = tw.MultiTurnShape.load()
    shape = dataclasses.replace(shape, common_prefix=scaled(shape.common_prefix, scale),
                                conversation_prefix=scaled(shape.conversation_prefix, scale),
                                user_tokens=scaled(shape.user_tokens, scale),
                                answer_tokens=scaled(shape.answer_tokens, scale))
    w = tw.multi_turn(shape, space, seed, conversations, max_turns, max_answer)
    by_session: dict[str, list] = {}
    for rnd in w.rounds:
        for r in rnd:
            by_session.setdefault(r.session, []).append(r)
    turns = [[list(r.tokens) for r in reqs] for reqs in by_session.values()]
    answers = [[r.max_tokens for r in reqs] for reqs in by_session.values()]
    params = dict(w.params, scale=scale, source="datasets/traces/vllm_generate_multi_turn.json",
                  submitted="open loop: sessions at the arrivals, each turn once the previous answer ended")
    return Plan("multi_turn", turns, answers, unit="sessions", params=params)


def agent(space: TokenSpace, seed: int, sessions: int, max_turns: int, scale: float, max_answer: int,
          path: Path | None = None) -> Plan:
    """``sessions`` agent sessions of the parameter file ``path`` (default the repository's), drawn from ``seed``,
    lengths times ``scale``, at most ``max_turns`` turns each, answers capped at ``max_answer`` tokens; turn ``k``
    (k > 0) waits the session's tool latency ``k - 1`` after turn ``k - 1``'s answer ends."""
    from mmcache.replay.sessions import DEFAULT_PARAMS, AgentSessions, load_params

    if not 0 < scale <= 1 or sessions < 1 or max_turns < 1 or max_answer < 1:
        raise WorkloadShapeError(f"agent: scale in (0, 1] and sessions, max_turns, max_answer >= 1, got {scale}, "
                                 f"{sessions}, {max_turns}, {max_answer}")
    source = Path(path or DEFAULT_PARAMS)
    p = load_params(source)
    shrink = lambda d: dataclasses.replace(d, mean=max(1.0, d.mean * scale), low=max(1.0, d.low * scale),
                                           high=max(1.0, d.high * scale))
    p = dataclasses.replace(p, seed=seed, sessions=sessions, media=None,
                            system_prompt_tokens=max(1, round(p.system_prompt_tokens * scale)),
                            task_tokens=shrink(p.task_tokens), output_tokens=shrink(p.output_tokens),
                            tool_output_tokens=shrink(p.tool_output_tokens))
    work = AgentSessions(p, source=source.name)
    span = space.high - space.low
    ids = lambda a: (np.asarray(a, dtype=np.int64) % span + space.low).tolist()
    turns, answers, waits = [], [], []
    for i, s in enumerate(work.sessions):
        n = min(max_turns, len(s.outputs))
        spec = [work.turn(i, k) for k in range(n)]
        whole = work.prompt_ids(i, n - 1)
        # turn k > 0 adds tool result k - 1: what lies between the end of answer k - 1 and prompt k's end
        cuts = [(0, spec[0].prompt_len)] + [(spec[k - 1].prompt_len + spec[k - 1].output_len, spec[k].prompt_len)
                                           for k in range(1, n)]
        turns.append([ids(whole[a:b]) for a, b in cuts])
        answers.append([max(1, min(t.output_len, max_answer)) for t in spec])
        waits.append([0.0] + [float(x) for x in s.latency[:n - 1]])
    params = {"sessions": sessions, "max_turns": max_turns, "scale": scale, "max_answer": max_answer,
              "seed": seed, "system_prompt_tokens": p.system_prompt_tokens,
              "turns": sum(len(t) for t in turns),
              "mean_wait_s": float(np.mean([w for ws in waits for w in ws[1:]])) if any(len(w) > 1 for w in waits)
              else 0.0,
              "context_tokens_max": max(sum(map(len, t)) + sum(a[:-1]) for t, a in zip(turns, answers)),
              "source": f"datasets/sessions/{source.name}" if path is None else source.name,
              "submitted": "open loop: sessions at the arrivals, each turn its tool wait after the previous answer "
                           "ended (closed loop within a session)"}
    return Plan("agent", turns, answers, unit="sessions", params=params, waits_s=waits)


def shared_prefix(space: TokenSpace, seed: int, groups: int, per_group: int, system_len: int, question_len: int,
                  output_len: int) -> Plan:
    """SGLang's generated-shared-prefix shape: one-turn sessions in its shuffled order."""
    w = tw.generated_shared_prefix(space, seed, groups, per_group, system_len, question_len, output_len)
    (requests,) = w.rounds
    return Plan("shared_prefix", [[list(r.tokens)] for r in requests], [[r.max_tokens] for r in requests],
                params=dict(w.params, submitted="open loop: one request per arrival, in the shuffled order"))


def block_runs(block_keys, block_tokens: int, space: TokenSpace) -> np.ndarray:
    """One run of ``block_tokens`` ids in ``space`` per block key, concatenated: a pure function of each key.
    The keys are ``MooncakeTrace.block_keys``, a bijection of the hash ids (one id, one key, one run)."""
    from mmcache.replay.tokens import streams

    return streams(np.asarray(block_keys, dtype=np.uint64), block_tokens, space.high - space.low).astype(np.int64) \
        + space.low


def mooncake(space: TokenSpace, start: int, count: int, block_tokens: int, max_answer: int,
             max_prompt: int | None = None, path: Path = MOONCAKE_TRACE) -> Plan:
    """Requests ``start .. start + count - 1`` of the trace (0-based lines), blocks of ``block_tokens`` ids
    standing for its 512-token blocks, prompts cut to their first ``max_prompt`` tokens (the shared prefixes
    stay whole: only the tail goes) and answers capped at ``max_answer`` tokens."""
    from mmcache.replay.mooncake import MooncakeTrace

    if start < 0 or count < 1 or block_tokens < 1 or max_answer < 1 or (max_prompt is not None and max_prompt < 1):
        raise WorkloadShapeError("mooncake: start >= 0 and count, block_tokens, max_answer, max_prompt >= 1")
    trace = MooncakeTrace(path, limit=start + count)
    if len(trace) < start + count:
        raise WorkloadShapeError(f"mooncake: the trace holds {len(trace)} requests, fewer than {start + count}")
    turns, answers, hits = [], [], 0
    raw = [trace.block_keys[trace.offsets[i]:trace.offsets[i + 1]] for i in range(start, start + count)]
    seen: set[int] = set()
    for i, ids in zip(range(start, start + count), raw):
        n_in = int(trace.input_lengths[i])
        length = max(1, min(len(ids) * block_tokens, math.ceil(n_in * block_tokens / TRACE_BLOCK),
                            max_prompt or n_in))
        turns.append([block_runs(ids, block_tokens, space)[:length].tolist()])
        answers.append([max(1, min(int(trace.output_lengths[i]), max_answer))])
        hits += sum(int(h) in seen for h in ids)
        seen.update(int(h) for h in ids)
    times = [float(t) for t in trace.times[start:start + count]]
    blocks = sum(len(ids) for ids in raw)
    params = {"start": start, "count": count, "block_tokens": block_tokens, "max_answer": max_answer,
              "max_prompt": max_prompt,
              "trace_span_s": times[-1] - times[0], "blocks": blocks,
              "repeated_block_share": hits / blocks if blocks else 0.0,
              "source": "datasets/traces/conversation_trace.jsonl"}
    return Plan("mooncake", turns, answers, times_s=times, params=params)


def trace_offsets(times_s, rate: float) -> list[float]:
    """The trace's times from its first, compressed or stretched so that ``len(times_s)`` arrivals come at a
    mean of ``rate`` per second (over ``len / rate`` seconds). Times all equal: evenly spaced instead."""
    if not rate > 0:
        raise WorkloadShapeError(f"rate must be positive, got {rate}")
    t = np.asarray(times_s, dtype=float) - float(times_s[0])
    n = len(t)
    if n < 2 or t[-1] <= 0:
        return [i / rate for i in range(n)]
    # the n arrivals span n - 1 gaps of the mean 1 / rate, so the last arrives at (n - 1) / rate
    return (t * ((n - 1) / rate) / t[-1]).tolist()


def hot_prefix(space: TokenSpace, seed: int, sessions: int, turns: int, system_len: int, user_len: int,
               max_answer: int, hot_share: float = 0.8) -> Plan:
    """``sessions`` sessions of ``turns`` turns: ``round(hot_share * sessions)`` of them, picked by ``seed``, open
    with one shared system prompt of ``system_len`` ids, the others with one of their own of the same length; every
    turn adds ``user_len`` ids of the session's own and asks for ``max_answer`` tokens."""
    import random

    if sessions < 1 or turns < 1 or system_len < 1 or user_len < 1 or max_answer < 1 or not 0 <= hot_share <= 1:
        raise WorkloadShapeError("hot_prefix: sessions, turns, system_len, user_len, max_answer >= 1 and hot_share "
                                 f"in [0, 1], got {sessions}, {turns}, {system_len}, {user_len}, {max_answer}, "
                                 f"{hot_share}")
    rng = random.Random(seed)
    hot_system = list(space.draw(rng, system_len))
    hot = set(rng.sample(range(sessions), round(hot_share * sessions)))
    turn_ids = []
    for i in range(sessions):
        system = hot_system if i in hot else list(space.draw(rng, system_len))
        own = [list(space.draw(rng, user_len)) for _ in range(turns)]
        turn_ids.append([system + own[0], *own[1:]])
    params = {"sessions": sessions, "turns": turns, "system_len": system_len, "user_len": user_len,
              "max_answer": max_answer, "hot_share": hot_share, "hot_sessions": sorted(hot),
              "submitted": "open loop: sessions at the arrivals, each turn once the previous answer ended"}
    return Plan("hot_prefix", turn_ids, [[max_answer] * turns for _ in range(sessions)], unit="sessions",
                params=params)
