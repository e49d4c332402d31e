"""``mmcache serve --replicas N``: the Ray Serve application in the foreground (``launch.start_replicas``),
until Ctrl-C or SIGTERM, then deleted (and the local Ray instance stopped, when the command started one)."""

from __future__ import annotations

import signal
import sys
import threading

from ..server.config import ServerConfigError
from .launch import ReplicaOptions, ray_missing


def serve_replicas(args, config) -> int:
    missing = ray_missing()
    if missing is not None:
        print(f"mmcache serve: {missing}", file=sys.stderr)
        return 2
    try:
        options = ReplicaOptions(args.replicas, args.ray_address, args.router, args.route_depth_tokens,
                                 replica_cpus=args.replica_cpus)
    except ServerConfigError as e:
        print(f"mmcache serve: {e}", file=sys.stderr)
        return 2
    from ..presets.serving import build_models
    from ..server.cli import wait_until_stopped
    from .launch import start_replicas

    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        with start_replicas(config, options, build_models) as srv:
            print(f"mmcache serve: {', '.join(config.model_names)} at {srv.url} (OpenAI API: {srv.base_url}), "
                  f"{options.replicas} engine replicas on Ray Serve, router {options.router}", flush=True)
            wait_until_stopped(stop)
    except RuntimeError as e:  # Ray Serve could not deploy the application (a replica failed to start)
        print(f"mmcache serve: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0
