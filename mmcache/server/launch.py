"""Starting a server: the engine built from a ``ServerConfig``, its host, the app, and uvicorn on a bound socket.

``start_server`` runs uvicorn in a background thread (tests, benchmarks, ``mmcache serve`` alike) and returns
once the socket is bound and the server started; leaving the block stops accepting, stops the step loop and
aborts what is still live (a stream then ends with finish reason ``abort``), and joins both threads: the
engine holds no request afterwards. The socket is bound before uvicorn starts, so port 0 gives a free
port with no race between choosing it and binding it.
"""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, fields

from .config import ServerConfig
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
    """An ``Engine`` (text preset or local folder) or a ``VLMEngine`` (VLM preset) as ``config`` names."""
    from ..engine.config import EngineConfig
    from ..engine.engine import Engine
    from ..engine.vlm_presets import VLM_PRESETS

    engine_config = config.engine_config or EngineConfig(page_size=16)
    if config.preset in VLM_PRESETS:
        from ..engine.vlm import VLMEngine

        return VLMEngine.from_preset(config.preset, engine_config, config.dtype, config.store_bytes,
                                     image_limits(config))
    if config.preset is not None:
        return Engine.from_preset(config.preset, config.dtype, engine_config)
    return Engine.from_pretrained(config.model, config.dtype, engine_config)


@dataclass
class RunningServer:
    """A started server: ``url`` (``http://HOST:PORT``), ``base_url`` (``url + "/v1"``, for OpenAI clients),
    ``host`` (the ``EngineHost``; ``host.engine`` is the engine), ``app`` and ``metrics``."""

    url: str
    base_url: str
    host: EngineHost
    app: object
    metrics: object
    config: ServerConfig


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
    try:
        engine = engine if engine is not None else build_engine(config)
        host = EngineHost(engine, config.max_waiting)
        metrics = ServerMetrics(host, config.model_name)
        host.observe = metrics.observe
        app = build_app(host, config, Tenants(config.api_keys, config.tenant_secret), metrics)
        server = uvicorn.Server(uvicorn.Config(app, log_level=config.log_level, access_log=False, lifespan="off",
                                               timeout_graceful_shutdown=5))
    except BaseException:
        sock.close()
        raise
    shown = f"[{config.host}]" if ":" in config.host else config.host
    url = f"http://{shown}:{sock.getsockname()[1]}"
    host.start()
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="mmcache-uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {url}")
            time.sleep(0.01)
        yield RunningServer(url, url + "/v1", host, app, metrics, config)
    finally:
        server.should_exit = True  # stop accepting
        host.stop()  # abort what is live: its handlers end now instead of holding uvicorn's shutdown
        thread.join()
        host.stop()  # and what was submitted meanwhile
        sock.close()
