"""The FastAPI application: OpenAI-compatible routes over one ``EngineHost`` and the generation services.

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (with a chat model), the routers of the image,
speech and video services (``images.image_router``, ``speech.speech_router``, ``videos``), ``GET /v1/models``
(these need an API key when keys are configured), ``GET /health`` (200 while the step loop and every generation
queue run), ``GET /metrics`` (Prometheus text; open, as vLLM's is, unless ``metrics_key`` is set: it shows every
tenant's volume together, never a key, a prompt or an output).

Rules:

* A request is checked in this order: key (401), body size (413), JSON (400), fields (400, naming the field),
  model (404), unsupported options (400), images (400 / 413), waiting queue (503 with ``Retry-After``). The
  engine's own refusal of a request (bad image, prompt too long) arrives as its first event, before any byte
  of the response is sent, so a streamed request gets a proper error status too.
* Every error, including FastAPI's and pydantic's own and unknown routes, is an OpenAI error object, and is
  counted in ``mmcache:request_errors_total`` by its code.
* A client that goes away aborts its request: a non-streamed handler watches for the disconnect while it
  waits, a streamed one aborts when its response ends for any reason.
"""

from __future__ import annotations

import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from .errors import APIError, from_engine_error, internal, overloaded, route_not_found, unauthorized
from .text_output import Generation
from .intake import ClientGone, Intake, from_validation, unless_disconnected
from .metrics import ServerMetrics
from .prompts import PromptMaker, check_supported, stop_strings
from .protocol import ChatCompletionRequest, CompletionRequest, model_card, now, usage
from .engine_host import EngineHost, QueueFull
from .tenants import Tenants, metrics_key_matches


def build_app(host: EngineHost | None, config, tenants: Tenants, metrics: ServerMetrics, routers=(),
              services=()) -> FastAPI:
    """The app over ``host`` (None: no chat model), with each of ``routers`` (FastAPI ``APIRouter``s) included;
    ``services`` (each with ``name``, ``task`` and ``alive``) are listed in /v1/models and checked by /health."""
    app = FastAPI(title="mmcache", docs_url=None, redoc_url=None, openapi_url=None)
    api = _Api(host, config, tenants, metrics, services)
    app.state.api = api

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return api.error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, err: RequestValidationError):
        return api.error_response(from_validation(err.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException):
        if err.status_code == 404:
            return api.error_response(route_not_found(request.url.path))
        return api.error_response(APIError(err.status_code, str(err.detail), code=f"http_{err.status_code}"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception):
        return api.error_response(internal(f"{type(err).__name__}: {err}"))

    if host is not None:
        app.post("/v1/chat/completions")(api.chat)
        app.post("/v1/completions")(api.completions)
    for router in routers:
        app.include_router(router)
    app.get("/v1/models")(api.models)
    app.get("/health")(api.health)
    app.get("/metrics")(api.metrics_text)
    return app


class _Api:
    def __init__(self, host: EngineHost | None, config, tenants: Tenants, metrics: ServerMetrics, services=()):
        self.host = host
        self.config = config
        self.tenants = tenants
        self.metrics = metrics
        self.services = list(services)
        self.intake = Intake(config, tenants)
        self.prompts = PromptMaker(host, config) if host is not None else None
        self.created = now()

    # ---- errors -------------------------------------------------------------------------------------
    def error_response(self, err: APIError) -> JSONResponse:
        self.metrics.error(err.code or err.type)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    # ---- checks -------------------------------------------------------------------------------------
    async def _body(self, request: Request, model):
        """The tenant, its salt and the checked request body."""
        tenant = self.intake.tenant(request)
        req = await self.intake.body(request, model, self.config.chat_model_name)
        salt = self.intake.salt(tenant, req.cache_salt)
        check_supported(req)
        return tenant, salt, req

    # ---- routes -------------------------------------------------------------------------------------
    async def chat(self, request: Request):
        arrival = time.perf_counter()
        tenant, salt, req = await self._body(request, ChatCompletionRequest)
        stops = stop_strings(req, self.config.max_stop_chars)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        engine_request = await self.prompts.build(self.prompts.chat, req, rid, salt, arrival)
        return await self._run(request, req, rid, engine_request, stops, tenant.name, chat=True)

    async def completions(self, request: Request):
        arrival = time.perf_counter()
        tenant, salt, req = await self._body(request, CompletionRequest)
        stops = stop_strings(req, self.config.max_stop_chars)
        rid = f"cmpl-{uuid.uuid4().hex}"
        engine_request = await self.prompts.build(self.prompts.completion, req, rid, salt, arrival)
        return await self._run(request, req, rid, engine_request, stops, tenant.name, chat=False)

    async def models(self, request: Request):
        self.intake.tenant(request)
        cards = []
        if self.host is not None:
            cards.append(model_card(self.config.chat_model_name, self.host.core.max_model_len, self.created))
        for service in self.services:
            cards.append({"id": service.name, "object": "model", "created": self.created, "owned_by": "mmcache",
                          "root": service.name, "task": service.task})
        return JSONResponse({"object": "list", "data": cards})

    async def health(self):
        if self.host is not None and not self.host.alive:
            return self.error_response(APIError(503, "the engine's step loop is not running",
                                                "service_unavailable", None, "not_ready"))
        for service in self.services:
            if not service.alive:
                return self.error_response(APIError(503, f"the {service.task} worker is not running",
                                                    "service_unavailable", None, "not_ready"))
        return JSONResponse({"status": "ok"})

    async def metrics_text(self, request: Request):
        if self.config.metrics_key is not None and not metrics_key_matches(request, self.config.metrics_key):
            raise unauthorized("/metrics needs the metrics key: send Authorization: Bearer KEY")
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def close(self) -> None:
        if self.prompts is not None:
            self.prompts.close()

    # ---- running a request --------------------------------------------------------------------------
    async def _run(self, request: Request, req, rid: str, engine_request, stops: list[str], owner: str,
                   chat: bool):
        try:
            queue = self.host.submit(engine_request, owner)
        except QueueFull as e:
            raise overloaded(f"the server is busy: {e}; retry later", self.config.retry_after_s) from None
        gen = Generation(self.host, rid, queue, stops, self.prompts.tokenizer)
        try:
            first = await unless_disconnected(request, gen.first())
            if first.finished and first.finish_reason == "error":
                raise from_engine_error(first.output.error, "messages" if chat else "prompt")
            if req.stream:
                shape = _ChatChunks(rid, req, self.config.chat_model_name) if chat else \
                    _CompletionChunks(rid, req, self.config.chat_model_name)
                return _Stream(self._sse(gen, shape, req), gen.close)
            await unless_disconnected(request, gen.text())
        except ClientGone:
            gen.close()
            return Response(status_code=499)
        except BaseException:
            gen.close()
            raise
        if gen.error is not None:
            raise from_engine_error(gen.error)
        return JSONResponse(self._whole(gen, req, rid, chat))

    def _whole(self, gen: Generation, req, rid: str, chat: bool) -> dict:
        out = gen.output
        choice: dict = {"index": 0, "logprobs": None, "finish_reason": gen.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": gen.assembler.text}
        else:
            choice["text"] = gen.assembler.text
        if req.return_token_ids:
            choice["token_ids"] = list(out.output_ids)
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": now(),
                "model": self.config.chat_model_name, "choices": [choice],
                "usage": usage(out.prompt_len, len(out.output_ids), out.matched_tokens)}

    async def _sse(self, gen: Generation, shape, req):
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        head = shape.head()
        if head is not None:
            yield _event(shape.chunk(head, None, include_usage))
        async for delta in gen.deltas():
            yield _event(shape.chunk(shape.delta(delta), None, include_usage))
        if gen.error is not None:
            err = from_engine_error(gen.error)
            self.metrics.error(err.code or err.type)
            yield _event(err.body())
        else:
            out = gen.output
            last = shape.chunk(shape.delta(None), gen.finish_reason, include_usage)
            if req.return_token_ids:
                last["choices"][0]["token_ids"] = list(out.output_ids)
            yield _event(last)
            if include_usage:
                yield _event({**shape.chunk(None, None, False), "choices": [],
                              "usage": usage(out.prompt_len, len(out.output_ids), out.matched_tokens)})
        yield "data: [DONE]\n\n"


class _ChatChunks:
    def __init__(self, rid: str, req, model: str):
        self.base = {"id": rid, "object": "chat.completion.chunk", "created": now(), "model": model}

    def head(self):
        return {"role": "assistant", "content": ""}

    def delta(self, text: str | None) -> dict:
        return {} if text is None else {"content": text}

    def chunk(self, delta, finish_reason, include_usage: bool) -> dict:
        out = {**self.base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                         "finish_reason": finish_reason}]}
        if include_usage:
            out["usage"] = None
        return out


class _CompletionChunks(_ChatChunks):
    def __init__(self, rid: str, req, model: str):
        self.base = {"id": rid, "object": "text_completion", "created": now(), "model": model}

    def head(self):
        return None

    def delta(self, text: str | None) -> str:
        return text or ""

    def chunk(self, text, finish_reason, include_usage: bool) -> dict:
        out = {**self.base, "choices": [{"index": 0, "text": text or "", "logprobs": None,
                                         "finish_reason": finish_reason}]}
        if include_usage:
            out["usage"] = None
        return out


class _Stream(StreamingResponse):
    """A server-sent-event response that aborts its request however the response ends."""

    def __init__(self, body, on_close):
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
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
