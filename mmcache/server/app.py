"""The FastAPI application, assembled: error handlers, the routers of the chat routes (``chat``, with a chat
model) and of the image, speech and video services (``images``, ``speech``, ``videos``), ``GET /v1/models``
(these need an API key when keys are configured), ``GET /health`` (200 while the step loop and every generation
queue run), ``GET /metrics`` (Prometheus text; open, as vLLM's is, unless ``metrics_key`` is set: it shows every
tenant's volume together, never a key, a prompt or an output).

Rules:

* A request is checked in this order: key (401), body size (413), JSON (400), fields (400, naming the field),
  model (404) (``intake``), then what its route checks (``chat``, ``images``, ``speech``, ``videos``).
* Every error, including FastAPI's and pydantic's own and unknown routes, is an OpenAI error object, and is
  counted in ``mmcache:request_errors_total`` by its code.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from .chat import ChatRoutes
from .engine_host import EngineHost
from .errors import APIError, internal, route_not_found, unauthorized
from .intake import Intake, from_validation
from .metrics import ServerMetrics
from .protocol import model_card, now
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

    if api.chat is not None:
        app.include_router(api.chat.router())
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
        self.metrics = metrics
        self.services = list(services)
        self.intake = Intake(config, tenants)
        self.chat = ChatRoutes(host, config, self.intake, metrics) if host is not None else None
        self.created = now()

    def error_response(self, err: APIError) -> JSONResponse:
        self.metrics.error(err.code or err.type)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

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
        text = self.metrics.render()
        if self.host is not None:
            text = await self.host.merge_metrics(text)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    def close(self) -> None:
        if self.chat is not None:
            self.chat.close()
