"""Crafted xxh3 collisions (tests/xxh3_collide.py) no longer give one input another's pages or outputs.

* Two valid 64x64 BMPs and two valid float32 WAVs, built here in milliseconds, have equal xxh3_128 digests in the
  framing the digests used before (length, bytes, parameters): the attack is real. Their media digests, store
  keys and codec keys now differ (BLAKE2b-256).
* End to end, on a tiny-llava ``VLMEngine``: after image A, image B with the same text is a store miss (the
  tower runs again) and matches pages only up to the page of its first placeholder; its output is what a
  cache-off engine gives for B.
* Through ``CachedCodecEncode``: clip B is a store miss and gets its own codes, not clip A's.
"""

import io

import numpy as np
import pytest
import torch
import xxhash
from PIL import Image

from encoders.audio import DECODE_PARAMS, RawAudio, decode_audio
from encoders.codec import CachedCodecEncode
from encoders.media import MediaRef, RawImage, decode_image
from encoders.voice import SAMPLING_RATE
from mmcache.presets.tts import csm_pipeline
from mmcache.engine import Engine, EngineConfig, SamplingParams
from mmcache.hosts.vlm import VLMEngine, VLMRequest
from mmcache.presets.vlm import build_vlm
from mmcache.names import media_digest
from mmcache.store import EncoderOutputStore, store_key

from xxh3_collide import colliding_bmps, colliding_wavs, xxh3_media_digest

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest

P = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
CLIP_SAMPLES = SAMPLING_RATE  # one second


@pytest.fixture(scope="module")
def bmps() -> tuple[bytes, bytes]:
    return colliding_bmps()


@pytest.fixture(scope="module")
def wavs() -> tuple[bytes, bytes]:
    return colliding_wavs(CLIP_SAMPLES, SAMPLING_RATE)


def pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


# ---- the pairs --------------------------------------------------------------------------------------------
def test_bmp_pair_collides_under_xxh3_and_not_under_media_digest(bmps):
    a, b = bmps
    ref = MediaRef(0, "bytes")
    for data in bmps:  # both decode, through the engine's own guarded decoder
        assert decode_image(RawImage(data, ref)).size == (64, 64)
    assert (pixels(a) != pixels(b)).any(-1).sum() > 2000  # of 4,096 pixels
    params = {"size": 336, "processor": "clip"}
    assert xxh3_media_digest(a, params) == xxh3_media_digest(b, params)  # the old media digest
    assert xxhash.xxh3_64(len(a).to_bytes(8, "little") + a).digest() == \
        xxhash.xxh3_64(len(b).to_bytes(8, "little") + b).digest()  # the accumulators themselves are equal
    assert media_digest(a, params) != media_digest(b, params)
    assert store_key("tower", media_digest(a, params)) != store_key("tower", media_digest(b, params))


def test_wav_pair_collides_under_xxh3_and_not_under_media_digest(wavs):
    a, b = wavs
    ref = MediaRef(0, "bytes", "audio")
    wave_a, wave_b = (decode_audio(RawAudio(w, ref), SAMPLING_RATE) for w in wavs)  # valid float32 WAV files
    assert wave_a.shape == wave_b.shape == (CLIP_SAMPLES,) and np.abs(wave_a).max() <= 1.0
    assert (wave_a != wave_b).sum() > 1000
    assert xxh3_media_digest(a, DECODE_PARAMS) == xxh3_media_digest(b, DECODE_PARAMS)  # as files
    params = {"dtype": "torch.float32", "shape": [1, 1, CLIP_SAMPLES]}
    assert xxh3_media_digest(wave_a.tobytes(), params) == xxh3_media_digest(wave_b.tobytes(), params)  # waveforms
    assert media_digest(a, DECODE_PARAMS) != media_digest(b, DECODE_PARAMS)
    assert media_digest(wave_a.tobytes(), params) != media_digest(wave_b.tobytes(), params)


# ---- end to end -------------------------------------------------------------------------------------------
def vlm_front(preset, mode: str) -> VLMEngine:
    cfg = EngineConfig(page_size=P, cache_mode=mode, num_pages=128)
    return VLMEngine(Engine(preset.model, None, cfg), preset.prompt_builder(EncoderOutputStore(1 << 24)))


def chat(image: bytes) -> list:
    system = "A chat between a curious human and an artificial intelligence assistant about a photo."
    return [{"role": "system", "content": system},
            {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What is it?"}]}]


def test_vlm_serves_the_second_image_neither_the_first_features_nor_its_pages(bmps, tower_calls):
    preset = build_vlm("tiny-llava")
    on, off = vlm_front(preset, "on"), vlm_front(preset, "off")
    a, b = bmps
    params = on.builder.adapter.preprocess_params
    assert xxh3_media_digest(a, params) == xxh3_media_digest(b, params)  # the old digests would have matched
    with off.builder.from_messages(chat(a)) as prompt:  # the first placeholder's position (off's own store)
        first = prompt.embeds[0][0]
    calls = tower_calls(on)  # the engines share the model, so its tower, from here on
    out_a, out_b = (on.generate([VLMRequest(chat(image), sampling=GREEDY)])[0] for image in (a, b))
    assert len(calls) == 2 and on.store.metrics.computes == 2 and on.store.metrics.hits == 0
    assert len(on.store) == 2
    assert out_a.matched_tokens == 0
    assert out_b.matched_tokens == first // P * P  # the pages before the image, none past it
    want_b = off.generate([VLMRequest(chat(b), sampling=GREEDY)])[0]
    assert out_b.output_ids == want_b.output_ids
    on.check_invariants()


def test_codec_serves_the_second_clip_its_own_codes(wavs):
    codec = csm_pipeline(codec="tiny").codec
    ref = MediaRef(0, "bytes", "audio")
    clips = [torch.from_numpy(decode_audio(RawAudio(w, ref), SAMPLING_RATE)).view(1, 1, -1) for w in wavs]
    with torch.inference_mode():
        with CachedCodecEncode(codec, None):
            want = [codec.encode(clip).audio_codes for clip in clips]
        assert not torch.equal(want[0], want[1])  # the clips' true codes differ
        store = EncoderOutputStore(1 << 24)
        with CachedCodecEncode(codec, store) as enc:
            got = [codec.encode(clip).audio_codes for clip in clips]
            keys = [enc.key(clip) for clip in clips]
    assert keys[0] != keys[1]
    assert enc.calls == 2 and enc.hits == 0 and store.metrics.computes == 2 and len(store) == 2
    assert all(torch.equal(g, w) for g, w in zip(got, want))
