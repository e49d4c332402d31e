"""``POST /v1/audio/speech``: voice cloning through transformers' CSM, unchanged, its codec served by the store.

Rules:

* Every field is checked before anything is queued, in this order. First the fields themselves: ``input``
  within ``max_speech_chars``, ``ref_text`` within ``max_ref_text_chars``; ``response_format`` ``wav`` or
  ``pcm``; ``max_new_tokens`` within ``max_speech_frames``; ``temperature`` 0 or at least ``MIN_TEMPERATURE``;
  ``speed`` 1, no ``instructions``, ``stream_format`` ``audio`` (ranges and types: ``protocol.SpeechRequest``).
  Then admission: a full queue, or a tenant at its share of it, is 503 before the clip is decoded. Then, in an
  intake thread, ``ref_audio``: a data URL (``audio/*``) or bare base64 of a WAV, FLAC or OGG file, read under
  the configured byte and duration limits (413 beyond them, 400 when unreadable) and resampled to the codec's
  rate (``encoders.audio``); the processor builds the prompt there too, and the prompt and the frames to
  generate must fit the backbone's context (400 naming the part to shorten; without ``max_new_tokens`` as many
  frames as fit, up to ``max_speech_frames``). A refused request holds nothing.
* The audio is the pipeline's own: ``generate(..., output_audio=True)`` on the prompt
  ``voice_prompt(ref_text, input)`` with the reference samples. ``wav`` is a 32-bit float WAV of exactly those
  samples (the same samples, the same bytes); ``pcm`` is OpenAI's raw 16-bit little-endian PCM at the codec's
  rate (clipped to [-1, 1], times 32767, rounded). Both are sent whole, not streamed: CSM decodes audio only
  after its last frame (the codec's decoder runs once over every frame), so no audio exists earlier; time to
  first audio is the time to that whole answer.
* The reference clip's codes come from the store (kind ``codec``), keyed by the exact samples after
  resampling, their preprocessing descriptor and the codec's fingerprint, under the request's tenant salt
  (``CachedCodecEncode.salted``, entered in the thread that runs ``generate``; the codec is attached once).
* Sampling: ``temperature`` None keeps the model's generation config, 0 decodes the backbone greedily, above 0
  samples it at that temperature. Every call runs on torch's global generator seeded with ``seed`` (drawn at
  random when none) inside a forked RNG state, one call at a time per pipeline (its ``GenerationQueue``): the
  same seed gives the same audio, unless another part of the process draws from torch's global generator at that
  moment (a chat request without a seed).
* A client that goes away cancels its job: a waiting job never runs, a running one stops before the next
  decoder layer of the backbone (``VoicePipeline.interruptible``), inside its prefill too; the codec holds a
  store lease only inside its ``encode``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import re
import secrets
import struct
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch
from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..errors import InvalidRequest, MediaDecodeError
from .engine_host import QueueFull
from .errors import bad_request, beyond_limits, too_large
from .job_queue import Job, QueuedService
from .protocol import SpeechRequest

CODEC_KIND = "codec"
FORMATS = {"wav": "audio/wav", "pcm": "audio/pcm"}
# The smallest sampling temperature: the logits are divided by it in float32, where a tiny one overflows them
# (1e-300 rounds to 0) and the sampler fails on inf and NaN. Sampling at 0.01 is already close to greedy; 0 asks
# for greedy decoding outright.
MIN_TEMPERATURE = 0.01


@dataclass(frozen=True)
class SpeechSpec:
    """A checked speech request (its reference clip decoded apart)."""

    text: str
    ref_text: str
    response_format: str
    frames: int | None  # max_new_tokens; None: as many as fit in the context, up to max_speech_frames
    seed: int
    temperature: float | None


@dataclass(frozen=True)
class SpeechPrompt:
    """A request ready for the worker: the processor's inputs (the prompt's ids, the reference samples) and the
    audio frames to generate, which fit in the backbone's context together."""

    spec: SpeechSpec
    inputs: dict  # the processor's BatchFeature
    frames: int
    preprocessing: object  # the reference clip's preprocessing descriptor, part of its codec store key


class SpeechService(QueuedService):
    """One CSM pipeline (``encoders.voice.VoicePipeline``) served through the store."""

    task = "speech"

    def __init__(self, voice, store, config, name: str, owner_share: int | None = None):
        from encoders.audio import AudioLimits
        from encoders.codec import CachedCodecEncode

        self.voice = voice
        self.model = voice.model
        self.processor = voice.processor
        # One prompt built at a time: the processor sets the fast tokenizer's padding on each call, and the Rust
        # tokenizer refuses ("Already borrowed") a call that overlaps another's setting.
        self._processing = threading.Lock()
        self.rate = int(voice.codec.config.sampling_rate)
        self.limits = AudioLimits(max_seconds=float(config.max_ref_audio_seconds),
                                  max_bytes=config.max_ref_audio_bytes)
        self.codec = CachedCodecEncode(voice.codec, store, kind=CODEC_KIND).attach()
        super().__init__(name, config, owner_share)

    def check(self, req) -> SpeechSpec:
        """The request's fields as a ``SpeechSpec`` or an ``APIError`` (400) naming the field."""
        from encoders.voice import voice_prompt

        limits = self.config
        if req.response_format not in FORMATS:
            raise bad_request(f"response_format {req.response_format!r} is not supported: wav or pcm",
                              "response_format")
        if req.stream_format not in (None, "audio"):
            raise bad_request("stream_format 'sse' is not supported: the audio is sent whole (CSM decodes it only "
                              "after its last frame)", "stream_format")
        if req.speed not in (None, 1.0):
            raise bad_request("speed is not supported: CSM speaks at the reference voice's pace", "speed")
        if req.instructions:
            raise bad_request("instructions are not supported: the voice is the reference clip's", "instructions")
        if len(req.input) > limits.max_speech_chars:
            raise bad_request(f"input has {len(req.input)} characters, above the limit of "
                              f"{limits.max_speech_chars}", "input")
        if len(req.ref_text) > limits.max_ref_text_chars:
            raise bad_request(f"ref_text has {len(req.ref_text)} characters, above the limit of "
                              f"{limits.max_ref_text_chars}", "ref_text")
        if not req.ref_audio:
            raise bad_request("ref_audio is required: this server clones the voice of a reference clip (a data URL "
                              "or base64 of a WAV, FLAC or OGG file)", "ref_audio")
        if req.max_new_tokens is not None and req.max_new_tokens > limits.max_speech_frames:
            raise bad_request(f"max_new_tokens is {req.max_new_tokens}, above the limit of "
                              f"{limits.max_speech_frames} audio frames", "max_new_tokens")
        if req.temperature is not None and 0 < req.temperature < MIN_TEMPERATURE:
            raise bad_request(f"temperature {req.temperature} is below {MIN_TEMPERATURE}: give 0 for greedy "
                              f"decoding", "temperature")
        try:
            voice_prompt(req.ref_text, req.input)
        except InvalidRequest as e:
            raise bad_request(str(e), "input") from None
        seed = secrets.randbelow(2**63) if req.seed is None else req.seed
        return SpeechSpec(req.input, req.ref_text, req.response_format, req.max_new_tokens, seed, req.temperature)

    def check_room(self, owner: str | None) -> None:
        """``QueueFull`` when a request of the tenant ``owner`` could not be queued now: called before the clip is
        decoded, so that a full queue costs no decode. ``submit`` checks again (another request may take the
        place meanwhile); this check only saves the work."""
        self.queue.check_room(owner)

    def prepare(self, spec: SpeechSpec, ref_audio: str) -> SpeechPrompt:
        """The reference clip decoded (``reference``) and the processor's prompt over it, with the frames to
        generate; an ``APIError`` (400) when the prompt and the frames do not fit in the backbone's context.
        Blocking: call it in a worker thread."""
        from encoders.voice import voice_prompt

        clip = self.reference(ref_audio)
        with self._processing:
            inputs = self.processor(text=[voice_prompt(spec.ref_text, spec.text)], audio=[clip.samples],
                                    return_tensors="pt", sampling_rate=self.rate)
        return SpeechPrompt(spec, inputs, self._frames(spec, inputs["input_ids"]), clip.preprocessing)

    def _frames(self, spec: SpeechSpec, input_ids: torch.Tensor) -> int:
        """The frames to generate after the prompt ``input_ids``: ``spec.frames``, or without it as many as fit
        up to ``max_speech_frames``; an ``APIError`` naming the part to shorten when they do not fit."""
        context, prompt = self.voice.context_length, int(input_ids.shape[-1])
        room = context - prompt
        frames = min(self.config.max_speech_frames, room) if spec.frames is None else spec.frames
        if 1 <= frames <= room:
            return frames
        clip_frames = int((input_ids == self.processor.audio_token_id).sum())
        if spec.frames is not None and room >= 1:
            culprit = "max_new_tokens"
        elif clip_frames > prompt - clip_frames:
            culprit = "ref_audio"
        else:
            culprit = "ref_text" if len(spec.ref_text) > len(spec.text) else "input"
        raise bad_request(f"the prompt is {prompt} positions ({clip_frames} of them the reference clip's frames) "
                          f"and {max(frames, 1)} audio frames are to follow, beyond the model's context of "
                          f"{context}: shorten {culprit}", culprit)

    def reference(self, ref_audio: str):
        """The reference clip as ``audio.DecodedAudio`` at the codec's rate, or an ``APIError`` (400 unreadable,
        413 beyond the limits). Blocking: call it in a worker thread."""
        from encoders.audio import decode_clip, read_audio

        try:
            source = ref_audio if ref_audio[:5].lower() == "data:" else self._base64(ref_audio)
            return decode_clip(read_audio(source, limits=self.limits), self.rate, self.limits)
        except MediaDecodeError as e:
            if beyond_limits(e):
                raise too_large(f"reference audio beyond the limits: {e.reason}", "ref_audio") from None
            raise bad_request(f"bad reference audio: {e.reason}", "ref_audio", "invalid_audio") from None

    def _base64(self, text: str) -> bytes:
        payload = re.sub(r"\s+", "", text)
        if len(payload) // 4 * 3 > self.limits.max_bytes:  # before decoding it
            raise too_large(f"ref_audio exceeds the limit of {self.limits.max_bytes} bytes", "ref_audio")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise bad_request("ref_audio is neither a data URL nor base64 (this server reads no paths or URLs)",
                              "ref_audio", "invalid_audio") from None
        if not data:
            raise bad_request("ref_audio is empty", "ref_audio", "invalid_audio")
        return data

    def submit(self, prompt: SpeechPrompt, salt: bytes, owner: str | None = None) -> Job:
        """Queue the request for the tenant ``owner`` (``QueueFull`` when the queue or the tenant's share of it
        is full); the job's result is the float32 samples."""
        return self.queue.submit(lambda job: self.render(prompt, salt, job), owner)

    def render(self, prompt: SpeechPrompt, salt: bytes, job: Job) -> np.ndarray:
        """The generated waveform (float32, mono, at ``rate``), in the calling thread; ``JobCancelled`` within
        one backbone layer of ``job`` being cancelled."""
        job.check()
        spec = prompt.spec
        options = {}
        if spec.temperature is not None:
            options = {"do_sample": True, "temperature": spec.temperature} if spec.temperature > 0 else \
                {"do_sample": False}
        with self.codec.salted(salt, preprocessing=prompt.preprocessing), self.voice.interruptible(job.check), \
                torch.no_grad(), _seeded(spec.seed):
            out = self.model.generate(**prompt.inputs, max_new_tokens=prompt.frames, output_audio=True,
                                      return_dict_in_generate=True, **options)
        audio = out.audio[0] if out.audio else torch.empty(0)
        return audio.detach().to("cpu", torch.float32).reshape(-1).numpy()

    def encode(self, samples: np.ndarray, response_format: str) -> bytes:
        return pcm16(samples) if response_format == "pcm" else float_wav(samples, self.rate)

    def close(self) -> None:
        super().close()
        self.codec.detach()


def float_wav(samples: np.ndarray, rate: int) -> bytes:
    """A mono 32-bit IEEE float WAV of ``samples``, written here rather than by libsndfile, whose float WAVs carry
    a PEAK chunk with the time of writing: the same samples always give the same bytes."""
    data = np.ascontiguousarray(samples, dtype="<f4").tobytes()
    fmt = struct.pack("<HHIIHHH", 3, 1, rate, rate * 4, 4, 32, 0)  # IEEE float, mono, 4-byte frames, no extension
    fact = struct.pack("<I", len(samples))  # frames: a non-PCM WAV states them
    chunks = b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"fact" + struct.pack("<I", 4) + fact \
        + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks


def pcm16(samples: np.ndarray) -> bytes:
    """OpenAI's ``pcm``: 16-bit signed little-endian samples, no header."""
    return np.round(np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


@contextlib.contextmanager
def _seeded(seed: int):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def speech_router(service: SpeechService, intake, metrics) -> APIRouter:
    """``POST /v1/audio/speech`` over ``service``, read through ``intake`` (an ``intake.Intake``)."""
    router = APIRouter()

    @router.post("/v1/audio/speech")
    async def speech(request: Request):
        arrival = time.perf_counter()
        with metrics.timed("speech", service.name) as outcome:
            tenant, req, salt = await intake.read(request, SpeechRequest, service.name)
            spec = service.check(req)
            try:
                service.check_room(tenant.name)
            except QueueFull as e:
                raise intake.busy(e) from None
            prompt = await asyncio.to_thread(service.prepare, spec, req.ref_audio)
            samples = await intake.run_job(request, lambda: service.submit(prompt, salt, tenant.name))
            if samples is None:
                outcome.status = 499
                return Response(status_code=499)
            body = service.encode(samples, spec.response_format)
            metrics.first_audio(service.name, time.perf_counter() - arrival)
            return Response(body, media_type=FORMATS[spec.response_format])

    return router
