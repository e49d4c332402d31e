"""Reference clips at the rate they come in (encoders/audio.py): resampled to the codec's rate by one fixed
resampler, deterministically, with the resampling named in the codec's store key."""

import io

import numpy as np
import pytest
import soundfile
import soxr
import torch

from encoders.audio import RESAMPLER, AudioLimits, decode_audio, decode_clip, read_audio
from encoders.codec import CachedCodecEncode
from encoders.voice import SAMPLING_RATE
from mmcache.presets.tts import csm_pipeline
from mmcache.errors import InvalidRequest, MediaDecodeError
from mmcache.store import EncoderOutputStore

RATES = (8000, 16000, 22050, 24000, 44100, 48000)


def wav(samples: np.ndarray, rate: int, subtype: str = "FLOAT") -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format="WAV", subtype=subtype)
    return buf.getvalue()


def tone(seconds: float, rate: int, freq: float = 440.0) -> np.ndarray:
    t = np.arange(int(round(seconds * rate))) / rate
    return (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def soxr_length(n: int, source: int, target: int) -> int:
    """soxr's one-shot output length: n * target / source rounded half up (exact integer arithmetic)."""
    return (2 * n * target + source) // (2 * source)


@pytest.mark.parametrize("rate", RATES)
@pytest.mark.parametrize("channels", [1, 2])
def test_every_common_rate_is_accepted_resampled_and_deterministic(rate, channels):
    mono = tone(0.75, rate) + tone(0.75, rate, 97.0) * 0.5
    n = len(mono)
    data = wav(mono if channels == 1 else np.stack([mono, mono], axis=1), rate)
    first, second = (decode_clip(read_audio(data), SAMPLING_RATE) for _ in range(2))
    assert first.samples.dtype == np.float32 and first.samples.ndim == 1
    assert len(first.samples) == soxr_length(n, rate, SAMPLING_RATE)
    assert np.array_equal(first.samples, second.samples) and first.preprocessing == second.preprocessing
    assert first.source_rate == rate
    if rate == SAMPLING_RATE:  # untouched: the decoded samples themselves
        assert first.preprocessing is None and np.array_equal(first.samples, mono)
    else:
        assert first.preprocessing == {**RESAMPLER, "from": rate, "to": SAMPLING_RATE}
        assert RESAMPLER["resampler"] == "soxr" and RESAMPLER["version"] == soxr.__version__
    if channels == 2:  # two equal channels mix to the mono clip: the same samples
        assert np.array_equal(first.samples, decode_audio(read_audio(wav(mono, rate)), SAMPLING_RATE))


@pytest.mark.parametrize("rate", [r for r in RATES if r != SAMPLING_RATE])
def test_a_pure_tone_keeps_its_frequency(rate):
    clip = decode_clip(read_audio(wav(tone(1.0, rate, 440.0), rate)), SAMPLING_RATE).samples
    spectrum = np.abs(np.fft.rfft(clip * np.hanning(len(clip))))
    peak_hz = np.argmax(spectrum) * SAMPLING_RATE / len(clip)
    assert abs(peak_hz - 440.0) <= 1.0
    assert 0.25 < np.abs(clip[len(clip) // 4: -len(clip) // 4]).max() < 0.35  # the amplitude kept too


def test_duration_is_measured_at_the_source_rate_and_the_rate_is_bounded():
    limits = AudioLimits(max_seconds=1.0)
    for rate in (8000, 48000):
        assert len(decode_audio(read_audio(wav(tone(1.0, rate), rate)), SAMPLING_RATE, limits)) == SAMPLING_RATE
        with pytest.raises(MediaDecodeError, match="exceed the limit of 1.0 s"):
            decode_audio(read_audio(wav(tone(1.5, rate), rate)), SAMPLING_RATE, limits)
    with pytest.raises(MediaDecodeError, match="above the limit of 48000 Hz"):
        decode_clip(read_audio(wav(tone(0.1, 96000), 96000)), SAMPLING_RATE)
    assert len(decode_audio(read_audio(wav(tone(0.1, 96000), 96000)), SAMPLING_RATE,
                            AudioLimits(max_rate=96000))) == 2400
    with pytest.raises(InvalidRequest, match="max_rate"):
        AudioLimits(max_rate=0)


@pytest.fixture(scope="module")
def codec():
    return csm_pipeline(codec="tiny").codec


def test_the_codec_key_names_the_resampling(codec):
    clip = decode_clip(read_audio(wav(tone(0.5, 16000), 16000)), SAMPLING_RATE)
    again = decode_clip(read_audio(wav(tone(0.5, 16000), 16000)), SAMPLING_RATE)
    x = torch.from_numpy(clip.samples)[None, None]
    enc = CachedCodecEncode(codec, EncoderOutputStore(2**20))
    with enc.salted("t", preprocessing=clip.preprocessing):
        k = enc.key(x)
    with enc.salted("t", preprocessing=again.preprocessing):
        assert enc.key(torch.from_numpy(again.samples)[None, None]) == k  # the same clip, the same key
    other = {**clip.preprocessing, "quality": "VHQ"}
    assert enc.key(x, salt="t", preprocessing=other) != k
    assert enc.key(x, salt="t", preprocessing={**clip.preprocessing, "version": "0.0"}) != k
    assert enc.key(x, salt="t") != k  # the same samples without the descriptor: another key
    native = decode_clip(read_audio(wav(tone(0.5, SAMPLING_RATE), SAMPLING_RATE)), SAMPLING_RATE)
    y = torch.from_numpy(native.samples)[None, None]
    with enc.salted("t", preprocessing=native.preprocessing):  # None: keys exactly as without a descriptor
        assert enc.key(y) == enc.key(y, salt="t")
    with pytest.raises(InvalidRequest):
        with enc.salted("t", preprocessing={"gain": float("nan")}):
            pass


def test_a_served_resampled_clip_is_filed_under_its_descriptor(codec):
    store = EncoderOutputStore(2**22)
    clip = decode_clip(read_audio(wav(tone(0.4, 22050), 22050)), SAMPLING_RATE)
    x = torch.from_numpy(clip.samples)[None, None]
    with CachedCodecEncode(codec, store) as enc, torch.no_grad():
        with enc.salted(b"", preprocessing=clip.preprocessing):
            codec.encode(x)
            codec.encode(x)
        codec.encode(x)  # the same samples, no descriptor: not served the resampled clip's entry
    assert (enc.calls, enc.hits) == (2, 1)
    assert set(store._entries) == {enc.key(x, salt=b"", preprocessing=clip.preprocessing), enc.key(x, salt=b"")}
