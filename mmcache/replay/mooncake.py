"""The Mooncake trace format: JSONL ``{timestamp (ms), input_length, output_length, hash_ids[]}``.

Mapping (a faithful replay, as the data README asks):

* each hash id names its own deterministic block of ``block_tokens`` (512) tokens, so equal ids give equal
  pages and an equal id at position i (the trace's promise) gives an equal prefix through block i;
* the prompt is the concatenation of the request's blocks, the last one cut to ``input_length``;
* the output is ``output_length`` tokens, deterministic per request (keyed by the line number) and unrelated
  to any block: it enters the stored sequence at teardown, as generated pages do;
* requests arrive in file order at ``timestamp / 1000`` seconds.

The whole file is parsed and checked before anything is replayed: a malformed line raises
``TraceFormatError`` naming the file and the 1-based line, so a trace is never half-replayed silently.
Checks: one JSON object per line; the four keys; non-negative integer lengths (input at least 1) whose sum is
at most ``MAX_SEQUENCE_TOKENS``; ids in [0, 2**64); ``len(hash_ids) == ceil(input_length / block_tokens)``;
timestamps finite, non-negative, non-decreasing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..checks import finite_number
from ..errors import TraceFormatError
from .tokens import splitmix64, stream, stream_key, streams
from .workload import MAX_SEQUENCE_TOKENS, Arrival

BLOCK_TOKENS = 512
VOCAB = 100_000
_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")


def _int(value, name: str, minimum: int, where) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceFormatError(*where, f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _read_text(path: str | Path, shown: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TraceFormatError(shown, 0, f"cannot read trace: {e}") from e


def _record(line: str, where) -> dict:
    """The line's JSON object, holding at least the four keys."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceFormatError(*where, f"not JSON: {e.msg}") from e
    except RecursionError:
        raise TraceFormatError(*where, "not a trace record: JSON nested too deeply") from None
    if not isinstance(rec, dict):
        raise TraceFormatError(*where, f"expected a JSON object, got {type(rec).__name__}")
    missing = [k for k in _KEYS if k not in rec]
    if missing:
        raise TraceFormatError(*where, f"missing key(s) {', '.join(missing)}")
    return rec


def _timestamp(ts, previous: float, where) -> float:
    """``ts`` (ms), checked finite, non-negative and not earlier than the previous line's ``previous``."""
    if not finite_number(ts) or ts < 0:
        raise TraceFormatError(*where, f"timestamp must be a finite number >= 0, got {ts!r}")
    if ts < previous:
        raise TraceFormatError(*where, f"timestamp {ts} is earlier than the previous line's {previous}")
    return ts


def _lengths(rec: dict, where) -> tuple[int, int]:
    """``(input_length, output_length)``, checked against ``MAX_SEQUENCE_TOKENS`` together."""
    n_in = _int(rec["input_length"], "input_length", 1, where)
    n_out = _int(rec["output_length"], "output_length", 0, where)
    if n_in + n_out > MAX_SEQUENCE_TOKENS:
        raise TraceFormatError(*where, f"input_length + output_length = {n_in + n_out} exceeds the "
                                       f"{MAX_SEQUENCE_TOKENS} tokens a replayed request may hold")
    return n_in, n_out


def _hash_ids(hashes, n_in: int, block_tokens: int, where) -> list:
    """``hashes``, checked to be one id in [0, 2**64) per ``block_tokens`` block of the ``n_in`` input tokens."""
    if not isinstance(hashes, list):
        raise TraceFormatError(*where, "hash_ids must be a list")
    if not all(type(h) is int and 0 <= h < 2**64 for h in hashes):
        bad = next(h for h in hashes if not (type(h) is int and 0 <= h < 2**64))
        raise TraceFormatError(*where, f"hash ids must be integers in [0, 2**64), got {bad!r}")
    if len(hashes) != -(-n_in // block_tokens):
        raise TraceFormatError(*where, f"{len(hashes)} hash ids for input_length {n_in} "
                                       f"({block_tokens}-token blocks need {-(-n_in // block_tokens)})")
    return hashes


class MooncakeTrace:
    """A parsed Mooncake trace; a ``Workload`` whose requests arrive at the trace's timestamps."""

    def __init__(self, path: str | Path, block_tokens: int = BLOCK_TOKENS, vocab: int = VOCAB,
                 limit: int | None = None):
        self.path = str(path)
        self.block_tokens = block_tokens
        self.vocab = vocab
        times, inputs, outputs, ids, offsets = self._parse(_read_text(path, self.path))
        count = len(inputs) if limit is None else min(limit, len(inputs))
        self.times = np.asarray(times[:count], dtype=np.float64)
        self.input_lengths = np.asarray(inputs[:count], dtype=np.int64)
        self.output_lengths = np.asarray(outputs[:count], dtype=np.int64)
        self.offsets = np.asarray(offsets[:count + 1], dtype=np.int64)
        hash_ids = np.asarray(ids[:offsets[count]], dtype=np.uint64)
        # One stream key per block; splitmix64 is a bijection, so distinct ids keep distinct keys.
        self.block_keys = splitmix64(hash_ids + np.uint64(stream_key("mooncake-block")))
        self.description = f"mooncake:{Path(path).name}"

    def _parse(self, text: str) -> tuple[list, list, list, list, list]:
        """Every line checked, as columns: arrival seconds, input lengths, output lengths, the hash ids of all
        requests end to end, and the offset of each request's first id (plus the total)."""
        times, inputs, outputs, ids, offsets = [], [], [], [], [0]
        previous = 0.0
        for number, line in enumerate(text.splitlines(), start=1):
            where = (self.path, number)
            rec = _record(line, where)
            previous = ts = _timestamp(rec["timestamp"], previous, where)
            n_in, n_out = _lengths(rec, where)
            hashes = _hash_ids(rec["hash_ids"], n_in, self.block_tokens, where)
            times.append(ts / 1000.0)
            inputs.append(n_in)
            outputs.append(n_out)
            ids.extend(hashes)
            offsets.append(len(ids))
        if not inputs:
            raise TraceFormatError(self.path, 0, "the trace holds no request")
        return times, inputs, outputs, ids, offsets

    def __len__(self) -> int:
        return len(self.input_lengths)

    def request(self, i: int) -> "MooncakeRequest":
        return MooncakeRequest(self, i, int(self.input_lengths[i]), int(self.output_lengths[i]))

    def initial(self) -> list[Arrival]:
        return [(float(self.times[i]), self.request(i)) for i in range(len(self))]

    def follow_ups(self, spec, time_s: float, served: bool) -> list[Arrival]:
        return []

    def prompt_ids(self, i: int) -> np.ndarray:
        keys = self.block_keys[self.offsets[i]:self.offsets[i + 1]]
        return streams(keys, self.block_tokens, self.vocab)[: self.input_lengths[i]]

    def output_ids(self, i: int) -> np.ndarray:
        return stream(stream_key("mooncake-output", i), int(self.output_lengths[i]), self.vocab)


@dataclass(frozen=True)
class MooncakeRequest:
    trace: MooncakeTrace
    request_id: int
    prompt_len: int
    output_len: int

    def prompt_ids(self) -> np.ndarray:
        return self.trace.prompt_ids(self.request_id)

    def output_ids(self) -> np.ndarray:
        return self.trace.output_ids(self.request_id)

    def media(self) -> tuple:
        return ()
