"""``POST /v1/chat/completions`` and ``POST /v1/completions``: a chat model's routes over one ``EngineHost``, whole
and streamed (server-sent events in OpenAI's chunk shapes).

A request's way: ``intake`` (key, body, salt) -> ``prompts`` (an engine request, built on the prompt thread) ->
``engine_host`` (queued to the step thread; events back on an asyncio queue) -> ``text_output`` (events to text
deltas, stop strings) -> the response here.

Rules:

* After the checks every route shares (``intake``): unsupported options and stop strings (400), the prompt's
  text against what the context can hold (400), a place in the host's waiting queue (503 with ``Retry-After``),
  taken before the prompt is tokenized on the prompt thread, then images (400 / 413). The engine's own refusal of a request (bad image, prompt too long)
  arrives as its first event, before any byte of the response is sent, so a streamed request gets a proper
  error status too; an engine error after that ends the stream with an error object, counted in
  ``mmcache:request_errors_total``.
* A stream sends a chunk for every engine step that produced a token (its text may be empty while the
  detokenizer holds bytes back), as vLLM's server does, so a client's first chunk marks the first token; with
  ``return_token_ids`` each chunk carries its step's ids. A chat stream opens with the role, once the first
  token is out. The last chunk carries the finish reason, then usage (if asked) in a chunk with no choices.
* A client that goes away aborts its request: a non-streamed handler watches for the disconnect while it waits
  (499), a streamed one aborts when its response ends for any reason.
"""

from __future__ import annotations

import json
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from .engine_host import EngineHost, QueueFull
from .errors import from_engine_error
from .intake import ClientGone, Intake, unless_disconnected
from .prompts import PromptMaker, check_supported, stop_strings
from .protocol import ChatCompletionRequest, CompletionRequest, now, usage
from .text_output import TextOutput


class ChatRoutes:
    """The two routes over ``host``, read through ``intake``; ``close`` ends the prompt thread."""

    def __init__(self, host: EngineHost, config, intake: Intake, metrics):
        self.host = host
        self.config = config
        self.intake = intake
        self.metrics = metrics
        self.prompts = PromptMaker(host, config)

    def router(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/v1/chat/completions", self.chat, methods=["POST"])
        router.add_api_route("/v1/completions", self.completions, methods=["POST"])
        return router

    async def chat(self, request: Request):
        return await self._serve(request, ChatCompletionRequest, chat=True)

    async def completions(self, request: Request):
        return await self._serve(request, CompletionRequest, chat=False)

    def close(self) -> None:
        self.prompts.close()

    async def _serve(self, request: Request, body_model, chat: bool):
        arrival = time.perf_counter()
        tenant, req, salt = await self.intake.read(request, body_model, self.config.chat_model_name)
        check_supported(req)
        stops = stop_strings(req, self.config.max_stop_chars)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        make = self.prompts.chat if chat else self.prompts.completion
        self.prompts.check_length(req)
        try:
            self.host.reserve(tenant.name)  # a full queue refuses before the prompt is built
        except QueueFull as e:
            raise self.intake.busy(e) from None
        try:
            engine_request = await self.prompts.build(make, req, rid, salt, arrival)
        except BaseException:
            self.host.unreserve(tenant.name)
            raise
        return await self._run(request, req, rid, engine_request, stops, tenant.name, chat)

    async def _run(self, request: Request, req, rid: str, engine_request, stops: list[str], owner: str,
                   chat: bool):
        try:
            queue = self.host.submit(engine_request, owner, reserved=True, source=req)
        except QueueFull as e:
            raise self.intake.busy(e) from None
        reply = TextOutput(self.host, rid, queue, stops, self.prompts.tokenizer)
        try:
            first = await unless_disconnected(request, reply.first())
            if first.finished and first.finish_reason == "error":
                raise from_engine_error(first.output.error, "messages" if chat else "prompt")
            headers = self.host.headers(rid)
            if req.stream:
                shape = (_ChatChunks if chat else _CompletionChunks)(rid, self.config.chat_model_name)
                return _Stream(self._sse(reply, shape, req), reply.close, headers)
            await unless_disconnected(request, reply.text())
        except ClientGone:
            reply.close()
            return Response(status_code=499)
        except BaseException:
            reply.close()
            raise
        if reply.error is not None:
            raise from_engine_error(reply.error)
        return JSONResponse(self._whole(reply, req, rid, chat), headers=headers)

    def _whole(self, reply: TextOutput, req, rid: str, chat: bool) -> dict:
        out = reply.output
        choice: dict = {"index": 0, "logprobs": None, "finish_reason": reply.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": reply.assembler.text}
        else:
            choice["text"] = reply.assembler.text
        if req.return_token_ids:
            choice["token_ids"] = list(out.output_ids)
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": now(),
                "model": self.config.chat_model_name, "choices": [choice],
                "usage": usage(out.prompt_len, len(out.output_ids), out.matched_tokens)}

    async def _sse(self, reply: TextOutput, shape, req):
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        head = shape.head()
        if head is not None:
            yield _event(shape.chunk(head, None, include_usage))
        async for step in reply.steps():
            chunk = shape.chunk(shape.delta(step.text), reply.finish_reason if step.last else None, include_usage)
            if req.return_token_ids:
                chunk["choices"][0]["token_ids"] = step.token_ids
            yield _event(chunk)
        if reply.error is not None:
            err = from_engine_error(reply.error)
            self.metrics.error(err.code or err.type)
            yield _event(err.body())
        elif include_usage:
            out = reply.output
            yield _event({**shape.chunk(None, None, False), "choices": [],
                          "usage": usage(out.prompt_len, len(out.output_ids), out.matched_tokens)})
        yield "data: [DONE]\n\n"


class _ChatChunks:
    """``chat.completion.chunk`` events: a head with the role, then ``delta`` objects."""

    object = "chat.completion.chunk"

    def __init__(self, rid: str, model: str):
        self.base = {"id": rid, "object": self.object, "created": now(), "model": model}

    def head(self):
        return {"role": "assistant", "content": ""}

    def delta(self, text: str | None):
        return {} if text is None else {"content": text}

    def choice(self, delta) -> dict:
        return {"delta": delta}

    def chunk(self, delta, finish_reason, include_usage: bool) -> dict:
        out = {**self.base, "choices": [{"index": 0, **self.choice(delta), "logprobs": None,
                                         "finish_reason": finish_reason}]}
        if include_usage:
            out["usage"] = None
        return out


class _CompletionChunks(_ChatChunks):
    """``text_completion`` events: no head, the text itself in each choice."""

    object = "text_completion"

    def head(self):
        return None

    def delta(self, text: str | None):
        return text or ""

    def choice(self, text) -> dict:
        return {"text": text or ""}


class _Stream(StreamingResponse):
    """A server-sent-event response that aborts its request however the response ends."""

    def __init__(self, body, on_close, headers=None):
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache", **(headers or {})})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:  # the client closed the stream: its request is aborted below
            pass
        finally:
            self._on_close()


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
