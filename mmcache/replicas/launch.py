"""Starting the Ray Serve application of ``mmcache serve --replicas N``: an ingress (one replica, no CPU
reserved) and an engine deployment of N replicas, routed by the router ``--router`` names.

``start_replicas`` connects to the cluster at ``ray_address``, or starts a local Ray instance on this machine
(stopped again when the block ends), starts Ray Serve's HTTP proxy on the config's host and port, deploys the
application and waits until every replica is up. Leaving the block deletes the application: its replicas
stop, and each engine replica's host aborts what it still holds. On a cluster where Ray Serve already runs, its
proxies keep the address they were started with, and the application is served there (a log line says so); one
cluster serves one mmcache application (a second deployment replaces the first).

A local instance is told it has at least as many CPUs as the replicas ask for, so N replicas start on a
machine with fewer cores (they then share them); on a cluster, each engine replica reserves ``replica_cpus``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from contextlib import contextmanager
from dataclasses import dataclass

from ..server.config import ServerConfig, ServerConfigError

_log = logging.getLogger("mmcache.replicas")
APP_NAME = "mmcache"
ENGINE_DEPLOYMENT = "Engine"
INGRESS_DEPLOYMENT = "Ingress"
HEALTH_CHECK_PERIOD_S = 2.0
ENGINE_START_TIMEOUT_S = 600  # a real model's weights load inside this


@dataclass(frozen=True)
class ReplicaOptions:
    """``replicas``: engine replicas; ``ray_address``: an existing cluster (None: a local instance);
    ``router``: one of ``routing.ROUTERS``; ``route_depth_tokens``: where the routing key's page ends;
    ``load_factor``/``min_load``: mmcache's router's threshold (None: ``RouterConfig``'s defaults);
    ``replica_cpus``: CPUs each engine replica reserves; ``prefix_imbalance``: the prefix-text router's
    ``imbalanced_threshold``, the gap between the longest and the shortest replica queue past which it routes by
    power-of-two choices instead of by its tree (None: the installed Ray's default, which is infinite in Ray 2.60,
    so it never does; Ray's docs name 10)."""

    replicas: int
    ray_address: str | None = None
    router: str = "mmcache"
    route_depth_tokens: int = 2048
    load_factor: float | None = None
    min_load: float | None = None
    replica_cpus: float = 1.0
    prefix_imbalance: float | None = None

    def __post_init__(self):
        from .routing import ROUTERS

        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 1:
            raise ServerConfigError(f"replicas must be a positive int, got {self.replicas!r}")
        if self.router not in ROUTERS:
            raise ServerConfigError(f"router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        if (isinstance(self.route_depth_tokens, bool) or not isinstance(self.route_depth_tokens, int)
                or self.route_depth_tokens < 1):
            raise ServerConfigError(f"route_depth_tokens must be a positive int, got {self.route_depth_tokens!r}")
        if not self.replica_cpus >= 0:
            raise ServerConfigError(f"replica_cpus must be >= 0, got {self.replica_cpus!r}")
        if self.prefix_imbalance is not None:
            if (isinstance(self.prefix_imbalance, bool) or not isinstance(self.prefix_imbalance, (int, float))
                    or not self.prefix_imbalance >= 0):
                raise ServerConfigError(f"prefix_imbalance must be a number >= 0, got {self.prefix_imbalance!r}")
            if self.router != "prefix-text":
                raise ServerConfigError(f"prefix_imbalance sets the prefix-text router's threshold, not "
                                        f"{self.router}'s")


@dataclass
class RunningReplicas:
    """A started application: ``url``, ``base_url`` (``url + "/v1"``), and its config and options."""

    url: str
    base_url: str
    config: ServerConfig
    options: ReplicaOptions


def ray_missing() -> str | None:
    """Why ``--replicas`` cannot run here (Ray Serve is not installed), or None."""
    import importlib.util

    for name in ("ray", "ray.serve"):
        try:
            if importlib.util.find_spec(name) is None:
                raise ImportError(name)
        except ImportError:
            return ("--replicas needs Ray Serve, which is not installed: pip install 'mmcache[ray]' "
                    "(or the test or bench extras, which include it)")
    return None


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _proxy_address() -> tuple[str, int]:
    """Where Ray Serve's HTTP proxies listen (its controller's settings: a Serve started earlier on the cluster
    keeps them, whatever ``serve.start`` was asked)."""
    from ray.serve.context import _get_global_client

    http = _get_global_client().http_config
    return http.host, http.port


def _engine_config(config: ServerConfig):
    from ..server.config import serve_engine_config

    return config.engine_config or serve_engine_config()


def build_application(config: ServerConfig, options: ReplicaOptions, build):
    """The bound application (``build(config)``: the models; the engine replicas build only the chat model)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from .engine_replica import EngineReplica
    from .ingress import Ingress, IngressOptions
    from .ray_routers import ROUTER_CLASSES

    engine_config = _engine_config(config)
    chat_only = dataclasses.replace(config, diffusion=(), tts=None, engine_config=engine_config)
    router_kwargs = {}
    if options.router == "mmcache":
        given = {"load_factor": options.load_factor, "min_load": options.min_load}
        router_kwargs = {k: v for k, v in given.items() if v is not None}
    elif options.router == "prefix-text" and options.prefix_imbalance is not None:
        router_kwargs = {"imbalanced_threshold": float(options.prefix_imbalance)}
    engine = serve.deployment(
        EngineReplica, name=ENGINE_DEPLOYMENT, num_replicas=options.replicas,
        # the ingress bounds the waiting queue; a replica takes what its router sends it
        max_ongoing_requests=config.max_waiting + engine_config.max_num_seqs,
        ray_actor_options={"num_cpus": options.replica_cpus},
        health_check_period_s=HEALTH_CHECK_PERIOD_S, graceful_shutdown_timeout_s=5,
        request_router_config=RequestRouterConfig(request_router_class=ROUTER_CLASSES[options.router],
                                                  request_router_kwargs=router_kwargs),
    ).bind(chat_only, build)
    ingress = serve.deployment(
        serve.ingress()(Ingress), name=INGRESS_DEPLOYMENT, num_replicas=1,
        max_ongoing_requests=max(1000, 4 * config.max_waiting), ray_actor_options={"num_cpus": 0},
        graceful_shutdown_timeout_s=5,
    )
    ingress_options = IngressOptions(ENGINE_DEPLOYMENT, options.route_depth_tokens, options.router == "prefix-text")
    return ingress.bind(engine, config, ingress_options, build)


@contextmanager
def start_replicas(config: ServerConfig, options: ReplicaOptions, build):
    """Serve the application (module docstring) until the block ends; yields ``RunningReplicas``."""
    import ray
    from ray import serve

    root = logging.getLogger()
    kept = (root.level, list(root.handlers))  # Ray and Serve set the root logger to INFO on stderr: put back
    started_ray = False
    if not ray.is_initialized():
        if options.ray_address is None:
            cpus = max(os.cpu_count() or 1, int(options.replicas * options.replica_cpus + 0.999) + 1)
            ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
        else:
            ray.init(address=options.ray_address, log_to_driver=False, configure_logging=False)
        started_ray = True
    try:
        port = config.port or _free_port(config.host)
        serve.start(http_options={"host": config.host, "port": port})
        host, port = _proxy_address()  # a cluster whose Serve already runs keeps its own proxy's address
        if (host, port) != (config.host, port if not config.port else config.port):
            _log.warning("Ray Serve already runs on this cluster: serving at its proxy's %s:%s", host, port)
        serve.run(build_application(config, options, build), name=APP_NAME, route_prefix="/")
        root.setLevel(kept[0])
        root.handlers[:] = kept[1]
        shown = f"[{host}]" if ":" in host else host
        url = f"http://{shown}:{port}"
        try:
            yield RunningReplicas(url, url + "/v1", config, options)
        finally:
            serve.delete(APP_NAME)
    finally:
        if started_ray:
            serve.shutdown()
            ray.shutdown()
