"""Starting a server: the engine and the generation pipelines built from a ``ServerConfig``, the one store they
share, the engine's host, the app, and uvicorn on a bound socket.

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

import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, fields

from .config import ServerConfig, ServerConfigError, source_name
from .runner import EngineHost

_START_TIMEOUT_S = 60


def image_limits(config: ServerConfig):
    """The VLM's image limits: sizes from the config, and paths never read."""
    from encoders.media import ImageLimits

    kw = {"max_bytes": config.max_image_bytes, "max_pixels": config.max_image_pixels, "allow_paths": False}
    if "max_images" in {f.name for f in fields(ImageLimits)}:
        kw["max_images"] = config.max_images
    return ImageLimits(**kw)


def build_engine(config: ServerConfig):
    """An ``Engine`` (text preset or local folder) or a ``VLMEngine`` (VLM preset) as ``config`` names; None
    when it names no chat model."""
    from ..engine.config import EngineConfig
    from ..engine.engine import Engine
    from ..engine.vlm_presets import VLM_PRESETS

    if not config.serves_chat:
        return None
    engine_config = config.engine_config or EngineConfig(page_size=16)
    if config.preset in VLM_PRESETS:
        from ..engine.vlm import VLMEngine

        return VLMEngine.from_preset(config.preset, engine_config, config.dtype, config.store_bytes,
                                     image_limits(config))
    if config.preset is not None:
        return Engine.from_preset(config.preset, config.dtype, engine_config)
    return Engine.from_pretrained(config.model, config.dtype, engine_config)


def shared_store(config: ServerConfig, engine):
    """The one encoder-output store of the server (module docstring)."""
    from ..store import EncoderOutputStore

    if engine is not None and hasattr(engine, "builder"):  # a VLMEngine: its vision tower's store
        return engine.store
    if config.diffusion or config.tts:
        return EncoderOutputStore(config.store_bytes)
    return None


@dataclass
class RunningServer:
    """A started server: ``url`` (``http://HOST:PORT``), ``base_url`` (``url + "/v1"``, for OpenAI clients),
    ``host`` (the ``EngineHost``, None without a chat model; ``host.engine`` is the engine), ``app``,
    ``metrics``, ``store`` (the shared encoder-output store, or None) and ``services`` (task -> service:
    ``images`` an ``ImageService``, ``speech`` a ``SpeechService``, ``videos`` a ``VideoService``)."""

    url: str
    base_url: str
    host: EngineHost | None
    app: object
    metrics: object
    config: ServerConfig
    store: object = None
    services: dict = field(default_factory=dict)


@dataclass
class VideoService:
    """The video jobs of a Wan pipeline, as /v1/models and /health see them."""

    name: str
    jobs: object  # a video_jobs.VideoJobs
    task: str = "videos"

    @property
    def alive(self) -> bool:
        return self.jobs.alive

    def close(self) -> None:
        self.jobs.close()


def build_services(config: ServerConfig, store, tenants, metrics) -> tuple[dict, list]:
    """The generation services ``config`` names (task -> service) and their routers; on failure, those built
    are closed."""
    services: dict = {}
    routers: list = []
    try:
        for source in config.diffusion:
            from .pipelines import load_diffusion

            task, pipe = load_diffusion(source, config.dtype)
            if task in services:
                raise ServerConfigError(f"two diffusion pipelines serve {task}; give at most one of each")
            service, router = _SERVICE_BUILDERS[task](pipe, store, config, source, tenants, metrics)
            services[task] = service
            routers.append(router)
        if config.tts is not None:
            from .pipelines import load_tts

            service, router = _speech(load_tts(config.tts, config.dtype), store, config, source_name(config.tts),
                                      tenants, metrics)
            services["speech"] = service
            routers.append(router)
    except BaseException:
        for service in services.values():
            service.close()
        raise
    return services, routers


def _images(pipe, store, config, source, tenants, metrics):
    from .images import ImageService, image_router
    from .intake import Intake

    name = source_name(source)
    service = ImageService(pipe, store, config, name)
    metrics.watch_queue("images", name, service.queue)
    return service, image_router(service, Intake(config, tenants), metrics)


def _speech(voice, store, config, name, tenants, metrics):
    from .intake import Intake
    from .speech import SpeechService, speech_router

    service = SpeechService(voice, store, config, name)
    metrics.watch_queue("speech", name, service.queue)
    return service, speech_router(service, Intake(config, tenants), metrics)


def _videos(pipe, store, config, source, tenants, metrics):
    from encoders.diffusion import CachedWanPipeline

    from .images import NEGATIVE_KIND, TEXT_ENCODER_KIND
    from .video_jobs import VideoJobs
    from .video_render import WanRenderer
    from .videos import VideoLimits, video_router

    wrapper = CachedWanPipeline(pipe, store, prompt_kind=TEXT_ENCODER_KIND, negative_kind=NEGATIVE_KIND)
    jobs = VideoJobs(WanRenderer(wrapper), max_jobs=config.max_video_jobs, max_pending=config.max_generation_waiting,
                     max_bytes=config.max_video_bytes)
    limits = config.video_limits or (VideoLimits(**TINY_WAN_DEFAULTS) if source == "tiny-wan" else VideoLimits())
    router = video_router(jobs, tenants, metrics.registry, model_name=source_name(source), limits=limits,
                          max_body_bytes=config.max_body_bytes,
                          max_cache_salt=config.max_cache_salt, retry_after_s=config.retry_after_s)
    return VideoService(source_name(source), jobs), router


_SERVICE_BUILDERS = {"images": _images, "videos": _videos}
# what a video request leaving fields out gets from the tiny preset: a size and length it renders in a second
TINY_WAN_DEFAULTS = {"default_width": 32, "default_height": 32, "default_frames": 5, "default_steps": 4}


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


@contextmanager
def start_server(config: ServerConfig, engine=None):
    """Serve ``config`` (or the given ``engine``, built from ``config`` when None) until the block ends."""
    import uvicorn

    from .app import build_app
    from .metrics import ServerMetrics
    from .tenants import Tenants

    sock = _bind(config.host, config.port)  # first: a taken address fails before the model is built
    services: dict = {}
    try:
        engine = engine if engine is not None else build_engine(config)
        host = EngineHost(engine, config.max_waiting) if engine is not None else None
        store = shared_store(config, engine)
        metrics = ServerMetrics(host, config.model_name, store)
        if host is not None:
            host.observe = metrics.observe
        tenants = Tenants(config.api_keys, config.tenant_secret)
        services, routers = build_services(config, store, tenants, metrics)
        app = build_app(host, config, tenants, metrics, routers, services.values())
        server = uvicorn.Server(uvicorn.Config(app, log_level=config.log_level, access_log=False, lifespan="off",
                                               timeout_graceful_shutdown=5))
    except BaseException:
        for service in services.values():
            service.close()
        sock.close()
        raise
    shown = f"[{config.host}]" if ":" in config.host else config.host
    url = f"http://{shown}:{sock.getsockname()[1]}"
    if host is not None:
        host.start()
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="mmcache-uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {url}")
            time.sleep(0.01)
        yield RunningServer(url, url + "/v1", host, app, metrics, config, store, services)
    finally:
        server.should_exit = True  # stop accepting
        if host is not None:
            host.stop()  # abort what is live: its handlers end now instead of holding uvicorn's shutdown
        for service in services.values():
            service.close()  # what waits fails, what runs stops at its next step
        thread.join()
        if host is not None:
            host.stop()  # and what was submitted meanwhile
        sock.close()
