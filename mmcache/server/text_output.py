"""One request's events as text: incremental detokenizing, stop strings, and the end of the request.

Rules:

* Text is the decode of every output token so far (special tokens skipped); a delta is what was not sent yet.
  A trailing U+FFFD (an incomplete UTF-8 sequence) and a tail that could begin a stop string are held back
  until the next token settles them, so no sent text is ever taken back.
* The stop check looks only at the text not yet sent and the longest stop string's length before it (a stop
  string found later would have been found then), so its work per token depends on the stop strings' lengths
  (bounded by the server) and never on the length of the text so far.
* A stop string ends the text before its first occurrence: the request is aborted at once (its pages return),
  the finish reason is ``stop``, and tokens the engine produced after it are never text.
* One ``Step`` per engine step that produced a token for the request, its text possibly empty (bytes or a
  stop-string prefix held back), as vLLM's server streams: a stream's first chunk is the first token's, not the
  first visible text's. The request's end rides on its last token's step when it is in the queue by the time
  that token is read (the engine emits both in one step); otherwise a last step of its own carries it. The
  steps' ``token_ids`` joined are the request's ``output_ids``: tokens made after a stop string (before its
  abort took effect) go in the last step.
* ``close`` aborts the request unless it has finished: a handler calls it however it leaves (client gone,
  stream closed, error), so nothing stays held.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ..engine.request import RequestOutput, StreamEvent
from .engine_host import AddFailed

_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort"}


class TextAssembler:
    """Output tokens -> sendable text deltas under ``stops``."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer = tokenizer
        self.stops = stops
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0
        self.stopped = False

    def add(self, token: int) -> str:
        self.ids.append(token)
        if self.tokenizer is None:
            return ""
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = self._first_stop()
        if cut is not None:
            self.stopped = True
            self.text = self.text[:cut]
            return self._take(cut)
        return self._take(self._safe_end())

    def flush(self) -> str:
        """What is left once the request has ended."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        delta = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta

    def _first_stop(self) -> int | None:
        start = max(0, self.sent - self._longest)
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _safe_end(self) -> int:
        """The end of what may be sent: before a trailing U+FFFD run, and before the longest tail that begins a
        stop string (never before ``sent``: that text is out already)."""
        text = self.text
        end = len(text)
        while end > self.sent and text[end - 1] == "\ufffd":
            end -= 1
        held = max((_open_prefix(text, end, s, self.sent) for s in self.stops), default=0)
        return end - held

    @property
    def _longest(self) -> int:
        return max((len(s) for s in self.stops), default=0)


def _open_prefix(text: str, end: int, stop: str, floor: int) -> int:
    """The length k of the longest ``text[end - k:end]`` (k < len(stop), ``end - k >= floor``) that is a
    proper prefix of ``stop``; 0 when none. Candidates are the places of ``stop``'s first character within the
    last ``len(stop) - 1`` characters, so the work is bounded by the stop string, not the text."""
    start = max(floor, end - len(stop) + 1)
    i = text.find(stop[0], start, end)
    while i >= 0:
        if stop.startswith(text[i:end]):
            return end - i
        i = text.find(stop[0], i + 1, end)
    return 0


@dataclass
class Step:
    """One chunk's worth of a request's output: ``text`` ("" while the detokenizer holds bytes back; None on a
    final step that carries no token's text), the step's ``token_ids``, and ``last`` (the request has ended:
    ``TextOutput.output`` is set)."""

    text: str | None
    token_ids: list[int]
    last: bool


class TextOutput:
    """The events of one submitted request (``queue`` from ``EngineHost.submit``) as text, step by step, decoded
    with ``tokenizer`` (the server's own copy: see ``prompts``)."""

    def __init__(self, host, rid: str, queue: asyncio.Queue, stops: list[str], tokenizer):
        self.host = host
        self.rid = rid
        self.queue = queue
        self.assembler = TextAssembler(tokenizer, stops)
        self.output: RequestOutput | None = None
        self._pending: StreamEvent | None = None
        self._ids_sent = 0

    @property
    def finished(self) -> bool:
        return self.output is not None

    @property
    def finish_reason(self) -> str | None:
        if self.assembler.stopped:
            return "stop"
        return None if self.output is None else _FINISH.get(self.output.finish_reason, self.output.finish_reason)

    @property
    def error(self):
        return None if self.output is None else self.output.error

    async def first(self) -> StreamEvent:
        """Wait for the first event (a token, or the request's end: a refusal comes this way) and keep it; the
        error of an ``add_request`` that raised is raised here."""
        self._pending = await self._next()
        return self._pending

    async def _next(self) -> StreamEvent:
        if self._pending is not None:
            ev, self._pending = self._pending, None
            return ev
        item = await self.queue.get()
        if isinstance(item, AddFailed):
            raise item.error
        return item

    def _arrived(self) -> StreamEvent | None:
        """The next event if it is in the queue already, else None; never waits."""
        try:
            return self.queue.get_nowait()
        except asyncio.QueueEmpty:
            return None

    async def steps(self):
        """``Step`` after ``Step`` until the request ends (``output`` is then set; ``error`` if it failed, and
        then no last step comes: the caller reports the error)."""
        while self.output is None:
            ev = await self._next()
            text = None
            if not ev.finished:
                if self.assembler.stopped:
                    continue  # produced before the stop's abort took effect: never text
                text = self.assembler.add(ev.token_id)
                if self.assembler.stopped:
                    self.host.abort(self.rid, "stop")
                after = self._arrived()
                if after is None or not after.finished or after.finish_reason == "error":
                    self._pending = after
                    self._ids_sent += 1
                    yield Step(text, [ev.token_id], False)
                    continue
                ev = after  # the request ended in this token's step: one step carries both
            self.output = ev.output
            if ev.finish_reason == "error":
                return
            if not self.assembler.stopped:
                tail = self.assembler.flush()
                if tail:
                    text = (text or "") + tail
            ids = list(self.output.output_ids[self._ids_sent:])
            self._ids_sent += len(ids)
            yield Step(text, ids, True)

    async def text(self) -> str:
        async for _ in self.steps():
            pass
        return self.assembler.text

    def close(self) -> None:
        if self.output is None:
            self.host.abort(self.rid)
