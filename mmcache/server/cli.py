"""``mmcache serve``: the OpenAI-compatible server in the foreground.

    mmcache serve [--preset NAME | --model DIR] [--chat-template FILE] [--diffusion PRESET_OR_DIR ...]
                  [--tts PRESET_OR_DIR]
                  [--host 127.0.0.1] [--port 8000] [--api-key KEY ...] [--served-model-name NAME]
                  [--max-waiting N] [--page-size N] [--num-pages N] [--max-num-seqs N] [--store-bytes N]
                  [--max-num-batched-tokens N] [--prefill-chunk-tokens N] [--mixed-prefill-tokens N]
                  [--dtype D] [--cache-mode on|off] [image, speech and video limits]
                  [--host-tier-bytes N] [--disk-tier-bytes N --disk-tier-dir DIR] [--preempt-tier-bytes N]
                  [--replicas N [--ray-address ADDR] [--router mmcache|power-of-two|prefix-text]
                   [--route-depth-tokens N] [--replica-cpus C]]
                  [--tensor-parallel-size N [--tensor-parallel-timeout S]]

At least one of ``--preset`` / ``--model`` (chat), ``--diffusion`` (images, videos) and ``--tts`` (speech) is
given; every model shares one encoder-output store of ``--store-bytes``. The chat engine runs the server's
schedule (``config.serve_engine_config``): a step that decodes prefills at most ``--mixed-prefill-tokens``.

Binds the loopback address unless ``--host`` says otherwise, prints the URL it serves once it accepts
connections (``/health`` answers from then on), and runs until interrupted (Ctrl-C or SIGTERM), when it stops
accepting, aborts what is still running and exits 0.

With ``--replicas N`` the same API is served by a Ray Serve application (``mmcache.replicas``): an ingress and N
engine replicas, on a local Ray instance the command starts and stops, or on the cluster at ``--ray-address``.
Without Ray installed, ``--replicas`` fails with a message naming the ``ray`` extra.

With ``--tensor-parallel-size N`` the chat model is split over N ranks (``mmcache.presets.ranks``): this process is
rank 0 and serves HTTP; it starts ranks 1 .. N-1 as child processes on this machine, which follow its steps. When
the group fails (a rank died or stopped answering for ``--tensor-parallel-timeout`` seconds) every request gets
503 and the command exits 1, so that a supervisor starts the group again.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from ..cli import count
from ..errors import MmcacheError
from ..engine.models import DTYPES
from ..presets.serving import DIFFUSION_PRESETS, TTS_PRESETS
from ..presets.text import PRESETS
from ..presets.vlm import VLM_PRESETS
from .config import (DEFAULT_STORE_BYTES, SERVE_MAX_TOKENS_PER_STEP, SERVE_MIXED_PREFILL_TOKENS, SERVE_PAGE_SIZE,
                     ServerConfigError)


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve models over an OpenAI-compatible HTTP API",
                       description="Serve a text or VLM chat model, diffusion pipelines and a voice-cloning "
                                   "pipeline (presets or local folders) over an OpenAI-compatible API "
                                   "(/v1/chat/completions, /v1/completions, /v1/images/generations, /v1/videos, "
                                   "/v1/audio/speech, /v1/models, /health, /metrics).")
    _add_models(p)
    _add_listener(p)
    _add_engine_options(p)
    _add_chat_bounds(p.add_argument_group("bounds of chat requests and connections"))
    _add_generation_limits(p.add_argument_group("image, speech and video requests"))
    _add_replicas(p.add_argument_group("replicas on Ray Serve (the ray extra)"))
    _add_tiers(p.add_argument_group("a second tier for evicted KV pages (host memory, local disk)"))
    _add_tensor_parallel(p.add_argument_group("tensor parallelism (torch.distributed, gloo)"))
    p.set_defaults(func=serve_main)


def _add_tensor_parallel(g) -> None:
    g.add_argument("--tensor-parallel-size", type=count(64), default=1, metavar="N",
                   help="split the chat model's attention heads and MLP over N ranks, processes on this machine "
                        "(default 1: no split)")
    g.add_argument("--tensor-parallel-timeout", type=_between(1, 3600, " seconds"), default=60.0, metavar="S",
                   help="a rank that does not answer within S seconds fails the group: requests get 503 and the "
                        "command exits 1 (default 60)")


def _between(low: float, high: float, unit: str = ""):
    """An argparse type: a number from ``low`` to ``high``."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low:g} and {high:g}{unit}, got {text}")
        return value

    return parse


def _add_replicas(g) -> None:
    from ..replicas.routing import ROUTERS

    g.add_argument("--replicas", type=count(1024), default=None, metavar="N",
                   help="serve the chat model from N engine replicas on Ray Serve (default: one process, no Ray)")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="the Ray cluster to deploy on (host:port of `ray start --head`); default: a local Ray "
                        "instance started and stopped by this command")
    g.add_argument("--router", choices=ROUTERS, default="mmcache",
                   help="how requests choose a replica: mmcache's prefix affinity on page names (default), Ray "
                        "Serve's power-of-two choices, or Ray Serve LLM's prefix-text router")
    g.add_argument("--route-depth-tokens", type=count(), default=2048, metavar="N",
                   help="mmcache's router keys on the page ending at this token (a shorter prompt: its first "
                        "page; default 2048)")
    g.add_argument("--replica-cpus", type=_between(0, 1024), default=1.0, metavar="C",
                   help="CPUs each engine replica reserves in Ray (default 1)")


def _add_tiers(g) -> None:
    """Adds the budgets of the chat pool's second tier (``mmcache.tier``) to the argument group ``g``."""
    g.add_argument("--host-tier-bytes", type=count(minimum=0), default=0, metavar="N",
                   help="host memory for KV pages evicted from the chat pool, read back in on a later hit "
                        "(default 0: none)")
    g.add_argument("--disk-tier-bytes", type=count(minimum=0), default=0, metavar="N",
                   help="local disk for pages evicted from the host tier (default 0: none; needs --disk-tier-dir)")
    g.add_argument("--disk-tier-dir", default=None, metavar="DIR",
                   help="where the disk tier's file is kept, in a directory of its own that only this user can "
                        "read, removed at exit")
    g.add_argument("--preempt-tier-bytes", type=count(minimum=0), default=0, metavar="N",
                   help="host memory kept for the pages of preempted requests, which cached pages cannot take "
                        "(default 0: they share --host-tier-bytes)")


def _with_tiers(engine_config, args: argparse.Namespace):
    """``engine_config`` with the tier budgets of ``args`` (``ServerConfigError`` for a bad combination)."""
    from ..engine.config import EngineConfigError
    from .config import tiered_engine_config

    try:
        return tiered_engine_config(engine_config, args.host_tier_bytes, args.disk_tier_bytes, args.disk_tier_dir,
                                    args.preempt_tier_bytes)
    except EngineConfigError as e:
        raise ServerConfigError(str(e)) from None


def _add_models(p: argparse.ArgumentParser) -> None:
    """Adds the options naming what is served: a chat model (preset or folder), diffusion pipelines, a voice."""
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=list(PRESETS) + list(VLM_PRESETS))
    src.add_argument("--model", metavar="DIR",
                     help="a local Hugging Face folder: a text model, or a LLaVA or Qwen2-VL model")
    p.add_argument("--chat-template", metavar="FILE",
                   help="a Jinja chat template (a .jinja file, or JSON holding chat_template) to render chats with "
                        "in place of the model's own")
    p.add_argument("--diffusion", action="append", default=[], metavar="PRESET_OR_DIR",
                   help=f"a diffusion pipeline: {', '.join(DIFFUSION_PRESETS)} or a local diffusers folder "
                        f"(SD3 family: /v1/images/generations; Wan: /v1/videos); give it once per task")
    p.add_argument("--tts", metavar="PRESET_OR_DIR",
                   help=f"a voice-cloning pipeline for /v1/audio/speech: {', '.join(TTS_PRESETS)} or a local CSM "
                        f"folder")


def _add_listener(p: argparse.ArgumentParser) -> None:
    """Adds the options of the HTTP side: address, keys (tenants), the served name, the waiting bound."""
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=count(65535, 0), default=8000, help="0: a free port")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="require this key (Authorization: Bearer KEY); give it several times for several "
                        "tenants, each with its own cache")
    p.add_argument("--served-model-name", metavar="NAME", help="the model name clients send (default: the "
                                                                "preset or folder name)")
    p.add_argument("--max-waiting", type=count(minimum=0), default=256,
                   help="requests waiting to start beyond which a request gets 503 (default 256)")


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    """Adds the chat engine's options: KV pages, the step's schedule, the store's budget, dtype, cache mode."""
    p.add_argument("--page-size", type=count(), default=SERVE_PAGE_SIZE,
                   help=f"tokens per KV page (default {SERVE_PAGE_SIZE})")
    p.add_argument("--num-pages", type=count(), default=None, help="KV pages per pool (default: from 1 GiB)")
    p.add_argument("--max-num-seqs", type=count(), default=64, help="requests decoded together (default 64)")
    p.add_argument("--max-num-batched-tokens", type=count(), default=SERVE_MAX_TOKENS_PER_STEP, metavar="N",
                   help=f"tokens of one engine step, prefill and decode together "
                        f"(default {SERVE_MAX_TOKENS_PER_STEP})")
    p.add_argument("--prefill-chunk-tokens", type=count(), default=None, metavar="N",
                   help="tokens of a prompt prefilled in one step, a multiple of --page-size (default: the largest "
                        "multiple up to 2048)")
    p.add_argument("--mixed-prefill-tokens", type=count(), default=None, metavar="N",
                   help=f"prompt tokens, all requests together, of a step that also decodes, a multiple of "
                        f"--page-size (default {SERVE_MIXED_PREFILL_TOKENS}, or the chunk when smaller): each adds "
                        f"to the time of every decoding request's next token")
    p.add_argument("--store-bytes", type=count(), default=DEFAULT_STORE_BYTES,
                   help="the encoder-output store's budget in bytes, shared by every model (default 256 MiB)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                   help="default: float32 when every model is a preset, else bfloat16 (presets stay float32)")
    p.add_argument("--cache-mode", default="on", choices=["on", "off"])


def _add_chat_bounds(g) -> None:
    """Adds the bounds checked before a chat request's work is done, and the connections' own, to the group
    ``g``: its tenant's share of the queue, its text, its stop strings and images, header and body deadlines,
    the connection cap, and the key of /metrics."""
    g.add_argument("--max-waiting-per-tenant", type=count(), default=None, metavar="N",
                   help="a tenant's part of --max-waiting (default: an equal part for each --api-key)")
    g.add_argument("--max-prompt-chars", type=count(), default=None, metavar="N",
                   help="characters of a prompt's text, refused before tokenizing (default: what the model's "
                        "context could hold under its tokenizer)")
    g.add_argument("--max-stop-chars", type=count(), default=256, metavar="N",
                   help="characters of one stop string (default 256)")
    g.add_argument("--max-image-pixels", type=count(), default=None, metavar="N",
                   help="pixels of a chat image, from its header (default: 4096x4096, or twice what the VLM's "
                        "processor feeds its tower where that is more)")
    g.add_argument("--max-image-expansion", type=count(), default=512, metavar="N",
                   help="decoded RGB bytes per byte sent of a chat image larger than 3840x2160 (default 512)")
    g.add_argument("--image-decode-bytes", type=count(), default=None, metavar="N",
                   help="bytes that concurrent image decodes hold at once, 32 a pixel; others wait (default 1 GiB, "
                        "or one image at --max-image-pixels)")
    g.add_argument("--header-timeout", type=_seconds, default=10.0, metavar="S",
                   help="seconds a request's headers may take to arrive (default 10)")
    g.add_argument("--body-timeout", type=_seconds, default=30.0, metavar="S",
                   help="seconds a request body may pause between chunks (default 30)")
    g.add_argument("--max-connections", type=count(), default=4096, metavar="N",
                   help="open connections; one more is answered 503 and closed (default 4096)")
    g.add_argument("--metrics-key", default=None, metavar="KEY",
                   help="put /metrics behind this key (Authorization: Bearer KEY; default: open, as vLLM's)")


def _add_generation_limits(g) -> None:
    """Adds the bounds of image, speech and video requests to the argument group ``g``."""
    g.add_argument("--image-size", action="append", default=[], metavar="WxH",
                   help="a size image requests may ask for, the first the default (default: the pipeline's own)")
    g.add_argument("--negative-prompt", default="", metavar="TEXT",
                   help="the negative prompt of image requests that send none (encoded once per tenant)")
    g.add_argument("--max-inference-steps", type=count(), default=50, help="per image request (default 50)")
    g.add_argument("--max-images-per-request", type=count(), default=4, help="an image request's n (default 4)")
    g.add_argument("--max-speech-frames", type=count(), default=250,
                   help="audio frames a speech request generates at most (default 250: 20 s of Mimi)")
    g.add_argument("--max-ref-audio-seconds", type=_seconds, default=30.0,
                   help="longest reference clip (default 30)")
    g.add_argument("--max-speech-chars", type=count(), default=4096,
                   help="characters of a speech request's input (default 4096)")
    g.add_argument("--max-ref-text-chars", type=count(), default=4096,
                   help="characters of a speech request's ref_text, the clip's transcript (default 4096)")
    g.add_argument("--max-generation-waiting", type=count(), default=16,
                   help="image, speech or video requests queued per pipeline beyond which 503 (default 16)")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _default_dtype(args: argparse.Namespace) -> str:
    """float32 when every source is a preset, bfloat16 when a folder is served."""
    folders = [args.model] if args.model else []
    folders += [s for s in args.diffusion if s not in DIFFUSION_PRESETS]
    folders += [args.tts] if args.tts and args.tts not in TTS_PRESETS else []
    return "bfloat16" if folders else "float32"


def config_from_args(args: argparse.Namespace):
    from ..engine.config import EngineConfigError
    from .config import ServerConfig, serve_engine_config

    try:
        engine_config = serve_engine_config(page_size=args.page_size, num_pages=args.num_pages,
                                            max_num_seqs=args.max_num_seqs,
                                            max_tokens_per_step=args.max_num_batched_tokens,
                                            prefill_chunk_tokens=args.prefill_chunk_tokens,
                                            mixed_prefill_tokens=args.mixed_prefill_tokens,
                                            cache_mode=args.cache_mode,
                                            tensor_parallel_size=args.tensor_parallel_size,
                                            tensor_parallel_timeout_s=args.tensor_parallel_timeout)
    except EngineConfigError as e:
        raise ServerConfigError(str(e)) from None
    engine_config = _with_tiers(engine_config, args)
    return ServerConfig(preset=args.preset, model=args.model, chat_template=args.chat_template,
                        diffusion=tuple(args.diffusion), tts=args.tts,
                        host=args.host, port=args.port, api_keys=tuple(args.api_key),
                        served_model_name=args.served_model_name, max_waiting=args.max_waiting,
                        max_waiting_per_tenant=args.max_waiting_per_tenant, max_prompt_chars=args.max_prompt_chars,
                        max_stop_chars=args.max_stop_chars, header_timeout_s=args.header_timeout,
                        body_timeout_s=args.body_timeout, max_connections=args.max_connections,
                        metrics_key=args.metrics_key,
                        engine_config=engine_config, store_bytes=args.store_bytes,
                        max_image_pixels=args.max_image_pixels, max_image_expansion=args.max_image_expansion,
                        image_decode_bytes=args.image_decode_bytes,
                        dtype=args.dtype or _default_dtype(args), image_sizes=tuple(args.image_size),
                        negative_prompt=args.negative_prompt, max_inference_steps=args.max_inference_steps,
                        max_images_per_request=args.max_images_per_request,
                        max_speech_frames=args.max_speech_frames, max_ref_audio_seconds=args.max_ref_audio_seconds,
                        max_speech_chars=args.max_speech_chars, max_ref_text_chars=args.max_ref_text_chars,
                        max_generation_waiting=args.max_generation_waiting)


def serve_main(args: argparse.Namespace) -> int:
    from ..presets.serving import serve

    try:
        config = config_from_args(args)
    except ServerConfigError as e:
        print(f"mmcache serve: {e}", file=sys.stderr)
        return 2
    if args.tensor_parallel_size > 1 and not config.serves_chat:
        print("mmcache serve: --tensor-parallel-size splits a chat model: give --preset or --model",
              file=sys.stderr)
        return 2
    if args.replicas is not None:
        if args.tensor_parallel_size > 1:
            print("mmcache serve: --replicas with --tensor-parallel-size is not supported (each replica is one "
                  "process)", file=sys.stderr)
            return 2
        from ..replicas.cli import serve_replicas

        return serve_replicas(args, config)
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    group = None
    try:
        if args.tensor_parallel_size > 1:
            group = _start_ranks(config, args)
            if group is None:
                return 1
        with serve(config) as srv:
            print(f"mmcache serve: {', '.join(config.model_names)} at {srv.url} (OpenAI API: {srv.base_url})",
                  flush=True)
            for why in reuse_off_reasons(srv.host):
                print(f"mmcache serve: the prefix cache is off: {why}", file=sys.stderr, flush=True)
            core = srv.host.core if srv.host is not None else None
            failed = wait_until_stopped(stop, lambda: getattr(core, "fatal", None))
        if group is not None:  # after the server stopped: no step is left to send
            group.close(core)
            group = core = srv = None  # the engine goes before the group (``tp_group.leave``)
            _leave_group()
        if failed is not None:
            print(f"mmcache serve: the tensor-parallel group failed: {failed}", file=sys.stderr, flush=True)
            return 1
    except OSError as e:  # the address is taken or cannot be bound
        print(f"mmcache serve: cannot serve on {config.host}:{config.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    except ServerConfigError as e:  # a pipeline the server cannot serve (a folder of another kind, a bad size)
        print(f"mmcache serve: {e}", file=sys.stderr)
        return 2
    except MmcacheError as e:  # a model the group cannot split (UnsupportedModel), a bad engine setting
        if group is None and args.tensor_parallel_size == 1:
            raise
        print(f"mmcache serve: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    finally:
        if group is not None:  # the server did not start, or stopped on an error: the followers go too
            group.close()
            _leave_group()
        signal.signal(signal.SIGTERM, previous)
    return 0


def _leave_group() -> None:
    from ..engine.tp_group import leave

    leave()


def _start_ranks(config, args):
    """Ranks 1 .. N-1 of the tensor-parallel group, joined (``presets.ranks``); None after saying why not."""
    from ..presets.ranks import start_group

    try:
        return start_group(config, args.tensor_parallel_size, args.tensor_parallel_timeout)
    except RuntimeError as e:
        print(f"mmcache serve: {e}", file=sys.stderr)
        return None


def wait_until_stopped(stop: threading.Event, failed=None):
    """Serve until SIGTERM sets ``stop``, Ctrl-C, or ``failed()`` gives a reason (returned), then say so."""
    reason = None
    try:
        while not stop.wait(0.5):
            reason = failed() if failed is not None else None
            if reason is not None:
                break
    except KeyboardInterrupt:
        pass
    print("mmcache serve: stopping", file=sys.stderr, flush=True)
    return reason


def reuse_off_reasons(host) -> list[str]:
    """Why the chat model's page pools do not reuse cached pages: each gate's reason, or the configured mode
    (none for a server without a chat model, or whose pools all reuse)."""
    if host is None:
        return []
    reasons = []
    for label, d in host.engine.metrics().items():
        if isinstance(d, dict) and "mode" in d and d["mode"] != "on":
            reasons.append(f"{label} pool: {d['reuse_off'] or 'cache mode ' + repr(d['mode'])}")
    return reasons
