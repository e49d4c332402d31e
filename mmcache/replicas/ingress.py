"""The ingress deployment of the Ray Serve application: the same FastAPI app as ``mmcache serve`` (``build_app``:
every route, tenants, error objects, streams, disconnect aborts), over a ``RemoteHost`` instead of an
``EngineHost``. It renders prompts and computes each request's routing key once; the engine replicas run the
model. The image, speech and video services the config names run here, in the ingress's process, as in the
single-process server (one copy: only the chat engine is replicated).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses

from ..server.app import build_app
from ..server.launch import build_services, shared_store
from ..server.metrics import ServerMetrics
from ..server.tenants import Tenants
from .remote_host import RemoteHost
from .routing import RoutingKey


@dataclasses.dataclass(frozen=True)
class IngressOptions:
    """``deployment``: the engine deployment's name (its router records the live replicas under it);
    ``route_depth_tokens``: the routing key's depth; ``text_prompts``: send prompts' text (prefix-text router)."""

    deployment: str
    route_depth_tokens: int
    text_prompts: bool


class Ingress:
    """The ingress deployment's class (Ray Serve wraps it with ``serve.ingress()``): ``engine`` is the engine
    deployment's handle, ``build(config)`` the models of the services it runs itself."""

    async def __init__(self, engine, config, options: IngressOptions, build):
        description = await engine.describe.remote()
        key = RoutingKey(config.chat_model_name, description.page_size, options.route_depth_tokens,
                         copy.deepcopy(description.tokenizer), description.template)
        tenants = Tenants(config.api_keys, config.tenant_secret)
        share = config.max_waiting_per_tenant or tenants.share(config.max_waiting)
        self.body_timeout_s = config.body_timeout_s
        self.host = RemoteHost(engine, description, options.deployment, config, key, share, options.text_prompts)
        models = None
        if config.diffusion or config.tts:
            models = build(dataclasses.replace(config, preset=None, model=None, chat_template=None))
        store = shared_store(config, models) if models is not None else None
        self.metrics = ServerMetrics(None, config.model_name, store)
        self.services, routers = build_services(config, models.pipelines if models else [], store, tenants,
                                                self.metrics)
        self.fastapi = build_app(self.host, config, tenants, self.metrics, routers, self.services.values())

    def __serve_build_asgi_app__(self):
        return _DisconnectOnCancel(self.fastapi, self.body_timeout_s)

    def __del__(self):
        for service in getattr(self, "services", {}).values():
            service.close()
        host = getattr(self, "host", None)
        if host is not None:
            host.stop()


class _DisconnectOnCancel:
    """The app with Ray Serve's cancellation of a request's receive (its client went away) read as the ASGI
    disconnect message the app handles (a 499, the request aborted), not as a failure of the app; and a body that
    pauses longer than ``body_timeout_s`` between chunks read as a disconnect too, as the single server's
    connection guard closes it (Ray's proxy has no such bound)."""

    def __init__(self, app, body_timeout_s: float):
        self.app = app
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope, receive, send):
        from ray.exceptions import TaskCancelledError

        body_done = scope.get("type") != "http"

        async def receive_or_disconnect():
            nonlocal body_done
            try:
                if body_done:
                    return await receive()
                message = await asyncio.wait_for(receive(), self.body_timeout_s)
            except TaskCancelledError:
                return {"type": "http.disconnect"}
            except asyncio.TimeoutError:
                return {"type": "http.disconnect"}
            if message.get("type") != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        await self.app(scope, receive_or_disconnect, send)
