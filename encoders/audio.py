"""Reference audio as a request sends it: the bytes as sent, and a guarded decode into a mono waveform.

A voice-cloning request names its reference voice by raw bytes (a WAV, FLAC or OGG file), a file path (or
``file://`` URL, for callers that opt in: ``AudioLimits.allow_paths`` / ``path_root``) or a data URL
(``data:audio/wav;base64,...``). ``read_audio`` returns the bytes as sent (``RawAudio``), ``decode_clip`` the
waveform the pipeline's feature extractor takes at the encoder's rate and how it got there (``DecodedAudio``),
``decode_audio`` the waveform alone.

Invariants:

* Every failure to read or decode an item raises ``MediaDecodeError`` whose ``item`` is a ``MediaRef`` with
  medium ``"audio"`` (index in the request, source kind); nothing else escapes for bad input.
* Byte sizes are checked against ``AudioLimits.max_bytes`` before a payload is read, and the duration (frames
  over the source's sample rate) and channel count, from the header, against ``max_seconds`` and
  ``max_channels`` before any sample is decoded: a compressed file of a few kilobytes cannot decode into
  gigabytes.
* A clip at another rate than the encoder's is resampled to it with one fixed resampler (``RESAMPLER``: soxr,
  its version, quality ``HQ``, computed in float64 on the float32 mono mix, then float32): the same bytes give
  the same samples, of length ``floor(n * target / source + 1/2)`` for ``n`` source frames. A clip already at
  the encoder's rate is not touched (``DecodedAudio.preprocessing`` is None). Otherwise ``preprocessing`` names
  the resampler, its settings and both rates; a cache key taken over the samples must fold it in
  (``codec.CachedCodecEncode.salted``), so that another resampling never shares a key with this one.
* Source rates above ``AudioLimits.max_rate`` are refused from the header (decoded samples grow with the rate).
* Only the containers ``AudioLimits.formats`` names are decoded (WAV, FLAC and OGG by default; WAV covers its
  extensible header, WAVEX), refused from the header otherwise.
* A truncated WAV is refused, not decoded to the frames it still holds: its data chunk declares more bytes
  than the file holds (libsndfile would shorten it silently); so is a file that decodes to fewer frames than
  its header declares (FLAC's stream info). An OGG file declares no length before its last page, so it is
  walked page by page (``ogg_unended``): a page cut short, or a logical stream without its end-of-stream page,
  is refused. Other containers (AIFF, CAF, W64, RF64), which libsndfile also shortens silently, are outside the
  default formats.
* A decoded waveform is float32, mono (several channels are averaged, the rule ``DECODE_PARAMS`` names) and
  finite; an empty or non-finite file is refused.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile
import soxr

from mmcache.checks import positive_int
from mmcache.errors import InvalidRequest, MediaDecodeError

from .media import MediaRef, check_limits, read_source

DECODE_PARAMS = {"decoder": f"libsndfile-{soundfile.__libsndfile_version__}",
                 "decode": "float32,mean-of-channels-in-float64"}
"""The decoder and its conversion rule, for any key taken over decoded samples."""

RESAMPLER = {"resampler": "soxr", "version": soxr.__version__, "quality": "HQ", "dtype": "float64"}
"""The one resampler a clip at another rate goes through, with every setting that changes its output."""

# libsndfile's name of a container -> the name ``AudioLimits.formats`` accepts it under: WAVEX is WAV's
# extensible header (the layout ffmpeg and SoX write for 24-bit and multichannel files), the same RIFF WAVE file.
_CONTAINERS = {"WAVEX": "WAV"}

_DECODE_FAILURES = (RuntimeError, TypeError, ValueError, EOFError, OSError)  # soundfile's errors for bad data


@dataclass(frozen=True)
class AudioLimits:
    """What a reference clip may cost before it is refused. The defaults accept five minutes of audio."""

    max_seconds: float = 300.0
    max_bytes: int = 64 * 2**20
    max_channels: int = 2  # a voice clip is mono or stereo; each channel costs a full decode
    # The highest source rate decoded: a clip's samples before resampling grow with it. 48 kHz is the highest
    # rate of ordinary recordings (studio masters at 96 or 192 kHz are not reference clips).
    max_rate: int = 48_000
    formats: tuple[str, ...] = ("WAV", "FLAC", "OGG")  # libsndfile's container names
    # Local paths are for trusted callers only, as for images (``media.ImageLimits``): True reads any file the
    # process can read, ``path_root`` only files inside that folder (and turns paths on by itself).
    allow_paths: bool = False
    path_root: Path | None = None

    def __post_init__(self):
        check_limits(self, ("max_bytes", "max_channels", "max_rate"))
        if not isinstance(self.formats, (tuple, list)) or not all(isinstance(f, str) for f in self.formats):
            raise InvalidRequest(f"formats must be a tuple of container names, got {self.formats!r}")
        object.__setattr__(self, "formats", tuple(self.formats))
        m = self.max_seconds
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 < m < float("inf"):
            raise InvalidRequest(f"max_seconds must be a positive finite number, got {m!r}")


@dataclass(frozen=True)
class DecodedAudio:
    """A clip at the encoder's rate: ``samples`` (float32 mono), the rate it came at, and how it was changed
    (None when it came at the encoder's rate; else ``RESAMPLER`` with ``from`` and ``to`` rates)."""

    samples: np.ndarray
    source_rate: int
    preprocessing: dict | None


@dataclass(frozen=True)
class RawAudio:
    """An audio file's bytes exactly as sent, and where in the request it came from."""

    data: bytes
    ref: MediaRef


def read_audio(source: object, index: int = 0, limits: AudioLimits = AudioLimits()) -> RawAudio:
    """The bytes as sent of ``source`` (bytes-like, path, ``file://`` URL or data URL), without decoding them."""
    _check_limits(limits)
    if isinstance(source, RawAudio):
        return source
    return RawAudio(*read_source(source, index, limits, "audio"))


def decode_audio(raw: RawAudio, sampling_rate: int, limits: AudioLimits = AudioLimits()) -> np.ndarray:
    """The float32 mono waveform of ``raw`` (shape ``[samples]``) at ``sampling_rate``, or ``MediaDecodeError``
    (``decode_clip``'s samples; a key over them must also take its ``preprocessing``)."""
    return decode_clip(raw, sampling_rate, limits).samples


def decode_clip(raw: RawAudio, sampling_rate: int, limits: AudioLimits = AudioLimits()) -> DecodedAudio:
    """``raw`` decoded to a float32 mono waveform at ``sampling_rate``, resampled when it came at another rate
    (module docstring), with the rate it came at and the resampling's descriptor; or ``MediaDecodeError``."""
    wave, rate = _decode(raw, sampling_rate, limits)
    if rate == sampling_rate:
        return DecodedAudio(np.ascontiguousarray(wave, dtype=np.float32), rate, None)
    try:
        out = soxr.resample(wave.astype(np.float64), rate, sampling_rate, quality=RESAMPLER["quality"])
    except (ValueError, RuntimeError) as e:  # soxr's refusals of a ratio it cannot take
        raise MediaDecodeError(raw.ref, f"cannot resample from {rate} Hz to {sampling_rate} Hz: {e}") from None
    samples = np.ascontiguousarray(out, dtype=np.float32)
    if not len(samples) or not np.isfinite(samples).all():  # the filter's overshoot can pass float32's range
        raise MediaDecodeError(raw.ref, f"resampled from {rate} Hz, the clip holds no samples or non-finite ones")
    return DecodedAudio(samples, rate, {**RESAMPLER, "from": rate, "to": sampling_rate})


def _decode(raw: RawAudio, sampling_rate: int, limits: AudioLimits) -> tuple[np.ndarray, int]:
    """The float32 mono waveform of ``raw`` at its own rate, and that rate; every check of the module docstring
    made."""
    _check_arguments(raw, sampling_rate, limits)
    _check_whole(raw)
    try:
        with soundfile.SoundFile(io.BytesIO(raw.data)) as f:  # reads the header only
            rate, frames, channels = f.samplerate, f.frames, f.channels
            _check_header(raw.ref, f.format, rate, frames, channels, limits)
            samples = f.read(dtype="float32", always_2d=True)
    except MediaDecodeError:
        raise
    except _DECODE_FAILURES as e:
        raise MediaDecodeError(raw.ref, f"not a readable audio file: {e}") from None
    if len(samples) != frames:
        raise MediaDecodeError(raw.ref, f"truncated audio: {len(samples)} of {frames} frames")
    return _mono(samples, raw.ref), rate


def _check_arguments(raw: RawAudio, sampling_rate: int, limits: AudioLimits) -> None:
    """``InvalidRequest`` for a caller's mistake: a bad rate, bad limits, or no ``RawAudio`` of bytes."""
    if not positive_int(sampling_rate):
        raise InvalidRequest(f"sampling_rate must be a positive int, got {sampling_rate!r}")
    _check_limits(limits)
    if not isinstance(raw, RawAudio):
        raise InvalidRequest(f"decode_audio takes a RawAudio (see read_audio), got {type(raw).__name__}")
    if not isinstance(raw.data, (bytes, bytearray)):
        raise InvalidRequest(f"RawAudio.data must be bytes, got {type(raw.data).__name__}")


def _check_whole(raw: RawAudio) -> None:
    """``MediaDecodeError`` for empty bytes, or a WAV or OGG file cut short (which libsndfile would shorten)."""
    if not raw.data:
        raise MediaDecodeError(raw.ref, "audio bytes are empty")
    shortfall = wav_data_shortfall(raw.data)
    if shortfall:
        raise MediaDecodeError(raw.ref, f"truncated WAV: its data chunk declares {shortfall[0]} bytes, the file "
                                        f"holds {shortfall[1]}")
    unended = ogg_unended(raw.data)
    if unended:
        raise MediaDecodeError(raw.ref, f"truncated OGG: {unended}")


def _check_header(ref: MediaRef, container: str, rate: int, frames: int, channels: int,
                  limits: AudioLimits) -> None:
    """``MediaDecodeError`` where the header's container, channels, rate or length is outside ``limits`` (or
    there are no frames): refused before any sample is decoded."""
    if _CONTAINERS.get(container, container) not in limits.formats:
        raise MediaDecodeError(ref, f"container {container} is not accepted (accepted: {', '.join(limits.formats)})")
    if channels > limits.max_channels:
        raise MediaDecodeError(ref, f"{channels} channels exceed the limit of {limits.max_channels} "
                                    f"(refused before decoding)")
    if rate > limits.max_rate:
        raise MediaDecodeError(ref, f"sampled at {rate} Hz, above the limit of {limits.max_rate} Hz "
                                    f"(max_rate; refused before decoding)")
    if frames <= 0:
        raise MediaDecodeError(ref, "audio has no samples")
    if frames > limits.max_seconds * rate:
        raise MediaDecodeError(ref, f"{frames / rate:.1f} s exceed the limit of {limits.max_seconds} s "
                                    f"(refused before decoding)")


def _mono(samples: np.ndarray, ref: MediaRef) -> np.ndarray:
    """The float32 mono mix of decoded ``samples`` (frames, channels); ``MediaDecodeError`` if not finite."""
    # Channels are summed in float64: a float32 sum of loud float samples (near 3.4e38) overflows to inf. For
    # two channels (the default limit) the result equals float32's mean wherever that one is finite.
    wave = samples[:, 0] if samples.shape[1] == 1 else samples.mean(axis=1, dtype=np.float64).astype(np.float32)
    if not np.isfinite(wave).all():
        raise MediaDecodeError(ref, "audio holds non-finite samples")
    return wave


_WAV_UNKNOWN_SIZES = (0, 0xFFFFFFFF)  # what streaming writers put where the length is not known yet


def wav_data_shortfall(data: bytes) -> tuple[int, int] | None:
    """``(declared, held)`` bytes of a RIFF/RIFX WAVE file's data chunk when it declares more than the file
    holds after its header, else None (also for other formats, a data chunk of unknown size, or a chunk list
    too broken to walk, which the decoder refuses on its own)."""
    if len(data) < 12 or data[:4] not in (b"RIFF", b"RIFX") or data[8:12] != b"WAVE":
        return None
    order = "little" if data[:4] == b"RIFF" else "big"
    at = 12
    while at + 8 <= len(data):
        size = int.from_bytes(data[at + 4:at + 8], order)
        if data[at:at + 4] == b"data":
            held = len(data) - (at + 8)
            return (size, held) if size not in _WAV_UNKNOWN_SIZES and size > held else None
        at += 8 + size + (size & 1)  # chunks are padded to an even size
    return None


_OGG_CAPTURE, _OGG_HEADER, _OGG_EOS = b"OggS", 27, 0x04


def ogg_unended(data: bytes) -> str | None:
    """Why an Ogg file (``OggS`` at its start) is cut short, or None: it is walked page by page (a 27-byte header,
    a segment table, then the segments); a page that runs past the end of the file, bytes after the last page
    that are not one, or a logical stream (by serial number) whose last page does not carry the end-of-stream
    flag, which every complete stream's last page does, is cut short. None for other formats."""
    if not data.startswith(_OGG_CAPTURE):
        return None
    at, ended = 0, {}
    while at < len(data):
        if data[at:at + 4] != _OGG_CAPTURE or at + _OGG_HEADER > len(data):
            return f"bytes at offset {at} are not a whole Ogg page header"
        segments = data[at + 26]
        table = data[at + _OGG_HEADER:at + _OGG_HEADER + segments]
        end = at + _OGG_HEADER + segments + sum(table)
        if len(table) < segments or end > len(data):
            return f"its page at offset {at} runs past the end of the file"
        ended[int.from_bytes(data[at + 14:at + 18], "little")] = bool(data[at + 5] & _OGG_EOS)
        at = end
    open_streams = [serial for serial, eos in ended.items() if not eos]
    return f"{len(open_streams)} stream(s) without their end-of-stream page" if open_streams else None


def _check_limits(limits) -> None:
    if not isinstance(limits, AudioLimits):
        raise InvalidRequest(f"limits must be an AudioLimits, got {type(limits).__name__}")
