"""TraceLab's agent sessions, replayed closed-loop: each round arrives when its session's previous round ended plus
that round's tool wait, so arrival times depend on how fast the replayed deployment serves.

The CSV (TraceLab's ``replay/examples`` format) has the columns ``session_id,arrival_time,round_idx,prefix_len,
input_len,output_len,tool_wait_after_ms``; ``arrival_time`` (milliseconds, the session's first round) may be
left out, and is then 0 for every session. Round ``k`` of a session:

* its prompt is the first ``prefix_len`` tokens of the session's context after round ``k - 1`` (that round's
  prompt, then its output) followed by ``input_len`` new tokens; where ``prefix_len`` is longer than that context
  (TraceLab's lengths are measured, not rebuilt), the missing tokens are new too;
* it arrives ``tool_wait_after_ms`` of round ``k - 1`` after round ``k - 1`` ended; round 0 at ``arrival_time``;
* a round the deployment rejects ends its session.

Tokens are deterministic streams (``tokens.stream``) keyed by (session, round, part), so the same file always
gives the same ids and only the spans the CSV says are shared are shared. Every row is checked when the file is
read (``TraceLabError`` names the line): whole numbers, no negative value, a prompt of at least one token, the
rounds of a session numbered 0, 1, ... without a gap, one arrival time per session, and no round over
``MAX_SEQUENCE_TOKENS``.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import MmcacheError
from ..names import MediaItem
from .tokens import stream, stream_key
from .workload import MAX_SEQUENCE_TOKENS, Arrival

COLUMNS = ("session_id", "round_idx", "prefix_len", "input_len", "output_len", "tool_wait_after_ms")
VOCAB = 32_000
_CONTEXTS_KEPT = 64  # contexts kept materialised: the rounds of live sessions interleave


class TraceLabError(MmcacheError, ValueError):
    """A TraceLab CSV is malformed; ``line`` is its 1-based line number (0: the file as a whole)."""

    def __init__(self, path: str, line: int, reason: str):
        super().__init__(f"{path}:{line}: {reason}" if line else f"{path}: {reason}")
        self.path, self.line, self.reason = path, line, reason


@dataclass(frozen=True)
class TraceLabRound:
    """Round ``round`` of session ``session`` (its index among the file's sessions); a ``RequestSpec``."""

    workload: "TraceLabSessions"
    session: int
    round: int
    request_id: int
    prompt_len: int
    output_len: int

    def prompt_ids(self) -> np.ndarray:
        return self.workload.sequence_ids(self.session, self.round)[:self.prompt_len].copy()

    def output_ids(self) -> np.ndarray:
        return self.workload.sequence_ids(self.session, self.round)[self.prompt_len:].copy()

    def media(self) -> tuple[MediaItem, ...]:
        return ()


@dataclass
class _Session:
    arrival_s: float
    rows: np.ndarray  # per round: prefix_len, input_len, output_len, tool_wait_after_ms
    first_id: int


class TraceLabSessions:
    """The rounds of a TraceLab CSV as a closed-loop ``Workload``."""

    def __init__(self, path, source: str | None = None):
        path = Path(path)
        self.description = f"tracelab:{source or path.name}"
        rows, arrival = _read(str(path))
        self.sessions: list[_Session] = []
        next_id = 0
        for sid, entries in rows.items():
            entries.sort(key=lambda e: e[1])
            for k, (line, rnd, prefix, new, out, _) in enumerate(entries):
                if rnd != k:
                    raise TraceLabError(str(path), line, f"session {sid!r}: round {rnd} where round {k} was "
                                                         f"expected")
                if prefix + new < 1:
                    raise TraceLabError(str(path), line, "a round's prompt must hold a token (prefix_len + "
                                                         "input_len)")
                if prefix + new + out > MAX_SEQUENCE_TOKENS:
                    raise TraceLabError(str(path), line, f"a round of {prefix + new + out} tokens is over the "
                                                         f"{MAX_SEQUENCE_TOKENS} a replayed sequence may hold")
            table = np.asarray([e[2:] for e in entries], dtype=np.int64)
            self.sessions.append(_Session(arrival[sid] / 1000.0, table, next_id))
            next_id += len(entries)
        self.num_requests = next_id
        self._kept: dict[tuple[int, int], np.ndarray] = {}  # (session, round) -> its prompt and output

    # ---- the Workload ------------------------------------------------------------------------------
    def round(self, session: int, k: int) -> TraceLabRound:
        s = self.sessions[session]
        prefix, new, out, _ = (int(v) for v in s.rows[k])
        return TraceLabRound(self, session, k, s.first_id + k, prefix + new, out)

    def initial(self) -> list[Arrival]:
        firsts = [(s.arrival_s, self.round(i, 0)) for i, s in enumerate(self.sessions)]
        return sorted(firsts, key=lambda a: (a[0], a[1].request_id))

    def follow_ups(self, spec: TraceLabRound, time_s: float, served: bool) -> list[Arrival]:
        s = self.sessions[spec.session]
        if not served or spec.round + 1 >= len(s.rows):
            return []
        return [(time_s + float(s.rows[spec.round, 3]) / 1000.0, self.round(spec.session, spec.round + 1))]

    # ---- tokens ------------------------------------------------------------------------------------
    def sequence_ids(self, session: int, k: int) -> np.ndarray:
        """Round ``k``'s prompt then its output (the session's context after it), built on from the latest
        earlier round still kept; read only."""
        j = k
        while j >= 0 and (session, j) not in self._kept:
            j -= 1
        context = self._kept[(session, j)] if j >= 0 else np.empty(0, dtype=np.int32)
        rows = self.sessions[session].rows
        for r in range(j + 1, k + 1):
            prefix, new, out, _ = (int(v) for v in rows[r])
            before = context[:prefix]
            context = np.concatenate([
                before,
                stream(stream_key("tracelab-filler", session, r), prefix - len(before), VOCAB),
                stream(stream_key("tracelab-input", session, r), new, VOCAB),
                stream(stream_key("tracelab-output", session, r), out, VOCAB)])
            if len(self._kept) >= _CONTEXTS_KEPT:
                self._kept.pop(next(iter(self._kept)))
            self._kept[(session, r)] = context
        return context


def _read(where: str) -> tuple[dict, dict]:
    """The file's rows per session id (line, round, prefix, input, output, wait) and each session's arrival."""
    rows: dict[str, list] = {}
    arrival: dict[str, int] = {}
    try:
        with open(where, newline="") as f:
            reader = csv.DictReader(f)
            missing = [c for c in COLUMNS if c not in (reader.fieldnames or ())]
            if missing:
                raise TraceLabError(where, 1, f"missing columns {missing}")
            for line, row in enumerate(reader, start=2):
                values = [_whole(row.get(c), c, where, line) for c in COLUMNS[1:]]
                sid = row["session_id"]
                start = _whole(row.get("arrival_time") or "0", "arrival_time", where, line)
                if arrival.setdefault(sid, start) != start:
                    raise TraceLabError(where, line, f"session {sid!r} has two arrival times")
                rows.setdefault(sid, []).append((line, *values))
    except OSError as e:
        raise TraceLabError(where, 0, f"cannot read: {e}") from None
    except (csv.Error, UnicodeDecodeError) as e:
        raise TraceLabError(where, 0, f"not a CSV: {e}") from None
    if not rows:
        raise TraceLabError(where, 0, "no rounds")
    return rows, arrival


def _whole(text, column: str, where: str, line: int) -> int:
    """A non-negative whole number from a CSV cell."""
    try:
        value = int(str(text).strip())
    except (TypeError, ValueError):
        raise TraceLabError(where, line, f"{column} is not a whole number: {text!r}") from None
    if value < 0:
        raise TraceLabError(where, line, f"{column} must not be negative, got {value}")
    return value
