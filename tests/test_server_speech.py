"""``POST /v1/audio/speech`` of ``mmcache serve --tts tiny-csm`` with two API keys: the audio equals, bit for bit,
the CSM pipeline's own for the same reference clip and seed (WAV samples and PCM); a reference voice shared by
two requests is a codec store hit; keys and cache salts share nothing; every error status with its OpenAI error
object and nothing held; a client gone before its turn cancels its job."""

import base64
import io

import httpx
import numpy as np
import openai
import pytest
import soundfile
import torch

from encoders.audio import decode_clip, read_audio
from encoders.voice import SAMPLING_RATE, voice_prompt
from mmcache.presets.tts import csm_pipeline
from mmcache.presets import serve
from mmcache.server import ServerConfig
from mmcache.server.speech import float_wav, pcm16
from server_helpers import Blocked, cancelled_from_a_hook, data_url, error_of, metric, scrape, store_holds

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "tiny-csm"
KEYS = ("key-alpha", "key-beta")
FRAMES = 3
REF_TEXT = "The reference clip says this."


def tone(seconds: float, rate: int, freq: float) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * freq * t) * np.exp(-t)).astype(np.float32)


def clip(seconds=0.6, rate=16_000, freq=220.0, fmt="WAV") -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, tone(seconds, rate, freq), rate, format=fmt)
    return buf.getvalue()


@pytest.fixture(scope="module")
def server(one_thread):
    config = ServerConfig(tts=MODEL, api_keys=KEYS, max_speech_frames=FRAMES, max_speech_chars=200,
                          max_ref_audio_seconds=2.0, max_generation_waiting=2, max_body_bytes=512 * 1024)
    with serve(config) as srv:
        yield srv
    srv.store.check_invariants()
    assert store_holds(srv.store) == 0


@pytest.fixture(scope="module")
def reference():
    """The same tiny CSM, built apart, its codec unpatched: transformers' own generate."""
    voice = csm_pipeline(codec="tiny")

    def run(text: str, ref: bytes, seed: int = 0, frames: int = FRAMES, **options) -> np.ndarray:
        samples = decode_clip(read_audio(ref), SAMPLING_RATE).samples
        inputs = voice.processor(text=[voice_prompt(REF_TEXT, text)], audio=[samples], return_tensors="pt",
                                 sampling_rate=SAMPLING_RATE)
        with torch.inference_mode(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            out = voice.model.generate(**inputs, max_new_tokens=frames, output_audio=True,
                                       return_dict_in_generate=True, **options)
        return out.audio[0].to(torch.float32).numpy()

    return run


def _client(server, key=KEYS[0]):
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0)


def _post(server, body: dict, key=KEYS[0], timeout=60) -> httpx.Response:
    body = {"model": MODEL, "voice": "cloned", "ref_text": REF_TEXT, **body}
    return httpx.post(server.base_url + "/audio/speech", json=body, timeout=timeout,
                      headers={"Authorization": f"Bearer {key}"})


def _samples(wav: bytes) -> np.ndarray:
    samples, rate = soundfile.read(io.BytesIO(wav), dtype="float32")
    assert rate == SAMPLING_RATE
    return samples


def _codec(server) -> tuple[float, float]:
    samples = scrape(server.url)
    return (metric(samples, "mmcache:encoder_cache_queries_total", kind="codec"),
            metric(samples, "mmcache:encoder_cache_hits_total", kind="codec"))


def _sound(server):
    server.store.check_invariants()
    assert store_holds(server.store) == 0


def test_speech_equals_the_pipelines_own_bit_for_bit(server, reference):
    ref = clip()  # 16 kHz: resampled to the codec's 24 kHz
    got = _client(server).audio.speech.create(model=MODEL, voice="cloned", input="Good morning to you.",
                                              response_format="wav",
                                              extra_body={"ref_audio": data_url(ref, "audio/wav"),
                                                          "ref_text": REF_TEXT, "seed": 3})
    want = reference("Good morning to you.", ref, seed=3)
    assert want.size > 0 and np.array_equal(_samples(got.content), want)
    flac = clip(0.5, SAMPLING_RATE, 330.0, "FLAC")  # at the codec's rate, as bare base64
    r = _post(server, {"input": "See you tomorrow.", "ref_audio": base64.b64encode(flac).decode(),
                       "response_format": "pcm"})
    assert r.status_code == 200 and r.headers["content-type"] == "audio/pcm"
    assert r.content == pcm16(reference("See you tomorrow.", flac))
    sampled = {"input": "Sampled speech.", "ref_audio": data_url(ref, "audio/wav"), "temperature": 0.9, "seed": 5}
    one, two = _post(server, sampled), _post(server, sampled)
    assert one.content == two.content  # the same seed, the same audio
    assert np.array_equal(_samples(one.content), reference("Sampled speech.", ref, seed=5, do_sample=True,
                                                           temperature=0.9))
    _sound(server)


def test_a_shared_reference_voice_is_a_codec_store_hit(server):
    ref = data_url(clip(0.8, 22_050, 180.0), "audio/wav")
    q0, h0 = _codec(server)
    ttfa0 = metric(scrape(server.url), "mmcache:time_to_first_audio_seconds_count")
    assert _post(server, {"input": "First line.", "ref_audio": ref}).status_code == 200
    q1, h1 = _codec(server)
    assert (q1 - q0, h1 - h0) == (1, 0)
    assert _post(server, {"input": "Second line, same voice.", "ref_audio": ref}).status_code == 200
    q2, h2 = _codec(server)
    assert (q2 - q1, h2 - h1) == (1, 1)
    samples = scrape(server.url)
    assert metric(samples, "mmcache:time_to_first_audio_seconds_count") == ttfa0 + 2
    assert metric(samples, "mmcache:endpoint_requests_total", endpoint="speech", status="200") >= 2
    _sound(server)


def test_keys_and_salts_share_nothing(server):
    ref = data_url(clip(0.7, 16_000, 260.0), "audio/wav")
    first = _post(server, {"input": "Tenant line.", "ref_audio": ref, "cache_salt": "s"})
    h0 = _codec(server)[1]
    other_key = _post(server, {"input": "Tenant line.", "ref_audio": ref, "cache_salt": "s"}, key=KEYS[1])
    other_salt = _post(server, {"input": "Tenant line.", "ref_audio": ref, "cache_salt": "t"})
    assert _codec(server)[1] == h0
    same = _post(server, {"input": "Tenant line.", "ref_audio": ref, "cache_salt": "s"})
    assert _codec(server)[1] == h0 + 1
    assert first.content == other_key.content == other_salt.content == same.content
    _sound(server)


@pytest.mark.parametrize("change, status, param, code", [
    ({"ref_audio": None}, 400, "ref_audio", None),
    ({"ref_audio": data_url(b"RIFF\0\0\0\0WAVEjunk" * 4, "audio/wav")}, 400, "ref_audio", "invalid_audio"),
    ({"ref_audio": "/etc/hosts"}, 400, "ref_audio", "invalid_audio"),
    ({"ref_audio": data_url(clip(3.0), "audio/wav")}, 413, "ref_audio", "request_too_large"),
    ({"response_format": "mp3"}, 400, "response_format", None),
    ({"stream_format": "sse"}, 400, "stream_format", None),
    ({"max_new_tokens": FRAMES + 1}, 400, "max_new_tokens", None),
    ({"seed": -1}, 400, "seed", None),
    ({"input": "x" * 201}, 400, "input", None),
    ({"input": ""}, 400, "input", None),
    ({"ref_text": "<|AUDIO|>"}, 400, "input", None),
    ({"model": "another-model"}, 404, "model", "model_not_found"),
    ({"ref_audio": "A" * 600_000}, 413, None, "request_too_large"),
])
def test_bad_requests_get_their_error_and_hold_nothing(server, change, status, param, code):
    entries, (queries, _) = len(server.store), _codec(server)
    body = {"input": "Hello there.", "ref_audio": data_url(clip(), "audio/wav"), **change}
    r = _post(server, {k: v for k, v in body.items() if v is not None})
    assert r.status_code == status, r.text
    err = error_of(r)
    assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    assert len(server.store) == entries and _codec(server)[0] == queries  # no codec ran, nothing stored
    _sound(server)


def test_missing_key_and_full_queue(server):
    r = httpx.post(server.base_url + "/audio/speech", json={"model": MODEL, "input": "hi"}, timeout=30)
    assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        _client(server, "key-gamma").audio.speech.create(model=MODEL, voice="x", input="hi")
    queue = server.services["speech"].queue
    with Blocked(queue, waiting=queue.max_waiting):
        r = _post(server, {"input": "Busy?", "ref_audio": data_url(clip(), "audio/wav")})
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        assert error_of(r)["code"] == "queue_full"
    _sound(server)


def test_a_client_gone_before_its_turn_cancels_its_job(server):
    queue = server.services["speech"].queue
    before = _codec(server)[0]
    gone = metric(scrape(server.url), "mmcache:endpoint_requests_total", endpoint="speech", status="499")
    with Blocked(queue):
        with pytest.raises(httpx.ReadTimeout):
            _post(server, {"input": "Nobody waits.", "ref_audio": data_url(clip(), "audio/wav")},
                  timeout=httpx.Timeout(30, read=0.5))
        for _ in range(400):
            if metric(scrape(server.url), "mmcache:endpoint_requests_total", endpoint="speech", status="499") > gone:
                break
        else:
            raise AssertionError("the server did not see the client go")
        assert queue.waiting == 0
    assert _codec(server)[0] == before  # the job never ran: no codec lookup
    _sound(server)


def test_wav_bytes_depend_on_the_samples_alone():
    x = np.random.default_rng(0).standard_normal(999).astype(np.float32) * 0.3
    wav = float_wav(x, SAMPLING_RATE)
    assert wav == float_wav(x.copy(), SAMPLING_RATE)  # no time of writing inside (libsndfile's PEAK chunk has one)
    samples, rate = soundfile.read(io.BytesIO(wav), dtype="float32")
    assert rate == SAMPLING_RATE and np.array_equal(samples, x)
    assert soundfile.info(io.BytesIO(wav)).subtype == "FLOAT"


def test_a_job_cancelled_while_it_runs_stops_at_its_next_frame(server):
    from mmcache.server.speech import SpeechSpec

    service = server.services["speech"]
    reference = service.reference(data_url(clip(0.5, 16_000, 300.0), "audio/wav"))
    spec = SpeechSpec("Stop me.", REF_TEXT, "wav", FRAMES, 0, None)
    frames = cancelled_from_a_hook(service.model.depth_decoder,
                                   lambda job: service.render(spec, reference, b"", job))
    assert frames == service.model.config.num_codebooks - 1  # one frame's depth decoding of FRAMES
    _sound(server)


def test_the_codec_entry_kind_is_checked(server):
    from encoders.codec import CachedCodecEncode
    from mmcache.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="entry kind"):
        CachedCodecEncode(server.services["speech"].codec.codec, server.store, kind="")
