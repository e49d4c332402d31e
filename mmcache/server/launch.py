"""Starting a server: the models it serves (built by a caller's ``build``, after the socket is bound), the one
store they share, the engine's host, the generation services, the app, and uvicorn on that socket.

``start_server`` runs uvicorn in a background thread (tests, benchmarks, ``mmcache serve`` alike) and returns
once the socket is bound and the server started; leaving the block stops accepting, stops the step loop and
aborts what is still live (a stream then ends with finish reason ``abort``), stops the generation workers (what
waits fails, what runs stops at its next step), and joins every thread: nothing holds a page or a store entry
afterwards. The socket is bound before uvicorn starts, so port 0 gives a free port with no race between choosing
it and binding it.

One store for everything: a VLM's own store when the chat model is a VLM, else a store of ``store_bytes`` when
a diffusion or voice pipeline is served (a text-only chat server has none).
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from contextlib import contextmanager
from collections.abc import Callable
from dataclasses import dataclass, field

from .config import ServerConfig, ServerConfigError, source_name
from .connections import guarded_protocol, raise_fd_limit
from .engine_host import EngineHost

_START_TIMEOUT_S = 60
IMAGES, VIDEOS, SPEECH = "images", "videos", "speech"


@dataclass
class Models:
    """What a server serves, built: ``engine`` (an ``Engine``, a ``VLMEngine`` or None) and ``pipelines``, a list
    of (task, source, pipeline) with task ``images`` (an SD3 pipeline), ``videos`` (Wan) or ``speech`` (an
    ``encoders.voice.VoicePipeline``) and source the preset name or folder it came from."""

    engine: object = None
    pipelines: list = field(default_factory=list)


def shared_store(config: ServerConfig, models: Models):
    """The one encoder-output store of the server (module docstring)."""
    from ..store import EncoderOutputStore

    engine = models.engine
    if engine is not None and hasattr(engine, "builder"):  # a VLMEngine: its vision tower's store
        return engine.store
    if models.pipelines:
        return EncoderOutputStore(config.store_bytes)
    return None


@dataclass
class RunningServer:
    """A started server: ``url`` (``http://HOST:PORT``), ``base_url`` (``url + "/v1"``, for OpenAI clients),
    ``host`` (the ``EngineHost``, None without a chat model; ``host.engine`` is the engine), ``app``,
    ``metrics``, ``store`` (the shared encoder-output store, or None) and ``services`` (task -> service:
    ``images`` an ``images.ImageService``, ``speech`` a ``speech.SpeechService``, ``videos`` a
    ``videos.VideoService``)."""

    url: str
    base_url: str
    host: EngineHost | None
    app: object
    metrics: object
    config: ServerConfig
    store: object = None
    services: dict = field(default_factory=dict)


def build_services(config: ServerConfig, pipelines: list, store, tenants, metrics) -> tuple[dict, list]:
    """The generation services of ``pipelines`` (task -> service) and their routers; on failure, those built
    are closed."""
    services: dict = {}
    routers: list = []
    try:
        for task, source, pipe in pipelines:
            if task in services:
                raise ServerConfigError(f"two pipelines serve {task}; give at most one of each")
            service, router = _SERVICE_BUILDERS[task](pipe, store, config, source, tenants, metrics)
            services[task] = service
            routers.append(router)
    except BaseException:
        for service in services.values():
            service.close()
        raise
    return services, routers


def _images(pipe, store, config, source, tenants, metrics):
    from .images import ImageService, image_router

    service = ImageService(pipe, store, config, source_name(source), tenants.share(config.max_generation_waiting))
    return _on_queue(service, image_router, config, tenants, metrics)


def _speech(voice, store, config, source, tenants, metrics):
    from .speech import SpeechService, speech_router

    service = SpeechService(voice, store, config, source_name(source), tenants.share(config.max_generation_waiting))
    return _on_queue(service, speech_router, config, tenants, metrics)


def _on_queue(service, router, config, tenants, metrics):
    """``service`` (whose requests wait on its ``queue``, watched by /metrics) and its ``router``."""
    from .intake import Intake

    metrics.watch_queue(service.task, service.name, service.queue)
    return service, router(service, Intake(config, tenants), metrics)


def _videos(pipe, store, config, source, tenants, metrics):
    from .videos import build_service

    return build_service(pipe, store, config, source, tenants, metrics)


# each task's builder: (pipe, store, config, source, tenants, metrics) -> (service, router); a task's route
# module is imported only when it is served (its pipeline's libraries load with it)
_SERVICE_BUILDERS = {IMAGES: _images, SPEECH: _speech, VIDEOS: _videos}


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit this: without it each small response waits on Nagle's algorithm for the
    # client's delayed ACK (about 40 ms per request on Linux); uvicorn sets it only on sockets it binds itself.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.setblocking(False)
    return sock


@dataclass
class _Assembled:
    """Everything a server runs, built, before anything is started."""

    host: EngineHost | None
    app: object
    metrics: object
    store: object
    services: dict
    server: object  # a uvicorn.Server


def _assemble(config: ServerConfig, build: Callable[[ServerConfig], Models]) -> _Assembled:
    """Build the models, the host, the store, the services and the app; on failure, the services built are
    closed again."""
    import uvicorn

    from .app import build_app
    from .metrics import ServerMetrics
    from .tenants import Tenants

    models = build(config)
    tenants = Tenants(config.api_keys, config.tenant_secret)
    share = config.max_waiting_per_tenant or tenants.share(config.max_waiting)
    host = EngineHost(models.engine, config.max_waiting, owner_share=share) if models.engine is not None else None
    store = shared_store(config, models)
    metrics = ServerMetrics(host, config.model_name, store)
    if host is not None:
        host.observe = metrics.observe
    services, routers = build_services(config, models.pipelines, store, tenants, metrics)
    try:
        app = build_app(host, config, tenants, metrics, routers, services.values())
        # httptools (C) parses HTTP where uvicorn's default would be h11 (pure Python): a 1 MB request body of
        # data URLs reaches its handler about 1 ms sooner (benchmarks/RESULTS.md, Serving); the guarded protocol
        # adds read deadlines and the connection cap (connections.py)
        limits = dataclasses.replace(config.connection_limits,
                                     max_connections=raise_fd_limit(config.max_connections))
        protocol = guarded_protocol(limits, lambda: metrics.error("too_many_connections"), metrics.timed_out)
        server = uvicorn.Server(uvicorn.Config(app, http=protocol, log_level=config.log_level, access_log=False,
                                               lifespan="off", timeout_graceful_shutdown=5))
    except BaseException:
        for service in services.values():
            service.close()
        raise
    return _Assembled(host, app, metrics, store, services, server)


def _wait_started(server, thread: threading.Thread, url: str) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start on {url}")
        time.sleep(0.01)


def _shut_down(parts: _Assembled, thread: threading.Thread, sock: socket.socket) -> None:
    """Stop accepting, abort what is live (its handlers end now instead of holding uvicorn's shutdown), stop
    the services (what waits fails, what runs stops at its next step), join uvicorn, then abort what was
    submitted meanwhile."""
    parts.server.should_exit = True
    if parts.host is not None:
        parts.host.stop()
    for service in parts.services.values():
        service.close()
    thread.join()
    if parts.host is not None:
        parts.host.stop()
    parts.app.state.api.close()
    sock.close()


@contextmanager
def start_server(config: ServerConfig, build: Callable[[ServerConfig], Models]):
    """Serve what ``build(config)`` returns, under ``config``'s settings, until the block ends (the command line
    and ``mmcache.presets.serve`` build from the names in ``config``; a test may hand over a built engine)."""
    sock = _bind(config.host, config.port)  # first: a taken address fails before the model is built
    try:
        parts = _assemble(config, build)
    except BaseException:
        sock.close()
        raise
    shown = f"[{config.host}]" if ":" in config.host else config.host
    url = f"http://{shown}:{sock.getsockname()[1]}"
    if parts.host is not None:
        parts.host.start()
    thread = threading.Thread(target=parts.server.run, kwargs={"sockets": [sock]}, name="mmcache-uvicorn",
                              daemon=True)
    thread.start()
    try:
        _wait_started(parts.server, thread, url)
        yield RunningServer(url, url + "/v1", parts.host, parts.app, parts.metrics, config, parts.store,
                            parts.services)
    finally:
        _shut_down(parts, thread, sock)
