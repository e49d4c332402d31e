"""Voice cloning with reference voices shared by many requests: reference-encoder calls and time, and time to
first audio, store off versus on, through transformers' CSM pipeline unchanged (``CsmForConditionalGeneration``
with its Mimi codec; ``encoders.codec.CachedCodecEncode`` serves the codec's ``encode``).

The stream: the seed-tts-eval sample in ``datasets/voice`` (10 cases over 5 reference clips of 3.7 to 7.7 s,
provenance beside it), repeated ``--rounds`` times and shuffled by the seed, so each reference serves
``2 x rounds`` requests: a voice-cloning service where many requests speak in a few stored voices. A request is
what a server does per request: read the clip (``encoders.audio``: bytes as sent, decoded at 24 kHz), run CSM's
processor on the reference transcript and clip followed by the text to speak, generate ``--frames`` audio frames
(80 ms each) greedily and decode them to samples with the codec (``output_audio``). Its latency with one frame is
the time to first audio.

Store off and store on run the same wrapper (``store=None`` encodes every clip), request by request, alternating
which goes first; each run starts with a fresh store; figures are medians over ``--runs``; every request's frames
and audio samples are compared bit for bit between the two. ``reference_encoder_s`` is the time inside the
codec's ``encode`` (store lookups included) summed over the stream; ``reference_encoder_calls`` counts the
codec's encoder runs. Before the runs one throwaway request warms each side alike (its own wrapper and store,
dropped after).

Each request position is served with the store off and on side by side, so the latency ratio is paired by
request: ``targets.latency_ratio_per_request`` is the median over runs of each run's
``latency_ratio_per_request``, the median over request positions of (store-off latency / store-on latency of
that request); the table's "better by" (``paired``) is this figure. ``latency_ratio_paired`` keeps its earlier
meaning, the median over runs of ``latency_ratio`` (each run's off p50 over its on p50), which is paired by run
only. ``targets.encoder_time_cut`` is the median over runs of each run's cut, 1 - on / off reference-encoder
time (``encoder_time_cut_runs``), where it was the cut between the two sides' medians over runs (the same with
one run).

The codec is Mimi at its published size (79 M parameters, the codec of CSM-1B and Moshi), so its encode time is
real; CSM's backbone and depth decoder are tiny (``mmcache.presets.tts``), so the reference encoder's share of
a request here is far larger than with CSM-1B. The share it would take with CSM-1B is estimated on paper
(``estimate``): the codec's FLOPs counted on the real clips (``torch.utils.flop_counter``) against CSM-1B's
backbone and depth decoder at two FLOPs per parameter per token, from transformers' ``CsmConfig`` defaults.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from encoders.audio import AudioLimits, decode_audio, read_audio
from encoders.codec import CachedCodecEncode
from encoders.voice import SAMPLING_RATE, voice_prompt
from mmcache.presets.tts import CODECS, csm_pipeline
from mmcache.errors import InvalidRequest, MmcacheError
from mmcache.store import EncoderOutputStore

from .options import MAX_REPEATS, MAX_THREADS, count, fill_sizes, seed
from .table import Row

DESCRIPTION = "voice cloning (CSM + Mimi): reference-encoder calls/time and time to first audio, store off vs on"
DATA = Path(__file__).resolve().parents[1] / "datasets" / "voice" / "seedtts_en_sample"
DATASET_FILES = AudioLimits(allow_paths=True)  # the clips are dataset files read by path: trusted input
STORE_BYTES = 256 * 2**20
MAX_FRAMES = 1000  # 80 s of audio
FULL = {"rounds": 4, "runs": 3}
QUICK = {"rounds": 2, "runs": 1}  # --quick's values for the options not given


class VoiceDataMissing(MmcacheError, FileNotFoundError):
    """The voice-cloning cases are not where the repository keeps them, or their list is malformed."""


@dataclass(frozen=True)
class Case:
    utt_id: str
    reference_text: str
    reference_wav: Path
    target_text: str


def load_cases(folder: Path = DATA) -> list[Case]:
    """The cases of a seed-tts-eval list (``meta.lst``: ``utt_id|prompt_text|prompt_wav|target_text``)."""
    meta = folder / "meta.lst"
    if not meta.is_file():
        raise VoiceDataMissing(f"{meta} not found; run the benchmark from a repository checkout")
    cases = []
    for n, line in enumerate(meta.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split("|")
        if len(fields) != 4:
            raise VoiceDataMissing(f"{meta}:{n}: expected 4 '|'-separated fields, got {len(fields)}")
        cases.append(Case(fields[0], fields[1], folder / fields[2], fields[3]))
    if not cases:
        raise VoiceDataMissing(f"{meta} lists no case")
    return cases


def voice_stream(cases: list[Case], rounds: int, seed_: int) -> list[Case]:
    stream = [c for _ in range(rounds) for c in cases]
    order = np.random.default_rng(seed_).permutation(len(stream))
    return [stream[i] for i in order]


def add_arguments(p) -> None:
    p.add_argument("--rounds", type=count(MAX_REPEATS), default=None,
                   help=f"times the 10 cases repeat in the stream (default {FULL['rounds']}, quick {QUICK['rounds']}); "
                        f"each reference serves 2 x rounds requests")
    p.add_argument("--runs", type=count(MAX_REPEATS), default=None,
                   help=f"runs per mode; figures are medians (default {FULL['runs']}, quick {QUICK['runs']})")
    p.add_argument("--frames", type=count(MAX_FRAMES), default=1,
                   help="audio frames (80 ms each) generated per request; 1 measures the time to first audio")
    p.add_argument("--codec", choices=tuple(CODECS), default="mimi", help="Mimi at its published size, or tiny")
    p.add_argument("--threads", type=count(MAX_THREADS), default=1, help="torch CPU threads while measuring")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--no-estimate", action="store_true", help="skip the FLOP estimate for CSM-1B")


class _Mode:
    """One pipeline run with the store on or off: the wrapper, and per-request figures."""

    def __init__(self, pipe, store_on: bool):
        self.enc = CachedCodecEncode(pipe.codec, EncoderOutputStore(STORE_BYTES) if store_on else None)
        self.latency: list[float] = []
        self.outputs: list[tuple[torch.Tensor, torch.Tensor]] = []


def _request(pipe, mode: _Mode, case: Case, frames: int) -> None:
    t0 = time.perf_counter()
    wave = decode_audio(read_audio(case.reference_wav, limits=DATASET_FILES), SAMPLING_RATE)
    inputs = pipe.processor(text=[voice_prompt(case.reference_text, case.target_text)], audio=[wave],
                            return_tensors="pt", sampling_rate=SAMPLING_RATE)
    with mode.enc, torch.inference_mode():
        out = pipe.model.generate(**inputs, max_new_tokens=frames, do_sample=False, output_audio=True,
                                  return_dict_in_generate=True)
    mode.latency.append(time.perf_counter() - t0)
    audio = out.audio[0] if out.audio else torch.empty(0)
    mode.outputs.append((out.sequences, audio))


def _run_once(pipe, stream: list[Case], frames: int, run: int) -> dict:
    modes = {"off": _Mode(pipe, False), "on": _Mode(pipe, True)}
    for i, case in enumerate(stream):
        order = ("off", "on") if (i + run) % 2 == 0 else ("on", "off")
        for name in order:
            _request(pipe, modes[name], case, frames)
    identical = all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                    for a, b in zip(modes["off"].outputs, modes["on"].outputs))
    out = {}
    for name, m in modes.items():
        s = m.enc.stats()
        out[name] = {"latency_p50_s": statistics.median(m.latency), "latency_mean_s": statistics.fmean(m.latency),
                     "reference_encoder_s": s["encode_s"], "reference_encoder_calls": s["calls"],
                     "store_hits": s["hits"], "bit_identical": identical}
    out["latency_ratio"] = out["off"]["latency_p50_s"] / out["on"]["latency_p50_s"]
    out["latency_ratio_per_request"] = per_request_ratio(modes["off"].latency, modes["on"].latency)
    return out


def per_request_ratio(off: list[float], on: list[float]) -> float:
    """The median over request positions of (store-off latency / store-on latency of the same request): the
    two sides served it side by side, so the machine's drift over the stream cancels pair by pair."""
    return statistics.median(a / b for a, b in zip(off, on, strict=True))


def _median(runs: list[dict], mode: str) -> dict:
    keys = runs[0][mode]
    return {k: all(r[mode][k] for r in runs) if isinstance(keys[k], bool)
            else statistics.median(r[mode][k] for r in runs) for k in keys}


def run(args) -> dict:
    fill_sizes(args, FULL, QUICK)
    if args.quick:
        args.no_estimate = True
    skipped = None
    if args.codec != "mimi" and not args.no_estimate:  # the estimate counts the published codec's FLOPs
        args.no_estimate, skipped = True, f"needs --codec mimi (this run: {args.codec})"
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity_error()
        cases = load_cases()
        stream = voice_stream(cases, args.rounds, args.seed)
        pipe = csm_pipeline(codec=args.codec)  # one attach per request below: this benchmark runs on one thread
        for store_on in (False, True):  # warm-up of each side alike: first-call allocations, imports
            _request(pipe, _Mode(pipe, store_on), stream[0], args.frames)
        runs = [_run_once(pipe, stream, args.frames, r) for r in range(args.runs)]
        result = summarise_runs(runs, stream, args)
        if not args.no_estimate:
            result["estimate"] = paper_estimate(pipe, cases, args.frames)
        elif skipped:
            result["estimate_skipped"] = skipped
        return result
    finally:
        torch.set_num_threads(threads)


def summarise_runs(runs: list[dict], stream: list[Case], args) -> dict:
    """The runs' medians per side and the targets: encoder calls and time, paired latency."""
    unique = len({c.reference_wav for c in stream})
    on, off = _median(runs, "on"), _median(runs, "off")
    cuts = [1 - r["on"]["reference_encoder_s"] / r["off"]["reference_encoder_s"] for r in runs]
    return {
        "config": {"codec": args.codec, "frames": args.frames, "rounds": args.rounds, "runs": args.runs,
                   "threads": args.threads, "quick": args.quick},
        "stream": {"requests": len(stream), "unique_references": unique},
        "off": off, "on": on,
        "targets": {
            "calls_met": on["reference_encoder_calls"] == unique,
            "encoder_time_cut": statistics.median(cuts), "encoder_time_cut_runs": cuts,
            "encoder_time_cut_ideal": 1 - unique / len(stream),
            "latency_ratio_per_request": statistics.median(r["latency_ratio_per_request"] for r in runs),
            "latency_ratio_paired": statistics.median(r["latency_ratio"] for r in runs),
        },
    }


def paper_estimate(pipe, cases: list[Case], frames: int) -> dict:
    """The reference encoder's share of a CSM-1B request, from FLOP counts (an estimate, not a measurement)."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import CsmConfig, CsmForConditionalGeneration

    if pipe.codec.config.hidden_size != 512:
        raise InvalidRequest("the estimate needs the published Mimi (--codec mimi)")
    clips = [decode_audio(read_audio(p, limits=DATASET_FILES), SAMPLING_RATE)
             for p in sorted({c.reference_wav for c in cases})]
    seconds = statistics.fmean(len(w) / SAMPLING_RATE for w in clips)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        for w in clips:
            type(pipe.codec).encode(pipe.codec, torch.from_numpy(w)[None, None])
    encode_flops = counter.get_total_flops() / len(clips)
    with torch.device("meta"):
        real = CsmForConditionalGeneration(CsmConfig())
    def matmul_params(module) -> int:  # weights a token multiplies through (embeddings are lookups)
        return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))
    backbone = matmul_params(real.backbone_model) + real.lm_head.weight.numel()
    head = real.depth_decoder.codebooks_head.weight  # [codebooks - 1, hidden, vocab]: one slice per step
    depth = matmul_params(real.depth_decoder.model) + head[0].numel()
    cfg = real.config
    frame_rate = real.codec_model.config.frame_rate
    prompt_tokens = seconds * frame_rate + 2 * 24  # the clip's frames plus two short transcripts' tokens
    prefill = 2 * backbone * prompt_tokens
    per_frame = 2 * backbone + 2 * depth * cfg.num_codebooks  # one backbone step, one depth step per codebook
    first_audio = prefill + frames * per_frame
    return {"clip_seconds_mean": seconds, "mimi_encode_gflops": encode_flops / 1e9,
            "csm_1b_backbone_params": backbone, "csm_1b_depth_params": depth,
            "prefill_gflops": prefill / 1e9, "per_frame_gflops": per_frame / 1e9,
            "encoder_share_of_first_audio": encode_flops / (encode_flops + first_audio),
            "note": "estimate: FLOP counts, not time; 2 FLOPs per weight per token, attention and the codec's "
                    "decoder of the first frame left out"}


def table_rows(result: dict) -> list[Row]:
    on, off, t, s = result["on"], result["off"], result["targets"], result["stream"]
    calls = (f"{'ok' if t['calls_met'] else 'MISSED'}: unique references = {s['unique_references']} "
             f"of {s['requests']} requests")
    cut = f"cut {t['encoder_time_cut']:.1%}; ideal {t['encoder_time_cut_ideal']:.1%} = 1 - unique/requests"
    frames = result["config"]["frames"]
    what = "time to first audio p50" if frames == 1 else f"latency p50 ({frames} frames)"
    rows = [
        Row("voice", "reference-encoder calls", float(on["reference_encoder_calls"]), "",
            float(off["reference_encoder_calls"]), target=calls),
        Row("voice", "reference-encoder time", on["reference_encoder_s"], "s", off["reference_encoder_s"], target=cut),
        Row("voice", what, on["latency_p50_s"], "s", off["latency_p50_s"], paired=t["latency_ratio_per_request"]),
        Row("voice", "outputs bit-identical", float(on["bit_identical"]), "", target="1 (store on == off)"),
    ]
    if "estimate" in result:
        rows.append(Row("voice", "Mimi encode share of CSM-1B time to first audio (FLOP estimate)",
                        100 * result["estimate"]["encoder_share_of_first_audio"], "%"))
    return rows
