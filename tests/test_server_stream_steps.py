"""Streams send a chunk for every engine step that produced a token, as vLLM's server does: text may be empty
while the detokenizer holds bytes back (an unfinished UTF-8 character, a possible stop string's beginning), the
first chunk is the first token's, and nothing held back for a stop string is ever sent. ``TextOutput`` is
driven with crafted events; the server runs the tiny preset with its decoding copy of the tokenizer replaced by
one that spells a fixed UTF-8 text, one byte per token, so every step's text is known whatever the random
weights pick."""

import asyncio
import json
from types import SimpleNamespace

import httpx
import openai
import pytest

from mmcache.engine.config import EngineConfig
from mmcache.engine.request import RequestOutput, StreamEvent
from mmcache.errors import MmcacheError
from mmcache.presets import serve
from mmcache.server import ServerConfig
from mmcache.server.chat import ChatRoutes
from mmcache.server.text_output import TextOutput
from server_helpers import error_of, wait_quiet

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "tiny"
SCRIPT = "\u2615a\u2615bcdefghijklmnopqrstuvwxyz".encode()  # a 3-byte character, twice
# the text sent at each of the first 7 steps: the coffee cup's first two bytes decode to U+FFFD, held back
STEP_TEXTS = ["", "", "\u2615", "a", "", "", "\u2615"]


class _ByteTokenizer:
    """Token i is byte i (a byte-level tokenizer without merges)."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


class _Script:
    """Whatever the ids, n tokens decode to the first n bytes of ``SCRIPT``."""

    def decode(self, ids, skip_special_tokens=True):
        return SCRIPT[:len(ids)].decode("utf-8", errors="replace")


# ---- TextOutput, with crafted events ---------------------------------------------------------------------------

class _Host:
    """Records the aborts a ``TextOutput`` asks for."""

    def __init__(self):
        self.aborts = []

    def abort(self, rid, reason=None):
        self.aborts.append((rid, reason))


def _token(tok: int) -> StreamEvent:
    return StreamEvent("r", tok, 0.0, False)


def _end(ids: list[int], reason: str = "length", error=None) -> StreamEvent:
    out = RequestOutput("r", 5, list(ids), 0, reason, error, 0.0, None, [])
    return StreamEvent("r", None, 0.0, True, reason, out)


def _steps(events, stops=(), tokenizer=None, late_end: bool = False):
    """The steps of a request whose events are ``events`` (all queued before the first is read, or with
    ``late_end`` the end queued only once every token has been read), and the host's aborts."""
    host = _Host()

    async def run():
        queue = asyncio.Queue()
        for ev in events[:-1] if late_end else events:
            queue.put_nowait(ev)
        reply = TextOutput(host, "r", queue, list(stops), tokenizer or _ByteTokenizer())
        steps = []
        async for step in reply.steps():
            steps.append(step)
            if late_end and len(steps) == len(events) - 1:
                queue.put_nowait(events[-1])
        return reply, steps

    reply, steps = asyncio.run(run())
    return reply, steps, host.aborts


def test_one_step_per_token_with_empty_text_while_a_character_is_unfinished():
    ids = list("\u2615a\u2615".encode())
    reply, steps, aborts = _steps([*map(_token, ids), _end(ids)])
    assert [s.text for s in steps] == STEP_TEXTS
    assert [s.token_ids for s in steps] == [[t] for t in ids]
    assert [s.last for s in steps] == [False] * 6 + [True]  # the end rides on the last token's step
    assert reply.finish_reason == "length" and reply.assembler.text == "\u2615a\u2615" and aborts == []


def test_an_end_that_arrives_later_comes_as_a_step_of_its_own():
    ids = list("ab\u2615".encode())[:-1]  # the output ends inside the character: the end sends what was held
    reply, steps, _ = _steps([*map(_token, ids), _end(ids)], late_end=True)
    assert [s.text for s in steps] == ["a", "b", "", "", "\ufffd"]
    assert [s.token_ids for s in steps] == [[t] for t in ids] + [[]]
    assert [s.last for s in steps] == [False] * 4 + [True]
    reply, steps, _ = _steps([*map(_token, b"ab"), _end(list(b"ab"))], late_end=True)
    assert [(s.text, s.token_ids, s.last) for s in steps] == [("a", [97], False), ("b", [98], False), (None, [], True)]


def test_a_stop_string_is_never_sent_and_later_tokens_are_never_text():
    ids = list(b"xyENDzz")  # the engine made two tokens after "END" before the abort took effect
    reply, steps, aborts = _steps([*map(_token, ids), _end(ids, "abort")], stops=["END"])
    assert [s.text for s in steps] == ["x", "y", "", "", "", None]
    assert [s.token_ids for s in steps] == [[t] for t in ids[:5]] + [ids[5:]]
    assert sum((s.token_ids for s in steps), []) == ids
    assert reply.finish_reason == "stop" and reply.assembler.text == "xy" and aborts == [("r", "stop")]
    # a tail that only began the stop string is sent once the request ends
    reply, steps, _ = _steps([*map(_token, b"xEN"), _end(list(b"xEN"))], stops=["END"])
    assert "".join(s.text or "" for s in steps) == "xEN" and reply.finish_reason == "length"


def test_an_engine_error_after_tokens_ends_without_a_last_step():
    ids = list(b"ab")
    reply, steps, _ = _steps([*map(_token, ids), _end(ids, "error", MmcacheError("sampling failed"))])
    assert [(s.text, s.last) for s in steps] == [("a", False), ("b", False)]
    assert isinstance(reply.error, MmcacheError) and reply.finished


def test_text_is_the_whole_text_whatever_the_steps():
    ids = list("caf\u00e9".encode())

    async def run():
        queue = asyncio.Queue()
        for ev in [*map(_token, ids), _end(ids)]:
            queue.put_nowait(ev)
        return await TextOutput(_Host(), "r", queue, [], _ByteTokenizer()).text()

    assert asyncio.run(run()) == "caf\u00e9"


# ---- the server ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(one_thread):
    with serve(ServerConfig(preset=MODEL, engine_config=EngineConfig(page_size=16))) as srv:
        api = next(r.endpoint.__self__ for r in srv.app.routes if getattr(r, "path", None) == "/v1/models")
        routes = api.chat
        assert isinstance(routes, ChatRoutes)
        routes.prompts.tokenizer = _Script()  # the event loop's decoding copy only: the engine is untouched
        yield srv
    srv.host.engine.check_invariants()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


ARGS = {"model": MODEL, "temperature": 0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}


def _token_chunks(choices: list) -> list:
    """The chunks of a stream's steps: one per token, the request's end riding on the last token's chunk
    (``EngineHost`` posts a step's events of one request in one callback, so the handler finds the end queued)."""
    assert all(c.model_extra["token_ids"] for c in choices), "a chunk without a token of its own"
    return choices


def test_completions_stream_a_chunk_per_token(server, client):
    whole = client.completions.create(prompt="a kite over the dunes", max_tokens=7, **ARGS)
    assert whole.choices[0].text == "\u2615a\u2615"
    chunks = list(client.completions.create(prompt="a kite over the dunes", max_tokens=7, stream=True,
                                            stream_options={"include_usage": True}, **ARGS))
    choices = [c.choices[0] for c in chunks if c.choices]
    steps = _token_chunks(choices)
    assert [c.text for c in steps] == STEP_TEXTS
    assert [c.model_extra["token_ids"] for c in steps] == [[t] for t in whole.choices[0].model_extra["token_ids"]]
    assert [c.finish_reason for c in choices][:-1] == [None] * (len(choices) - 1)
    assert choices[-1].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    wait_quiet(server.host)


def test_chat_stream_opens_with_the_role_then_a_chunk_per_token(server, client):
    messages = [{"role": "user", "content": "a lighthouse in fog"}]
    chunks = list(client.chat.completions.create(messages=messages, max_tokens=7, stream=True, **ARGS))
    head, *rest = [c.choices[0] for c in chunks]
    assert head.delta.role == "assistant" and head.delta.content == "" and "token_ids" not in head.model_extra
    steps = _token_chunks(rest)
    assert [c.delta.content for c in steps] == STEP_TEXTS
    assert all(len(c.model_extra["token_ids"]) == 1 for c in steps)
    assert rest[-1].finish_reason == "length" and all(c.finish_reason is None for c in rest[:-1])
    wait_quiet(server.host)


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_stop_strings_never_leak(server, client, chat):
    # SCRIPT's text: the stop string "a\u2615" begins at the 4th token and ends at the 7th; the engine may make
    # more tokens before the abort takes effect: they are never text
    common = {**ARGS, "max_tokens": 30, "stop": ["a\u2615"], "stream": True}
    if chat:
        stream = client.chat.completions.create(messages=[{"role": "user", "content": "tides"}], **common)
        choices = [c.choices[0] for c in stream][1:]
        texts = [c.delta.content for c in choices]
    else:
        choices = [c.choices[0] for c in client.completions.create(prompt="tides", **common)]
        texts = [c.text for c in choices]
    assert all("a" not in (t or "") for t in texts) and "".join(t or "" for t in texts) == "\u2615"
    assert [t for t in texts[:7]] == ["", "", "\u2615", "", "", "", ""]
    assert choices[-1].finish_reason == "stop"
    whole = sum((c.model_extra["token_ids"] for c in choices), [])
    assert 7 <= len(whole) <= 30
    wait_quiet(server.host)
    server.host.engine.check_invariants()


def test_the_raw_stream_is_one_event_per_chunk_ending_with_done(server):
    body = {"model": MODEL, "prompt": "salt flats", "max_tokens": 3, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.base_url + "/completions", json=body) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert [e["choices"][0]["text"] for e in events][:3] == ["", "", "\u2615"]
    assert all("token_ids" not in e["choices"][0] for e in events)  # only when asked for
    assert events[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("field, value", [("logprobs", 2), ("n", 2)])
def test_a_stream_of_an_unsupported_request_is_refused_before_any_chunk(server, field, value):
    body = {"model": MODEL, "prompt": "reeds", "max_tokens": 3, "stream": True, field: value}
    r = httpx.post(server.base_url + "/completions", json=body)
    assert r.status_code == 400 and error_of(r)["param"] == field
