"""``mmcache serve``: the OpenAI-compatible server in the foreground.

    mmcache serve (--preset NAME | --model DIR) [--host 127.0.0.1] [--port 8000] [--api-key KEY ...]
                  [--served-model-name NAME] [--max-waiting N] [--page-size N] [--num-pages N]
                  [--max-num-seqs N] [--store-bytes N] [--dtype D] [--cache-mode on|off]

Binds the loopback address unless ``--host`` says otherwise, prints the URL it serves once it accepts
connections (``/health`` answers from then on), and runs until interrupted (Ctrl-C or SIGTERM), when it stops
accepting, aborts what is still running and exits 0.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from ..cli import count
from ..engine.models import DTYPES
from ..engine.presets import PRESETS
from ..engine.vlm_presets import VLM_PRESETS


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description="Serve a text or VLM preset, or a local Hugging Face folder, over an "
                                   "OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models, "
                                   "/health, /metrics).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", choices=list(PRESETS) + list(VLM_PRESETS))
    src.add_argument("--model", metavar="DIR", help="a local Hugging Face folder of a text model")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=count(65535, 0), default=8000, help="0: a free port")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="require this key (Authorization: Bearer KEY); give it several times for several "
                        "tenants, each with its own cache")
    p.add_argument("--served-model-name", metavar="NAME", help="the model name clients send (default: the "
                                                                "preset or folder name)")
    p.add_argument("--max-waiting", type=count(minimum=0), default=256,
                   help="requests waiting to start beyond which a request gets 503 (default 256)")
    p.add_argument("--page-size", type=count(), default=16, help="tokens per KV page (default 16)")
    p.add_argument("--num-pages", type=count(), default=None, help="KV pages per pool (default: from 1 GiB)")
    p.add_argument("--max-num-seqs", type=count(), default=64, help="requests decoded together (default 64)")
    p.add_argument("--store-bytes", type=count(), default=256 * 2**20,
                   help="encoder-output store budget in bytes (VLM presets; default 256 MiB)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                   help="default: float32 for presets, bfloat16 for --model")
    p.add_argument("--cache-mode", default="on", choices=["on", "off"])
    p.set_defaults(func=serve_main)


def config_from_args(args: argparse.Namespace):
    from ..engine.config import EngineConfig
    from .config import ServerConfig

    engine_config = EngineConfig(page_size=args.page_size, num_pages=args.num_pages,
                                 max_num_seqs=args.max_num_seqs, cache_mode=args.cache_mode)
    return ServerConfig(preset=args.preset, model=args.model, host=args.host, port=args.port,
                        api_keys=tuple(args.api_key), served_model_name=args.served_model_name,
                        max_waiting=args.max_waiting, engine_config=engine_config, store_bytes=args.store_bytes,
                        dtype=args.dtype or ("float32" if args.preset else "bfloat16"))


def serve_main(args: argparse.Namespace) -> int:
    from .launch import start_server

    config = config_from_args(args)
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        with start_server(config) as srv:
            print(f"mmcache serve: {config.model_name} at {srv.url} (OpenAI API: {srv.base_url})", flush=True)
            try:
                while not stop.wait(0.5):
                    pass
            except KeyboardInterrupt:
                pass
            print("mmcache serve: stopping", file=sys.stderr, flush=True)
    except OSError as e:  # the address is taken or cannot be bound
        print(f"mmcache serve: cannot serve on {config.host}:{config.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0
