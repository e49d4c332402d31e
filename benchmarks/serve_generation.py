"""The generation streams of ``mmcache bench serve``: images, videos and cloned speech over HTTP, store on
against store off, request by request.

Two servers run in this process on loopback ports (``mmcache.presets.serve``), each serving ``tiny-sd3``
(``/v1/images/generations``), ``tiny-wan`` (``/v1/videos/sync``) and ``tiny-csm`` (``/v1/audio/speech``; or
``csm-mimi``, Mimi at its published size, with ``--voice-preset``): "on" with a store of ``STORE_BYTES``, "off"
with a store of one byte, which every encoder output bypasses (the server's own store-off path, the one
``mmcache bench serve`` uses for its ``mmcache_nocache`` engine: lookups are counted, nothing is kept, every
prompt, negative prompt and reference clip is encoded per request, every position bias computed).

Streams (each a fixed list of requests drawn from a seed; the same list goes to both servers):

* image: PartiPrompts drawn with Zipf popularity (``benchmarks.diffusion.zipf_stream``) and one fixed negative
  prompt, the deployment's (``ServerConfig.negative_prompt``), which requests leave out;
* video: Wan's example prompts (``datasets/prompts/wan_prompts.json``) drawn the same way, each request sending
  Wan's default negative prompt, tiny sizes, through ``/v1/videos/sync``;
* voice: the seed-tts-eval cases of ``datasets/voice`` (``benchmarks.voice``), a few reference clips each shared by
  several requests, one audio frame per request (CSM decodes audio only after its last frame, so its latency is
  the time to first audio).

Rules: request i goes to both servers, the order alternating with i, so both see the same machine; ratios are
medians of per-pair ratios (off latency / on latency). Every request of a run carries that run's ``cache_salt``;
one warm-up request per stream and server under its own salt runs first, so no measured request hits a warm-up
entry. Encoder calls are the store's misses (queries - hits, from ``/metrics`` by kind) per run, in items:
a text encoder's misses over the pipeline's text encoders (SD3 has three, Wan one), the codec's misses as they
are; with the store on they equal the unique prompts plus one for the negative prompt (images, videos) or the
unique reference clips (voice). Time to first audio is the server's own metric per request (the delta of
``mmcache:time_to_first_audio_seconds_sum``). A request that fails raises ``GenerationRequestFailed``; every loop
is bounded by the request lists.
"""

from __future__ import annotations

import base64
import os
import statistics
import time

import httpx
import numpy as np
import torch

from mmcache.errors import MmcacheError

from .options import MAX_REPEATS, MAX_REQUESTS, count, fill_sizes, real
from .table import Row

DESCRIPTION = ("generation over HTTP (images, videos, cloned speech): latency, time to first audio and encoder "
               "calls, store on vs off")
STREAMS = ("image", "video", "voice")
STORE_BYTES = 256 * 2**20
OFF_STORE_BYTES = 1  # no entry fits: every encoder output bypasses the store
IMAGE_NEGATIVE = "blurry, low quality, distorted, watermark, text"
IMAGE_SIZE = 32
VIDEO_SHAPE = {"width": 16, "height": 16, "num_frames": 5, "fps": 8}
MAX_STEPS = 50
MAX_FRAMES = 250
TEXT_ENCODER_KINDS = ("text_encoder", "negative_prompt")
KINDS = ("text_encoder", "negative_prompt", "position_bias", "codec")
VOICE_PRESETS = ("tiny-csm", "csm-mimi")  # a narrow Mimi codec, or Mimi at its published size
FULL = {"image_requests": 64, "video_requests": 24, "voice_rounds": 4, "gen_steps": 2, "gen_runs": 3}
QUICK = {"image_requests": 16, "video_requests": 8, "voice_rounds": 2, "gen_steps": 1, "gen_runs": 2}
_TIMEOUT_S = 600.0


class GenerationRequestFailed(MmcacheError, RuntimeError):
    """A measured generation request got an error status: its figures would mean nothing."""


class LeftHeld(MmcacheError, RuntimeError):
    """A server's store still holds a lease after the streams."""


def streams_list(text: str) -> list[str]:
    """An argparse ``type``: comma-separated stream names of ``STREAMS``, no repeats."""
    import argparse

    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in STREAMS]
    if not names or bad or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"give distinct names of {', '.join(STREAMS)}, got {text!r}")
    return names


def add_arguments(p) -> None:
    """The generation part's options; names unlike ``bench serve``'s own (it reads ``--seed``, ``--threads``,
    ``--quick`` from there when present)."""
    g = p.add_argument_group("generation streams (image, video, voice; store on vs off)")
    g.add_argument("--no-generation", action="store_true", help="skip the image, video and voice streams")
    g.add_argument("--gen-streams", type=streams_list, default=list(STREAMS), metavar="S1,S2",
                   help=f"which generation streams run (default all: {','.join(STREAMS)})")
    for name, high, what in (("image_requests", MAX_REQUESTS, "image requests per run"),
                             ("video_requests", MAX_REQUESTS, "video requests per run"),
                             ("voice_rounds", MAX_REPEATS, "times the 10 voice cases repeat per run"),
                             ("gen_steps", MAX_STEPS, "denoising steps per image and video request"),
                             ("gen_runs", MAX_REPEATS, "runs of each stream, each under its own cache_salt")):
        g.add_argument("--" + name.replace("_", "-"), type=count(high), default=None, metavar="N",
                       help=f"{what} (default {FULL[name]}, quick {QUICK[name]}; at most {high})")
    g.add_argument("--speech-frames", type=count(MAX_FRAMES), default=1, metavar="N",
                   help="audio frames per speech request (1: the latency is the time to first audio)")
    g.add_argument("--voice-preset", choices=VOICE_PRESETS, default="tiny-csm",
                   help="the voice stream's pipeline: tiny-csm (a narrow Mimi codec) or csm-mimi (Mimi at its "
                        "published size, so the reference encoder's cost is real)")
    g.add_argument("--gen-zipf", type=real(minimum=0.0), default=1.1, metavar="S",
                   help="Zipf exponent of prompt popularity in the image and video streams")


# ---- the request lists ----------------------------------------------------------------------------------
def image_requests(n: int, zipf: float, seed: int) -> list[dict]:
    """``n`` PartiPrompts drawn with Zipf popularity; the negative prompt is the deployment's, so none is sent."""
    from mmcache.presets.local_tokenizers import parti_prompts

    from .diffusion import zipf_stream

    return [{"prompt": p} for p in zipf_stream(parti_prompts(), n, zipf, seed)]


def video_requests(n: int, zipf: float, seed: int) -> list[dict]:
    """``n`` of Wan's example prompts drawn with Zipf popularity, each with Wan's default negative prompt."""
    from mmcache.presets.local_tokenizers import wan_example_prompts, wan_negative_prompt

    from .diffusion import zipf_stream

    pool = list(dict.fromkeys(wan_example_prompts()))  # the examples repeat across Wan versions: once each
    negative = wan_negative_prompt()
    return [{"prompt": p, "negative_prompt": negative} for p in zipf_stream(pool, n, zipf, seed)]


def voice_requests(rounds: int, seed: int, frames: int, model: str = "tiny-csm") -> list[dict]:
    """The voice cases ``rounds`` times, shuffled by the seed, each clip sent as a WAV data URL (``_clip`` names
    the clip for counting; keys starting with ``_`` are not sent)."""
    from .voice import load_cases, voice_stream

    clips: dict = {}
    out = []
    for case in voice_stream(load_cases(), rounds, seed):
        if case.reference_wav not in clips:
            clips[case.reference_wav] = base64.b64encode(case.reference_wav.read_bytes()).decode("ascii")
        out.append({"model": model, "input": case.target_text, "ref_text": case.reference_text,
                    "ref_audio": "data:audio/wav;base64," + clips[case.reference_wav], "max_new_tokens": frames,
                    "temperature": 0.0, "_clip": case.reference_wav.name})  # greedy: both sides' audio comparable
    return out


def unique_items(stream: str, requests: list[dict]) -> int:
    """Distinct prompts (image, video) or reference clips (voice) of a request list."""
    key = "_clip" if stream == "voice" else "prompt"
    return len({r[key] for r in requests})


# ---- one request ------------------------------------------------------------------------------------------
def _post(http: httpx.Client, url: str, stream: str, body: dict, steps: int, seed: int, salt: str) -> bytes:
    """Send one request of ``stream``; what it made (PNG base64, MP4 or WAV bytes), for comparing the sides."""
    fields = {k: v for k, v in body.items() if not k.startswith("_")}
    if stream == "image":
        path = "/v1/images/generations"
        fields.update(size=f"{IMAGE_SIZE}x{IMAGE_SIZE}", num_inference_steps=steps, seed=seed, cache_salt=salt)
    elif stream == "video":
        path = "/v1/videos/sync"
        fields.update(VIDEO_SHAPE, num_inference_steps=steps, seed=seed, cache_salt=salt)
    else:
        path = "/v1/audio/speech"
        fields.update(voice="cloned", response_format="wav", seed=seed, cache_salt=salt)
    r = http.post(url + path, json=fields, timeout=_TIMEOUT_S)
    if r.status_code != 200:
        raise GenerationRequestFailed(f"{stream} request: HTTP {r.status_code}: {r.text[:300]}")
    if stream == "image":  # the images alone: the body's "created" is the second it was made
        return "".join(d["b64_json"] for d in r.json()["data"]).encode("ascii")
    return r.content


def scrape(http: httpx.Client, url: str) -> dict:
    """The store's queries and hits by kind, and the time-to-first-audio sum, from the server's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {"ttfa_sum": 0.0}
    for kind in KINDS:
        out[f"{kind}_queries"] = out[f"{kind}_hits"] = 0.0
    for fam in text_string_to_metric_families(http.get(url + "/metrics", timeout=60.0).text):
        for s in fam.samples:
            if s.name == "mmcache:encoder_cache_queries_total" and s.labels.get("kind") in KINDS:
                out[f"{s.labels['kind']}_queries"] += s.value
            elif s.name == "mmcache:encoder_cache_hits_total" and s.labels.get("kind") in KINDS:
                out[f"{s.labels['kind']}_hits"] += s.value
            elif s.name == "mmcache:time_to_first_audio_seconds_sum":
                out["ttfa_sum"] += s.value
    return out


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


# ---- a stream ---------------------------------------------------------------------------------------------
def _pair(http: httpx.Client, urls: dict, stream: str, body: dict, order: list[str], steps: int, seed: int,
          salt: str, sides: dict) -> bool:
    """One request sent to each side in ``order``; its latency (and time to first audio) appended to ``sides``;
    whether both sides made the same bytes."""
    outputs = {}
    for side in order:
        ttfa0 = scrape(http, urls[side])["ttfa_sum"] if stream == "voice" else 0.0
        start = time.perf_counter()
        outputs[side] = _post(http, urls[side], stream, body, steps, seed, salt)
        sides[side]["latency"].append(time.perf_counter() - start)
        if stream == "voice":  # the server's own time to first audio of this request
            sides[side]["ttfa"].append(scrape(http, urls[side])["ttfa_sum"] - ttfa0)
    return len(set(outputs.values())) == 1


def run_stream(http: httpx.Client, urls: dict, stream: str, requests: list[dict], steps: int, seed: int,
               runs: int, encoders: int) -> dict:
    """One stream against both servers (``urls``: "on" and "off" -> base URL), ``runs`` times, each under a
    salt of its own; the figures of each side and the paired ratios."""
    sides = {side: {"latency": [], "ttfa": [], "runs": []} for side in urls}
    identical = []
    for side, url in urls.items():  # first-call costs outside the measured pairs, under a salt of its own
        _post(http, url, stream, requests[0], steps, seed, f"warm-up-{stream}")
    for r in range(runs):
        salt = f"bench-{stream}-run-{r}"
        before = {side: scrape(http, url) for side, url in urls.items()}
        for i, body in enumerate(requests):
            order = list(urls) if (i + r) % 2 == 0 else list(urls)[::-1]  # who goes first alternates
            identical.append(_pair(http, urls, stream, body, order, steps, seed + i, salt, sides))
        for side, url in urls.items():
            sides[side]["runs"].append(_delta(scrape(http, url), before[side]))
    unique = unique_items(stream, requests)
    result = {"requests": len(requests), "runs": runs, "unique_items": unique, "text_encoders": encoders,
              "outputs_identical": sum(identical) / len(identical),
              "expected_encoder_calls_on": unique if stream == "voice" else unique + 1,
              "expected_encoder_calls_off": len(requests) * (1 if stream == "voice" else 2)}
    for side, s in sides.items():
        result[side] = _side_summary(stream, s, encoders)
    on, off = sides["on"], sides["off"]
    result["latency_ratio_paired"] = statistics.median(a / b for a, b in zip(off["latency"], on["latency"]))
    if stream == "voice":
        ratios = [a / b for a, b in zip(off["ttfa"], on["ttfa"]) if b > 0]
        result["ttfa_ratio_paired"] = statistics.median(ratios) if ratios else None
    result["encoder_calls_met"] = all(c == result["expected_encoder_calls_on"]
                                      for c in result["on"]["encoder_calls_runs"])
    return result


def encoder_calls(stream: str, counts: dict, encoders: int) -> float:
    """Encoder calls in items from one run's store counts: codec misses (voice), or text-encoder and
    negative-prompt misses over the pipeline's text encoders."""
    if stream == "voice":
        return counts["codec_queries"] - counts["codec_hits"]
    return sum(counts[f"{k}_queries"] - counts[f"{k}_hits"] for k in TEXT_ENCODER_KINDS) / encoders


def _side_summary(stream: str, s: dict, encoders: int) -> dict:
    runs = s["runs"]
    kinds = {kind: {"queries": sum(c[f"{kind}_queries"] for c in runs), "hits": sum(c[f"{kind}_hits"] for c in runs)}
             for kind in KINDS}
    calls = [encoder_calls(stream, c, encoders) for c in runs]
    out = {"latency_p50_s": statistics.median(s["latency"]), "latency_p90_s": float(np.percentile(s["latency"], 90)),
           "latency_mean_s": statistics.fmean(s["latency"]), "latencies_s": s["latency"],
           "encoder_calls": statistics.median(calls), "encoder_calls_runs": calls, "store_all_runs": kinds}
    if s["ttfa"]:
        out.update(ttfa_p50_s=statistics.median(s["ttfa"]), ttfa_p90_s=float(np.percentile(s["ttfa"], 90)),
                   ttfa_s=s["ttfa"])
    return out


# ---- the servers ------------------------------------------------------------------------------------------
def server_config(streams: list[str], store_bytes: int, steps: int, frames: int, voice: str = "tiny-csm"):
    from mmcache.server import ServerConfig
    from mmcache.server.videos import VideoLimits

    diffusion = tuple(name for stream, name in (("image", "tiny-sd3"), ("video", "tiny-wan")) if stream in streams)
    limits = VideoLimits(max_width=64, max_height=64, max_frames=9, max_steps=max(steps, 4), default_width=16,
                         default_height=16, default_frames=5, default_fps=8, default_steps=steps)
    return ServerConfig(diffusion=diffusion, tts=voice if "voice" in streams else None,
                        store_bytes=store_bytes, negative_prompt=IMAGE_NEGATIVE,
                        image_sizes=(f"{IMAGE_SIZE}x{IMAGE_SIZE}",), max_inference_steps=max(steps, 4),
                        max_speech_frames=max(frames, 1), video_limits=limits)


def text_encoders(pipe) -> int:
    """How many text encoders a diffusers pipeline runs per text (SD3: CLIP-L, CLIP-G, T5; Wan: umT5)."""
    return sum(getattr(pipe, name, None) is not None for name in ("text_encoder", "text_encoder_2", "text_encoder_3"))


def _encoders(srv, stream: str) -> int:
    if stream == "image":
        return text_encoders(srv.services["images"].pipe)
    if stream == "video":
        return text_encoders(srv.services["videos"].jobs.render.pipe.pipe)
    return 1


def _settle(args) -> None:
    for name in FULL:
        if not hasattr(args, name):
            setattr(args, name, None)
    if not hasattr(args, "quick"):
        args.quick = False
    fill_sizes(args, FULL, QUICK)


def _quiet_logs() -> None:
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.set_verbosity_error()  # CLIP-truncation notices for long prompts
    transformers_logging.set_verbosity_error()


def check_sound(servers: dict) -> dict:
    """After the streams: each server's store passes ``check_invariants`` (which raises otherwise) and holds no
    lease (else ``LeftHeld``); side -> leases held (all 0)."""
    held = {}
    for side, srv in servers.items():
        srv.store.check_invariants()
        held[side] = sum(srv.store.held(key) for key in srv.store.keys())
    if any(held.values()):
        raise LeftHeld(f"store leases still held after the generation streams: {held}")
    return held


def run(args) -> dict:
    """Every stream of ``args.gen_streams`` against a store-on and a store-off server; the figures as a dict."""
    _settle(args)
    streams = list(getattr(args, "gen_streams", STREAMS))
    seed, frames = int(getattr(args, "seed", 0)), int(getattr(args, "speech_frames", 1))
    zipf = float(getattr(args, "gen_zipf", 1.1))
    voice = getattr(args, "voice_preset", "tiny-csm")
    lists = {"image": lambda: image_requests(args.image_requests, zipf, seed),
             "video": lambda: video_requests(args.video_requests, zipf, seed),
             "voice": lambda: voice_requests(args.voice_rounds, seed, frames, voice)}
    threads = torch.get_num_threads()
    torch.set_num_threads(int(getattr(args, "threads", 1)))
    load_before, t0 = os.getloadavg(), time.perf_counter()
    result: dict = {"streams": {}}
    try:
        _quiet_logs()
        result["held_after"] = serve_streams(args, streams, lists, seed, frames, voice, result["streams"])
    finally:
        torch.set_num_threads(threads)
    result["config"] = {"streams": streams, "store_bytes_on": STORE_BYTES, "store_bytes_off": OFF_STORE_BYTES,
                        "steps": args.gen_steps, "runs": args.gen_runs, "image_requests": args.image_requests,
                        "video_requests": args.video_requests, "voice_rounds": args.voice_rounds,
                        "speech_frames": frames, "voice_preset": voice, "zipf_s": zipf, "seed": seed,
                        "quick": bool(args.quick), "image_size": f"{IMAGE_SIZE}x{IMAGE_SIZE}",
                        "video": dict(VIDEO_SHAPE), "image_negative_prompt": IMAGE_NEGATIVE}
    result["machine"] = {"cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                         "seconds": time.perf_counter() - t0}
    return result


def serve_streams(args, streams: list[str], lists: dict, seed: int, frames: int, voice: str, out: dict) -> dict:
    """Both servers up, each stream run on them into ``out``; then ``check_sound``'s answer."""
    from contextlib import ExitStack

    from mmcache.presets import serve

    with ExitStack() as stack, httpx.Client() as http:
        servers = {side: stack.enter_context(serve(server_config(streams, budget, args.gen_steps, frames, voice)))
                   for side, budget in (("on", STORE_BYTES), ("off", OFF_STORE_BYTES))}
        urls = {side: srv.url for side, srv in servers.items()}
        for stream in streams:
            out[stream] = run_stream(http, urls, stream, lists[stream](), args.gen_steps, seed, args.gen_runs,
                                     _encoders(servers["on"], stream))
        return check_sound(servers)


# ---- the table ----------------------------------------------------------------------------------------------
def rows(result: dict) -> list[Row]:
    """Per stream: latency p50 and p90 (on vs off, the paired ratio), time to first audio for voice, encoder
    calls against the unique items."""
    out = []
    for stream, r in result.get("streams", {}).items():
        on, off = r["on"], r["off"]
        out.append(Row("serve", f"{stream} latency p50", on["latency_p50_s"], "s", off["latency_p50_s"],
                       versus="store off", paired=r.get("latency_ratio_paired")))
        out.append(Row("serve", f"{stream} latency p90", on["latency_p90_s"], "s", off["latency_p90_s"],
                       versus="store off"))
        if "ttfa_p50_s" in on:
            out.append(Row("serve", f"{stream} time to first audio p50", on["ttfa_p50_s"], "s", off["ttfa_p50_s"],
                           versus="store off", paired=r.get("ttfa_ratio_paired")))
        what = "unique clips" if stream == "voice" else "unique prompts + 1 negative"
        verdict = "ok" if r.get("encoder_calls_met") else "MISSED"
        out.append(Row("serve", f"{stream} encoder calls per run ({r['requests']} requests)", on["encoder_calls"], "",
                       off["encoder_calls"], versus="store off",
                       target=f"{verdict}: {what} = {r['expected_encoder_calls_on']}"))
    return out


table_rows = rows


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.serve_generation [--quick] [--json PATH] [options]``: the streams alone, until
    ``mmcache bench serve`` runs them."""
    import argparse
    import sys

    from mmcache.cli import writable, write_json

    from .options import MAX_THREADS, seed
    from .table import render

    p = argparse.ArgumentParser(prog="python -m benchmarks.serve_generation", description=DESCRIPTION)
    p.add_argument("--json", metavar="PATH", help="write the result as JSON")
    p.add_argument("--quick", action="store_true", help="the small configuration")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--threads", type=count(MAX_THREADS), default=1, help="torch CPU threads while measuring")
    add_arguments(p)
    args = p.parse_args(argv)
    if not writable(args.json, p.prog):
        return 2
    try:
        result = run(args)
    except MmcacheError as e:
        print(f"{p.prog}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    write_json(args.json, result)
    print(render(rows(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
