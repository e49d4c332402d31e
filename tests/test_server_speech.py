"""``POST /v1/audio/speech`` of ``mmcache serve --tts tiny-csm`` with two API keys: the audio equals, bit for bit,
the CSM pipeline's own for the same reference clip and seed (WAV samples and PCM); a reference voice shared by
two requests is a codec store hit; keys and cache salts share nothing; every error status with its OpenAI error
object and nothing held; a long ref_text, a prompt beyond the context and a full queue (or a tenant at its share)
are refused before anything is queued, the last two before the clip is decoded; a client gone before its turn
cancels its job, and a job cancelled inside its prefill stops within one layer."""

import base64
import io
import json
import threading

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
REF_TEXT_CHARS = 1000  # within it, "€" (three byte tokens each) fills more than the model's 2048 positions


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
                          max_ref_text_chars=REF_TEXT_CHARS, max_ref_audio_seconds=2.0, max_generation_waiting=2,
                          max_body_bytes=512 * 1024)
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
    # json.dumps, not httpx's encoder: it writes NaN and Infinity, as a hostile client may
    return httpx.post(server.base_url + "/audio/speech", content=json.dumps(body), timeout=timeout,
                      headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})


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
    ({"ref_text": "x" * (REF_TEXT_CHARS + 1)}, 400, "ref_text", None),
    ({"ref_text": "€" * REF_TEXT_CHARS}, 400, "ref_text", None),  # the prompt alone overflows the context
    ({"max_new_tokens": 0}, 400, "max_new_tokens", None),
    ({"max_new_tokens": 10**30}, 400, "max_new_tokens", None),
    ({"max_new_tokens": 1.5}, 400, "max_new_tokens", None),
    ({"max_new_tokens": True}, 400, "max_new_tokens", None),
    ({"seed": 2**63}, 400, "seed", None),
    ({"seed": True}, 400, "seed", None),
    ({"seed": "7"}, 400, "seed", None),
    ({"temperature": 2.5}, 400, "temperature", None),
    ({"temperature": 1e-300}, 400, "temperature", None),  # divides the logits to inf in float32
    ({"temperature": float("nan")}, 400, "temperature", None),
    ({"temperature": True}, 400, "temperature", None),
    ({"speed": float("inf")}, 400, "speed", None),
    ({"speed": 0.1}, 400, "speed", None),
    ({"speed": 2.0}, 400, "speed", None),  # within OpenAI's range, but CSM has no speed
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


@pytest.fixture
def counted(server, monkeypatch):
    """Counts of the clips read (``encoders.audio.read_audio``, the decode's first step) and of the speech jobs
    queued (``SpeechService.submit``), from here on."""
    import encoders.audio

    counts = {"decoded": 0, "queued": 0}
    read_audio, service = encoders.audio.read_audio, server.services["speech"]
    submit = service.submit

    def counting_read(*args, **kwargs):
        counts["decoded"] += 1
        return read_audio(*args, **kwargs)

    def counting_submit(*args, **kwargs):
        job = submit(*args, **kwargs)
        counts["queued"] += 1
        return job

    monkeypatch.setattr(encoders.audio, "read_audio", counting_read)
    monkeypatch.setattr(service, "submit", counting_submit)
    return counts


def test_missing_key_and_full_queue(server, counted):
    r = httpx.post(server.base_url + "/audio/speech", json={"model": MODEL, "input": "hi"}, timeout=30)
    assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        _client(server, "key-gamma").audio.speech.create(model=MODEL, voice="x", input="hi")
    queue = server.services["speech"].queue
    with Blocked(queue):
        for i in range(queue.max_waiting):  # each of another owner: no tenant's share is reached
            queue.submit(lambda job: None, f"filler-{i}")
        r = _post(server, {"input": "Busy?", "ref_audio": data_url(clip(), "audio/wav")})
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        assert error_of(r)["code"] == "queue_full"
    assert counted == {"decoded": 0, "queued": 0}  # refused before the clip was decoded
    _sound(server)


def test_long_ref_text_is_refused_before_anything_is_decoded_or_queued(server, counted):
    r = _post(server, {"input": "Hello.", "ref_text": "A transcript. " * 30_000,  # 420 KB
                       "ref_audio": data_url(clip(), "audio/wav")})
    assert r.status_code == 400 and error_of(r)["param"] == "ref_text"
    assert str(REF_TEXT_CHARS) in error_of(r)["message"]
    assert counted == {"decoded": 0, "queued": 0}
    r = _post(server, {"input": "Hello.", "ref_text": "€" * REF_TEXT_CHARS, "ref_audio": data_url(clip(), "audio/wav")})
    assert r.status_code == 400 and "context of 2048" in error_of(r)["message"]
    assert counted == {"decoded": 1, "queued": 0}  # the prompt's length is known once the clip is read
    _sound(server)


def test_frames_beyond_the_context_left_are_refused_and_by_default_fewer_are_made(server):
    from mmcache.server.speech import SpeechSpec

    service, ref = server.services["speech"], data_url(clip(), "audio/wav")
    context = service.voice.context_length

    def room(ref_text: str) -> int:
        prompt = service.prepare(SpeechSpec("Hello.", ref_text, "wav", None, 0, None), ref)
        return context - prompt.inputs["input_ids"].shape[-1]

    euros = (room("") - 1) // 3  # "€" is three byte tokens: this leaves 1 to 3 positions
    ref_text = next(t for t in ("€" * euros + "a" * extra for extra in range(3)) if 1 <= room(t) < FRAMES)
    left = room(ref_text)
    r = _post(server, {"input": "Hello.", "ref_text": ref_text, "ref_audio": ref, "max_new_tokens": left + 1})
    assert r.status_code == 400 and error_of(r)["param"] == "max_new_tokens"
    assert f"context of {context}" in error_of(r)["message"]
    r = _post(server, {"input": "Hello.", "ref_text": ref_text, "ref_audio": ref, "response_format": "pcm"})
    assert r.status_code == 200  # none asked for: as many frames as fit
    frame = service.rate * 2 // 25  # Mimi: 12.5 frames a second, 2 bytes a PCM sample
    assert 0 < len(r.content) <= left * frame * 2 < FRAMES * frame * 2
    _sound(server)


def test_a_tenant_at_its_share_gets_503_and_another_is_still_admitted(server, counted):
    queue = server.services["speech"].queue
    assert queue.owner_share == 1  # two keys share max_generation_waiting=2
    answers = {}

    def post(name, key):
        answers[name] = _post(server, {"input": f"Line of {name}.", "ref_audio": data_url(clip(), "audio/wav")},
                              key=key)

    def wait_for(waiting):
        for _ in range(2000):
            if queue.waiting == waiting:
                return
            threading.Event().wait(0.01)
        raise AssertionError(f"the queue never held {waiting} waiting jobs")

    with Blocked(queue):
        first_a = threading.Thread(target=post, args=("a1", KEYS[0]))
        first_a.start()
        wait_for(1)
        second_a = _post(server, {"input": "Again.", "ref_audio": data_url(clip(), "audio/wav")}, key=KEYS[0])
        assert second_a.status_code == 503 and "share" in error_of(second_a)["message"]
        assert counted == {"decoded": 1, "queued": 1}  # tenant A's second request decoded nothing
        first_b = threading.Thread(target=post, args=("b1", KEYS[1]))
        first_b.start()
        wait_for(2)
    first_a.join(60)
    first_b.join(60)
    assert answers["a1"].status_code == answers["b1"].status_code == 200
    assert counted == {"decoded": 2, "queued": 2}
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
    spec = SpeechSpec("Stop me.", REF_TEXT, "wav", FRAMES, 0, None)
    prompt = service.prepare(spec, data_url(clip(0.5, 16_000, 300.0), "audio/wav"))
    frames = cancelled_from_a_hook(service.model.depth_decoder, lambda job: service.render(prompt, b"", job))
    assert frames == service.model.config.num_codebooks - 1  # one frame's depth decoding of FRAMES
    _sound(server)


def test_a_job_cancelled_inside_its_prefill_stops_before_the_next_layer(server):
    from mmcache.server.speech import SpeechSpec
    from mmcache.server.job_queue import Job, JobCancelled

    service, model = server.services["speech"], server.services["speech"].model
    holds, queries = store_holds(server.store), _codec(server)[0]
    spec = SpeechSpec("Stop me in the prefill.", "A long transcript to prefill. " * 30, "wav", FRAMES, 0, None)
    prompt = service.prepare(spec, data_url(clip(1.5, 16_000, 200.0), "audio/wav"))
    job, cancelled_at, ran_after = Job(lambda j: None), [], []

    def cancel(module, args, output):  # the first backbone layer's first forward: the prefill
        if not cancelled_at:
            cancelled_at.append(args[0].shape[1])
            job.cancel()

    def count(module, args, output):
        if job.cancelled.is_set():
            ran_after.append(module)

    later = [*model.backbone_model.layers[1:], model.backbone_model.norm, model.depth_decoder]
    hooks = [model.backbone_model.layers[0].register_forward_hook(cancel)]
    hooks += [m.register_forward_hook(count) for m in later]
    try:
        with pytest.raises(JobCancelled):
            service.render(prompt, b"", job)
    finally:
        for hook in hooks:
            hook.remove()
    assert cancelled_at == [prompt.inputs["input_ids"].shape[-1]]  # cancelled in the prefill of every position
    assert ran_after == []  # no later layer ran: the prefill stopped within one layer
    assert _codec(server)[0] == queries + 1  # the codec ran before the prefill...
    assert store_holds(server.store) == holds == 0  # ...and its lease is back
    _sound(server)


def test_the_codec_entry_kind_is_checked(server):
    from encoders.codec import CachedCodecEncode
    from mmcache.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="entry kind"):
        CachedCodecEncode(server.services["speech"].codec.codec, server.store, kind="")


def test_the_ref_text_limit_is_an_option_and_checked():
    from mmcache.cli import build_parser
    from mmcache.server.cli import config_from_args
    from mmcache.server.config import ServerConfigError

    args = build_parser().parse_args(["serve", "--tts", MODEL, "--max-ref-text-chars", "300",
                                      "--max-speech-chars", "700"])
    assert config_from_args(args).max_ref_text_chars == 300 and config_from_args(args).max_speech_chars == 700
    assert ServerConfig(tts=MODEL).max_ref_text_chars == 4096
    for bad in (0, -1, 2.5, True, "300"):
        with pytest.raises(ServerConfigError, match="max_ref_text_chars"):
            ServerConfig(tts=MODEL, max_ref_text_chars=bad)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tts", MODEL, "--max-ref-text-chars", "0"])
