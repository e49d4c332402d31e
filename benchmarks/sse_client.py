"""A lean streaming client for ``/v1/chat/completions`` over aiohttp: the client of the low-load measurement,
which times what the HTTP path adds to time to first token.

Why not the ``openai`` client there: its own work per request happens in the client's process and is not the
HTTP path's. It walks the messages through its type transforms, encodes them with the standard library's JSON
encoder, and builds a pydantic model of every chunk: about 4 ms more than this client on a turn of the quick
VLM chat (``benchmarks/RESULTS.md``, Serving), most of the 5 ms allowance. vLLM's serving benchmark also sends
with aiohttp. The low-load part reports the ``openai`` client's figure beside this one.

Rules:

* The clock starts before the body is encoded: encoding is part of sending. It is encoded with orjson, which
  takes 0.06 ms for the 1 MB of data URLs of a third turn where ``json.dumps`` takes 2.4 ms.
* It fills a ``loadgen.Record`` as ``loadgen.stream_chat`` does: ``first_chunk`` (any chunk), ``choice_times``
  (chunks carrying a choice), ``first_token`` and ``token_times`` (chunks with non-empty content), ``text``, the
  usage of the last chunk
  (``stream_options.include_usage`` is always asked for), ``end``.
* ``outcome`` is ``ok`` only for a stream that ends with ``data: [DONE]``. An error status, an error event in
  the stream, or a stream that ends or breaks off without ``[DONE]`` is ``error``, with the status and the error
  object's ``type`` (or what went wrong) in ``status`` and ``error``; nothing is raised for them. A connection
  that cannot be made raises aiohttp's error.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import orjson

from .loadgen import Record

DONE = "[DONE]"


async def stream_chat(session, url: str, body: Mapping, record: Record, api_key: str = "none") -> Record:
    """POST ``body`` (chat fields, without ``stream``) to ``url`` (the server's ``.../v1/chat/completions``) on
    the aiohttp ``session``, streamed, filling ``record``."""
    record.send = time.perf_counter()
    data = orjson.dumps(dict(body, stream=True, stream_options={"include_usage": True}))
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"}
    async with session.post(url, data=data, headers=headers) as response:
        if response.status != 200:
            _failed(record, response.status, _error_type(await response.read()))
        else:
            await _read_events(response, record)
    record.end = time.perf_counter()
    if record.output_tokens is None:
        record.output_tokens = len(record.token_times)
    return record


async def _read_events(response, record: Record) -> None:
    import aiohttp

    try:
        await _events(response, record)
    except aiohttp.ClientPayloadError as e:  # the connection closed mid-stream
        _failed(record, response.status, f"stream cut: {e}")


async def _events(response, record: Record) -> None:
    async for raw in response.content:  # one line at a time
        now = time.perf_counter()
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue  # the blank line between events, or an SSE comment
        payload = line[len("data:"):].strip()
        if payload == DONE:
            return
        event = orjson.loads(payload)
        if "error" in event:
            _failed(record, response.status, (event["error"] or {}).get("type") or "error")
            return
        _take(record, event, now)
    _failed(record, response.status, "stream ended without [DONE]")


def _take(record: Record, chunk: dict, now: float) -> None:
    if record.first_chunk is None:
        record.first_chunk = now
    if chunk.get("choices"):
        record.choice_times.append(now)
    if chunk.get("usage"):
        usage = chunk["usage"]
        record.prompt_tokens, record.output_tokens = usage["prompt_tokens"], usage["completion_tokens"]
        record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    for choice in chunk.get("choices") or ():
        text = (choice.get("delta") or {}).get("content")
        if text:  # non-empty only: the opening chunk carries the role and "" (as loadgen counts)
            record.add_text(text, now)


def _failed(record: Record, status: int, error: str) -> None:
    record.outcome, record.status, record.error = "error", status, error


def _error_type(body: bytes) -> str:
    """The ``type`` of an OpenAI error object, or a short description of a body that is not one."""
    try:
        return orjson.loads(body)["error"]["type"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return f"not an error object: {body[:80]!r}"
