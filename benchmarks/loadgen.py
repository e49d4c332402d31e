"""An open-loop load generator for an OpenAI-compatible server, and the statistics of what it saw.

A workload is a list of sessions. A ``Session`` is a chat: a history to start from and the user turns to send
one after another, each turn carrying the whole history with the previous answers (as the server returned
them), over ``/v1/chat/completions``. A ``TokenSession`` is the same over ``/v1/completions`` with token-id
prompts: its first turn is a whole prompt, each later turn the previous prompt, the answer's token ids (asked
for with ``return_token_ids``) and the turn's own ids. Sessions arrive open-loop at Poisson times of a given
rate (exponential gaps from a seeded generator, so a seed gives the same schedule every run) or at given
offsets (a trace's own times); the turns of one session follow each other as soon as the previous answer ends,
or, where a ``TokenSession`` gives ``waits_s``, that many seconds after it (an agent's tool call: the closed-loop
rule, so a slower server delays the session's later turns).
Every turn is one streamed request through the async ``openai`` client (``stream_options.include_usage``),
recorded as a ``Record``: when it was sent, when each content chunk came, when it ended, the usage the server reported
(``prompt_tokens``, ``cached_tokens``) and, for a failure, the HTTP status and the error object's type.

Rules:

* Times are ``time.perf_counter()`` stamps of this process; a record's latencies are differences of them.
* A record's ``outcome`` is ``ok`` (the stream ended with ``[DONE]``), ``cut`` (closed by the client on
  purpose after ``cut_after`` content chunks), ``error`` (an error status or error event) or ``timeout`` (still
  running when the run's time limit came; it is cancelled, which closes its connection). A session stops at its
  first turn that is not ``ok``: the next turn would need the answer.
* Every loop is bounded: the number of sessions is given, a session has finitely many turns, and ``open_loop``
  cancels whatever is still running at ``time_limit_s``.
* ``summarise`` takes latencies over ``ok`` records only; SLO attainment counts ``ok`` and ``error`` /
  ``timeout`` records (a failure misses both SLOs), not ``cut`` ones, which ended by the client's choice.
* ``summarise`` and ``meets_slo`` time a stream as vLLM's benchmark client does (``step_ttft``, ``step_tpot``):
  from the first chunk carrying a choice, whatever its text, so a server whose detokenizer shows "" for bytes
  held back and one that shows U+FFFD are timed alike (random weights generate such ids often). ``ttft`` and
  ``tpot`` (first non-empty text) stay for the low-load part, which pairs them with the in-process engine's.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

OUTCOMES = ("ok", "cut", "error", "timeout")


@dataclass
class Record:
    """One request as the client saw it (``perf_counter`` stamps)."""

    session: int
    turn: int
    tenant: str
    send: float
    first_token: float | None = None  # the first chunk with text
    token_times: list[float] = field(default_factory=list)  # one per chunk with non-empty content
    end: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None  # usage.completion_tokens when reported, else the content chunks seen
    text: str = ""
    outcome: str = "ok"
    status: int | None = None  # the HTTP status of a refused request
    error: str | None = None  # the error object's type (or the exception's class name)
    first_chunk: float | None = None  # the first chunk of any kind (a role-only opening chunk too)
    token_ids: list[int] = field(default_factory=list)  # the answer's ids, when the server returned them
    choice_times: list[float] = field(default_factory=list)  # one per chunk carrying a choice, its text "" too

    @property
    def step_ttft(self) -> float | None:
        """TTFT as vLLM's benchmark client times it: to the first chunk carrying a choice, whatever its text (a
        chat's role chunk, or a step whose bytes the detokenizer holds back), so servers whose detokenizers show
        an incomplete character differently ("" or U+FFFD) are timed alike."""
        return None if not self.choice_times else self.choice_times[0] - self.send

    @property
    def step_tpot(self) -> float | None:
        """TPOT as vLLM's benchmark client computes it: (last chunk carrying a choice - first) / (output tokens
        - 1), the tokens from usage; None with fewer than two."""
        n = self.output_tokens or len(self.choice_times)
        if n < 2 or len(self.choice_times) < 2:
            return None
        return (self.choice_times[-1] - self.choice_times[0]) / (n - 1)

    def add_text(self, text: str, now: float) -> None:
        """A chunk with non-empty ``text`` arrived at ``now``."""
        self.token_times.append(now)
        self.text += text
        if self.first_token is None:
            self.first_token = now

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.send

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.send

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first: (last chunk - first chunk) / (tokens - 1); None with one."""
        n = self.output_tokens or len(self.token_times)
        if self.first_token is None or n < 2 or not self.token_times:
            return None
        return (self.token_times[-1] - self.first_token) / (n - 1)


@dataclass
class Session:
    """A chat: ``history`` to start from (system messages, say), then ``turns`` (user messages) sent one by
    one. ``options`` are the other fields of every request (``model``, ``max_tokens``, ``temperature``,
    ``extra_body`` with a ``cache_salt`` ...); ``api_key`` picks the tenant's client; ``cut_after`` closes the
    last turn's stream after that many content chunks."""

    history: list[dict]
    turns: list[dict]
    options: dict
    api_key: str = "none"
    cut_after: int | None = None


@dataclass
class TokenSession:
    """A session over ``/v1/completions``: ``turns[0]`` is the first prompt's token ids, ``turns[t]`` (t > 0)
    what turn ``t`` appends after the previous prompt and its answer's ids. ``options`` are the other fields of
    every request; ``max_tokens[t]``, when given, is turn ``t``'s; ``return_token_ids`` is asked for whenever a
    later turn needs the answer. ``waits_s[t]`` (t > 0), when given, is the pause in seconds between the end of turn
    ``t - 1`` and the sending of turn ``t`` (``waits_s[0]`` is unused: the first turn goes at the arrival)."""

    turns: list[list[int]]
    options: dict
    api_key: str = "none"
    max_tokens: list[int] | None = None
    waits_s: list[float] | None = None

    def __post_init__(self):
        for name in ("max_tokens", "waits_s"):
            given = getattr(self, name)
            if given is not None and len(given) != len(self.turns):
                raise ValueError(f"{name} must give one value per turn: {len(given)} for {len(self.turns)} turns")
        if self.waits_s is not None and any(not 0 <= w < float("inf") for w in self.waits_s):
            raise ValueError("waits_s must be finite and non-negative")


def poisson_arrivals(rate: float, n: int, seed: int) -> np.ndarray:
    """``n`` arrival offsets in seconds from the start, with exponential gaps of mean ``1 / rate`` (the first
    arrival one gap after 0); the same ``seed`` gives the same offsets."""
    if not rate > 0:
        raise ValueError(f"rate must be positive, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    return np.cumsum(gaps)


def _error_of(exc: BaseException) -> tuple[int | None, str]:
    status = getattr(exc, "status_code", None)
    kind = getattr(exc, "type", None) or type(exc).__name__
    return status, str(kind)


async def stream_chat(client, body: Mapping, record: Record, cut_after: int | None = None) -> Record:
    """Send ``body`` (chat.completions fields, without ``stream``) streaming, filling ``record`` as chunks
    come; closes the stream after ``cut_after`` content chunks (``outcome`` ``cut``). Errors of the request
    are recorded, not raised; cancellation closes the stream and propagates. ``cut_after`` 0 closes it as soon
    as the server has accepted the request."""
    async def read(stream) -> None:
        if cut_after == 0:  # closed once the server accepted it, before any token
            record.outcome = "cut"
        else:
            await _read_stream(stream, record, cut_after)

    return await _streamed(record, lambda: client.chat.completions.create(
        **body, stream=True, stream_options={"include_usage": True}), read)


async def _streamed(record: Record, open_stream, read) -> Record:
    """Open a stream (``await open_stream()``) and ``read`` it into ``record``: the send and end times, an API
    error recorded as the outcome instead of raised, the stream closed whatever happens, the output counted."""
    import openai

    stream = None
    try:
        record.send = time.perf_counter()
        stream = await open_stream()
        await read(stream)
        record.end = time.perf_counter()
    except openai.APIError as exc:
        record.end, record.outcome = time.perf_counter(), "error"
        record.status, record.error = _error_of(exc)
    finally:
        if stream is not None:
            await stream.close()
    if record.output_tokens is None:
        record.output_tokens = len(record.token_times)
    return record


async def _read_stream(stream, record: Record, cut_after: int | None) -> None:
    async for chunk in stream:
        now = _chunk_arrived(record, chunk)
        for choice in chunk.choices:
            # Non-empty content only: servers open with a role chunk whose content is "" (vLLM's
            # benchmark counts chunks the same way)
            if choice.delta is not None and choice.delta.content:
                record.add_text(choice.delta.content, now)
        if cut_after is not None and len(record.token_times) >= cut_after:
            record.outcome = "cut"
            break


def _chunk_arrived(record: Record, chunk) -> float:
    """Note a chunk's arrival (and the usage it may carry); returns its time."""
    now = time.perf_counter()
    if record.first_chunk is None:
        record.first_chunk = now
    if chunk.choices:
        record.choice_times.append(now)
    if chunk.usage is not None:
        _take_usage(record, chunk.usage)
    return now



async def stream_completion(client, body: Mapping, record: Record) -> Record:
    """``stream_chat`` for ``/v1/completions`` (``body`` without ``stream``): a choice's ``text`` is its content,
    and its ``token_ids`` (one list at the end, or one per chunk as vLLM sends them) are gathered in order into
    ``record.token_ids``."""
    async def read(stream) -> None:
        async for chunk in stream:
            now = _chunk_arrived(record, chunk)
            for choice in chunk.choices:
                ids = getattr(choice, "token_ids", None) or (choice.model_extra or {}).get("token_ids")
                if ids:
                    record.token_ids.extend(int(t) for t in ids)
                if choice.text:
                    record.add_text(choice.text, now)

    return await _streamed(record, lambda: client.completions.create(
        **body, stream=True, stream_options={"include_usage": True}), read)


async def complete_chat(client, body: Mapping, record: Record) -> Record:
    """Send ``body`` without streaming: the whole answer arrives at once, so ``first_token`` is its end."""
    import openai

    try:
        record.send = time.perf_counter()
        reply = await client.chat.completions.create(**body)
        record.end = record.first_token = time.perf_counter()
        record.choice_times.append(record.end)
        record.text = "".join(c.message.content or "" for c in reply.choices)
        if reply.usage is not None:
            _take_usage(record, reply.usage)
    except openai.APIError as exc:
        record.end, record.outcome = time.perf_counter(), "error"
        record.status, record.error = _error_of(exc)
    return record


def _take_usage(record: Record, usage) -> None:
    record.prompt_tokens = usage.prompt_tokens
    record.output_tokens = usage.completion_tokens
    details = getattr(usage, "prompt_tokens_details", None)
    record.cached_tokens = (getattr(details, "cached_tokens", None) or 0) if details is not None else 0


class MissingTokenIds(RuntimeError):
    """A server answered a turn without the token ids the session's next turn needs."""


async def run_token_session(client, session: TokenSession, index: int, records: list[Record],
                            tenant: str = "", sleep: Callable[[float], Awaitable] = asyncio.sleep) -> None:
    """``run_session`` for a ``TokenSession``: each turn's prompt is the previous prompt, its answer's ids and
    the turn's own ids; a turn with a wait (``waits_s``) is sent ``await sleep(wait)`` after the previous turn
    ended; stops at a turn not ``ok``. An answer without ids where a next turn needs them raises
    ``MissingTokenIds`` (the next prompt cannot be built)."""
    prompt: list[int] = []
    for t, own in enumerate(session.turns):
        if t > 0 and session.waits_s is not None and session.waits_s[t] > 0:
            await sleep(session.waits_s[t])
        prompt = prompt + list(own)
        record = Record(index, t, tenant, time.perf_counter())
        records.append(record)
        last = t == len(session.turns) - 1
        options = dict(session.options)
        if session.max_tokens is not None:
            options["max_tokens"] = session.max_tokens[t]
        if not last:
            options["extra_body"] = {**options.get("extra_body", {}), "return_token_ids": True}
        await stream_completion(client, dict(options, prompt=prompt), record)
        if record.outcome != "ok":
            return
        if not last:
            if len(record.token_ids) != record.output_tokens:
                raise MissingTokenIds(f"session {index} turn {t}: {len(record.token_ids)} answer ids for "
                                      f"{record.output_tokens} output tokens")
            prompt = prompt + record.token_ids


async def run_session(client, session: Session, index: int, records: list[Record], tenant: str = "") -> None:
    """The session's turns in order, each appended to ``records`` when sent; stops at a turn not ``ok``."""
    if isinstance(session, TokenSession):
        return await run_token_session(client, session, index, records, tenant)
    messages = copy.deepcopy(session.history)
    for t, user in enumerate(session.turns):
        messages.append(user)
        record = Record(index, t, tenant, time.perf_counter())
        records.append(record)
        last = t == len(session.turns) - 1
        await stream_chat(client, dict(session.options, messages=list(messages)), record,
                          session.cut_after if last else None)
        if record.outcome != "ok":
            return
        messages.append({"role": "assistant", "content": record.text})


async def open_loop(client_for: Callable[[str], object], sessions: Sequence[Session | TokenSession], rate: float,
                    seed: int, time_limit_s: float, max_in_flight: int | None = None,
                    progress: Callable[[int, int], None] | None = None,
                    offsets: Sequence[float] | None = None) -> list[Record]:
    """Start ``sessions[i]`` at the ``i``-th Poisson arrival of ``rate`` (per second), or at ``offsets[i]``
    seconds when given (``rate`` and ``seed`` then unused), and return every turn's
    record once all ended or ``time_limit_s`` passed (the rest cancelled, their records ``timeout``).
    ``client_for(api_key)`` gives the client of a session's tenant. ``max_in_flight`` bounds the sessions
    running at once (an arrival past it waits for a slot: the schedule slips, which its ``send`` shows). A
    session that had not sent its first turn by ``time_limit_s`` has no record."""
    offsets = start_offsets(len(sessions), rate, seed, offsets)
    records: list[Record] = []
    slots = asyncio.Semaphore(max_in_flight) if max_in_flight else None
    done = 0
    start = time.perf_counter()

    async def one(i: int) -> None:
        nonlocal done
        await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
        s = sessions[i]
        if slots is None:
            await run_session(client_for(s.api_key), s, i, records, s.api_key)
        else:
            async with slots:
                await run_session(client_for(s.api_key), s, i, records, s.api_key)
        done += 1
        if progress is not None:
            progress(done, len(sessions))

    tasks = [asyncio.ensure_future(one(i)) for i in range(len(sessions))]
    _, pending = await asyncio.wait(tasks, timeout=time_limit_s)
    await stop_at_limit(tasks, pending, records)
    return records


def start_offsets(count: int, rate: float, seed: int, offsets: Sequence[float] | None) -> Sequence[float]:
    """Each session's start in seconds: ``offsets``, checked, or the Poisson arrivals of ``rate``."""
    if offsets is None:
        return poisson_arrivals(rate, count, seed)
    if len(offsets) != count or any(not 0 <= x < float("inf") for x in offsets):
        raise ValueError("offsets must be one finite, non-negative offset per session")
    return offsets


async def stop_at_limit(tasks: list, pending: set, records: list[Record]) -> None:
    """Cancels what still runs, raises the first session's error, marks cut-short requests ``timeout``."""
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()
    for r in records:
        if r.end is None:  # cancelled mid-request
            r.outcome, r.end = "timeout", time.perf_counter()


# ---- statistics ------------------------------------------------------------------------------------------
def percentiles(xs: Sequence[float], qs=(50, 90, 99)) -> dict[int, float | None]:
    """Linear-interpolation percentiles (numpy's default) of ``xs``; None each when ``xs`` is empty."""
    if len(xs) == 0:
        return {q: None for q in qs}
    values = np.percentile(np.asarray(xs, dtype=float), qs)
    return {q: float(v) for q, v in zip(qs, values)}


def meets_slo(record: Record, ttft_slo_s: float, tpot_slo_s: float) -> bool:
    """An ``ok`` record whose TTFT and TPOT (``step_ttft``, ``step_tpot``: as vLLM's benchmark client times them)
    are within their SLOs (a one-token answer has no TPOT to miss)."""
    ttft = record.step_ttft
    if record.outcome != "ok" or ttft is None:
        return False
    tpot = record.step_tpot
    return ttft <= ttft_slo_s and (tpot is None or tpot <= tpot_slo_s)


def summarise(records: Sequence[Record], ttft_slo_s: float | None = None, tpot_slo_s: float | None = None
              ) -> dict:
    """p50/p90/p99 of TTFT, TPOT (``step_ttft``, ``step_tpot``) and end-to-end latency (``ok`` records), output
    tokens per second over the
    span from the first send to the last end, the matched share (cached over prompt tokens, of the records
    that reported usage), counts by outcome and HTTP status, and, with both SLOs, the share of requests that
    met them (``attainment``; None when no request counts)."""
    ok = [r for r in records if r.outcome == "ok"]
    out: dict = {"requests": len(records), "outcomes": {k: 0 for k in OUTCOMES}}
    out["outcomes"].update(Counter(r.outcome for r in records))
    out["statuses"] = {str(k): v for k, v in sorted(Counter(r.status for r in records if r.status).items())}
    for name, xs in (("ttft", [r.step_ttft for r in ok]), ("tpot", [r.step_tpot for r in ok]),
                     ("e2e", [r.e2e for r in ok])):
        for q, v in percentiles([x for x in xs if x is not None]).items():
            out[f"{name}_p{q}_s"] = v
    tokens = sum(r.output_tokens or 0 for r in records)
    span = (max(r.end for r in records if r.end is not None) - min(r.send for r in records)
            if any(r.end is not None for r in records) else 0.0)
    out["output_tokens"] = tokens
    out["throughput_tok_s"] = tokens / span if span > 0 else None
    out["span_s"] = span
    usage = [r for r in records if r.prompt_tokens]
    prompt = sum(r.prompt_tokens for r in usage)
    out["prompt_tokens"] = prompt
    out["cached_tokens"] = sum(r.cached_tokens or 0 for r in usage)
    out["matched_share"] = out["cached_tokens"] / prompt if prompt else None
    if ttft_slo_s is not None and tpot_slo_s is not None:
        counted = [r for r in records if r.outcome != "cut"]
        met = sum(meets_slo(r, ttft_slo_s, tpot_slo_s) for r in counted)
        out["slo"] = {"ttft_s": ttft_slo_s, "tpot_s": tpot_slo_s}
        out["attainment"] = met / len(counted) if counted else None
    return out


def goodput(rates: Sequence[Mapping], threshold: float = 0.9) -> float | None:
    """DistServe's goodput: the highest ``rate`` among ``rates`` (dicts with ``rate`` and ``attainment``) whose
    attainment is at least ``threshold``; None when none is."""
    good = [r["rate"] for r in rates if r.get("attainment") is not None and r["attainment"] >= threshold]
    return max(good) if good else None
