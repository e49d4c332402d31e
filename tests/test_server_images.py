"""``POST /v1/images/generations`` of ``mmcache serve --diffusion tiny-sd3`` with two API keys: images equal, bit
for bit, the pipeline's own for the same seed (PNG decoded back); the deployment's negative prompt encoded once
per tenant and a store hit after; keys and cache salts that share no entry; every error status with its OpenAI
error object and nothing held; a client gone before its turn cancels its job."""

import base64
import io

import httpx
import numpy as np
import openai
import pytest
import soundfile
import torch
from PIL import Image

from mmcache.presets.diffusion import tiny_sd3_pipeline
from mmcache.presets import serve
from mmcache.server import ServerConfig, ServerConfigError
from mmcache.server.images import ImageSpec, NonFiniteOutput
from mmcache.server.job_queue import JobCancelled
from server_helpers import Blocked, cancelled_from_a_hook, data_url, error_of, metric, scrape, store_holds

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "tiny-sd3"
KEYS = ("key-alpha", "key-beta")
NEGATIVE = "blurry, low quality, watermark"
STEPS = 2


@pytest.fixture(scope="module")
def server(one_thread):
    config = ServerConfig(diffusion=(MODEL,), api_keys=KEYS, image_sizes=("16x16", "32x32"), negative_prompt=NEGATIVE,
                          max_images_per_request=2, max_inference_steps=4, max_generation_waiting=2,
                          max_body_bytes=32 * 1024)
    with serve(config) as srv:
        yield srv
    srv.store.check_invariants()
    assert store_holds(srv.store) == 0


@pytest.fixture(scope="module")
def reference():
    """The same tiny pipeline, built apart, run as diffusers runs it (its own text encoding, no store)."""
    pipe = tiny_sd3_pipeline()
    pipe.set_progress_bar_config(disable=True)

    def run(prompt, negative=NEGATIVE, size=(16, 16), n=1, seed=0, **kw):
        with torch.inference_mode():
            out = pipe(prompt=prompt, negative_prompt=negative, width=size[0], height=size[1], num_images_per_prompt=n,
                       num_inference_steps=STEPS, generator=torch.Generator("cpu").manual_seed(seed),
                       output_type="pil", **kw)
        return [np.asarray(im) for im in out.images]

    return run


def _client(server, key=KEYS[0]):
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0)


def _pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))))


def _post(server, body: dict, key=KEYS[0], timeout=60) -> httpx.Response:
    return httpx.post(server.base_url + "/images/generations", json=body, timeout=timeout,
                      headers={"Authorization": f"Bearer {key}"})


def _store_counts(server, kind: str) -> tuple[float, float]:
    samples = scrape(server.url)
    return (metric(samples, "mmcache:encoder_cache_queries_total", kind=kind),
            metric(samples, "mmcache:encoder_cache_hits_total", kind=kind))


def _sound(server):
    server.store.check_invariants()
    assert store_holds(server.store) == 0


def test_images_equal_the_pipelines_own_bit_for_bit(server, reference):
    got = _client(server).images.generate(model=MODEL, prompt="a red fox in the snow", size="16x16", n=2,
                                          response_format="b64_json",
                                          extra_body={"seed": 7, "num_inference_steps": STEPS})
    want = reference("a red fox in the snow", n=2, seed=7)
    assert got.created > 0 and len(got.data) == 2
    for image, pixels in zip(got.data, want):
        assert np.array_equal(_pixels(image.b64_json), pixels)
    body = {"prompt": "a lighthouse at dusk", "size": "32x32", "seed": 11, "num_inference_steps": STEPS,
            "negative_prompt": "dark", "guidance_scale": 4.5}  # model left out: the server's image model
    r = _post(server, body)
    assert r.status_code == 200, r.text
    (image,) = r.json()["data"]
    assert np.array_equal(_pixels(image["b64_json"]),
                          reference("a lighthouse at dusk", "dark", (32, 32), seed=11, guidance_scale=4.5)[0])
    again = _post(server, body).json()["data"][0]["b64_json"]
    assert again == image["b64_json"]  # the same seed, the same PNG bytes
    _sound(server)


def test_the_deployments_negative_prompt_is_encoded_once_then_hit(server):
    client = _client(server, KEYS[1])
    q0, h0 = _store_counts(server, "negative_prompt")
    t0, th0 = _store_counts(server, "text_encoder")
    client.images.generate(model=MODEL, prompt="a quiet harbour", size="16x16",
                           extra_body={"seed": 1, "num_inference_steps": STEPS, "cache_salt": "first-visit"})
    q1, h1 = _store_counts(server, "negative_prompt")
    assert (q1 - q0, h1 - h0) == (3, 0)  # CLIP-L, CLIP-G and T5 each encode the negative once
    client.images.generate(model=MODEL, prompt="a busy market", size="16x16",
                           extra_body={"seed": 2, "num_inference_steps": STEPS, "cache_salt": "first-visit"})
    q2, h2 = _store_counts(server, "negative_prompt")
    assert (q2 - q1, h2 - h1) == (3, 3)  # served from the store
    t2, th2 = _store_counts(server, "text_encoder")
    assert (t2 - t0, th2 - th0) == (6, 0)  # two different prompts: computed each
    samples = scrape(server.url)
    assert metric(samples, "mmcache:encoder_cache_hits_total", kind="position_bias") > 0
    assert metric(samples, "mmcache:endpoint_requests_total", endpoint="images", status="200") >= 2
    assert metric(samples, "mmcache:endpoint_latency_seconds_count", endpoint="images") >= 2
    _sound(server)


def test_keys_and_salts_share_nothing(server):
    body = {"prompt": "an owl on a branch", "size": "16x16", "seed": 5, "num_inference_steps": STEPS}

    def hits():
        return sum(_store_counts(server, kind)[1] for kind in ("text_encoder", "negative_prompt"))

    first = _post(server, {**body, "cache_salt": "tenant-salt"}).json()
    h0 = hits()
    other_key = _post(server, {**body, "cache_salt": "tenant-salt"}, key=KEYS[1]).json()
    other_salt = _post(server, {**body, "cache_salt": "another-salt"}).json()
    assert hits() == h0  # the other key, and the other salt, hit nothing of the first's
    same = _post(server, {**body, "cache_salt": "tenant-salt"}).json()
    assert hits() == h0 + 6  # its own: prompt and negative, three encoders each
    assert first["data"] == other_key["data"] == other_salt["data"] == same["data"]  # isolation changes no pixel
    _sound(server)


@pytest.mark.parametrize("change, status, param, code", [
    ({"size": "64x64"}, 400, "size", "invalid_size"),
    ({"size": "large"}, 400, "size", "invalid_size"),
    ({"n": 3}, 400, "n", None),
    ({"num_inference_steps": 5}, 400, "num_inference_steps", None),
    ({"seed": -1}, 400, "seed", None),
    ({"response_format": "url"}, 400, "response_format", None),
    ({"model": "another-model"}, 404, "model", "model_not_found"),
    ({"prompt": ""}, 400, "prompt", None),
    ({"cache_salt": "s" * 300}, 400, "cache_salt", None),
    ({"prompt": "x" * 40_000}, 413, None, "request_too_large"),
    # tiny-sd3's tokenizers keep at most 256 tokens: 16 characters a token is the most worth reading
    ({"prompt": "x" * 4097}, 400, "prompt", None),
    ({"negative_prompt": "x" * 4097}, 400, "negative_prompt", None),
    ({"guidance_scale": 1e308}, 400, "guidance_scale", None),  # a flat PNG with a 200 before
    ({"guidance_scale": 100.5}, 400, "guidance_scale", None),
    ({"guidance_scale": -0.5}, 400, "guidance_scale", None),
])
def test_bad_requests_get_their_error_and_hold_nothing(server, change, status, param, code):
    entries, encoded = len(server.store), _store_counts(server, "text_encoder")[0]
    body = {"prompt": "a boat", "size": "16x16", "num_inference_steps": STEPS, **change}
    r = _post(server, body)
    assert r.status_code == status, r.text
    err = error_of(r)
    assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    assert len(server.store) == entries and _store_counts(server, "text_encoder")[0] == encoded
    assert server.services["images"].queue.waiting == 0
    _sound(server)


def test_the_longest_prompts_read_are_served(server):
    r = _post(server, {"prompt": "x" * 4096, "negative_prompt": "y" * 4096, "size": "16x16",
                       "num_inference_steps": 1, "guidance_scale": 100})
    assert r.status_code == 200, r.text
    _sound(server)


def test_pixels_that_are_not_finite_are_a_failure_never_an_image(server):
    service = server.services["images"]
    spec = ImageSpec("an overflowing render", NEGATIVE, 16, 16, 1, 0, 1e308, 1)  # past check()'s bound
    with pytest.raises(NonFiniteOutput, match="NaN"):
        service.render(spec, b"")
    _sound(server)


def test_each_tenant_has_its_share_of_the_queue(server):
    import threading

    queue = server.services["images"].queue  # max_generation_waiting=2 over two keys: one waiting each
    body = {"prompt": "a boat", "size": "16x16", "num_inference_steps": 1}
    answers = {}

    def post(key):
        answers[key] = _post(server, body, key=key)

    with Blocked(queue):
        first = threading.Thread(target=post, args=(KEYS[0],))
        first.start()
        _until(lambda: queue.waiting == 1)
        r = _post(server, body)
        assert r.status_code == 503 and error_of(r)["code"] == "queue_full"  # its share is taken
        other = threading.Thread(target=post, args=(KEYS[1],))
        other.start()
        _until(lambda: queue.waiting == 2)  # the other key waits its turn, not refused
    for thread in (first, other):
        thread.join(60)
    assert [answers[k].status_code for k in KEYS] == [200, 200]
    _sound(server)


def _until(predicate, timeout_s: float = 30.0):
    import time

    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_refusals_before_and_after_the_queue(server):
    r = httpx.post(server.base_url + "/images/generations", json={"prompt": "a boat"}, timeout=30)
    assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
    r = _post(server, {"prompt": "a boat"}, key="key-gamma")
    assert r.status_code == 401
    r = httpx.post(server.base_url + "/images/generations", content=b"{not json", timeout=30,
                   headers={"Authorization": f"Bearer {KEYS[0]}", "Content-Type": "application/json"})
    assert r.status_code == 400 and error_of(r)["code"] == "invalid_json"
    # NaN passes JSON and pydantic; the store wrapper refuses it before any prompt is encoded
    q0 = _store_counts(server, "text_encoder")[0]
    r = httpx.post(server.base_url + "/images/generations", timeout=30,
                   content=b'{"prompt": "a boat", "size": "16x16", "guidance_scale": NaN}',
                   headers={"Authorization": f"Bearer {KEYS[0]}", "Content-Type": "application/json"})
    assert r.status_code == 400 and "guidance_scale" in error_of(r)["message"]
    assert _store_counts(server, "text_encoder")[0] == q0
    with pytest.raises(openai.BadRequestError):
        _client(server).images.generate(model=MODEL, prompt="a boat", size="16x16", response_format="url")
    _sound(server)


def test_a_full_queue_is_503_with_retry_after(server):
    queue = server.services["images"].queue
    with Blocked(queue):  # the queue filled by others than this key (each within its share of one)
        for owner in ("key-1", "a tenant of no key"):
            queue.submit(lambda job: None, owner)
        r = _post(server, {"prompt": "a boat", "size": "16x16", "num_inference_steps": STEPS})
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        assert error_of(r)["code"] == "queue_full" and "the limit is 2" in error_of(r)["message"]
    assert metric(scrape(server.url), "mmcache:endpoint_requests_total", endpoint="images", status="503") >= 1
    _sound(server)


def test_a_client_gone_before_its_turn_cancels_its_job(server):
    queue = server.services["images"].queue
    before = scrape(server.url)
    with Blocked(queue):
        with pytest.raises(httpx.ReadTimeout):
            _post(server, {"prompt": "a request nobody waits for", "size": "16x16", "num_inference_steps": STEPS},
                  timeout=httpx.Timeout(30, read=0.5))
        deadline = 200
        while metric(scrape(server.url), "mmcache:endpoint_requests_total", status="499") == \
                metric(before, "mmcache:endpoint_requests_total", status="499"):
            deadline -= 1
            assert deadline, "the server did not see the client go"
            httpx.get(server.url + "/health")
        assert queue.waiting == 0  # cancelled while it waited
    after = scrape(server.url)
    assert metric(after, "mmcache:encoder_cache_queries_total", kind="text_encoder") == \
        metric(before, "mmcache:encoder_cache_queries_total", kind="text_encoder")  # it never ran
    _sound(server)


def test_a_job_cancelled_while_it_runs_stops_and_releases_its_leases(server):
    service = server.services["images"]
    spec = ImageSpec("a running job that is stopped", NEGATIVE, 16, 16, 1, 0, None, 4)
    steps = cancelled_from_a_hook(service.pipe.transformer, lambda job: service.render(spec, b"", job))
    assert steps == 1  # stopped after its first denoising step of four
    _sound(server)


def test_sizes_the_pipeline_cannot_take_are_refused_at_start():
    with pytest.raises(ServerConfigError, match="position embedding"):
        with serve(ServerConfig(diffusion=(MODEL,), image_sizes=("64x64",))):
            pass
    with pytest.raises(ServerConfigError, match="WxH"):
        ServerConfig(diffusion=(MODEL,), image_sizes=("16 by 16",))
    with pytest.raises(ServerConfigError, match="negative_prompt is longer than the 4096 characters"):
        with serve(ServerConfig(diffusion=(MODEL,), negative_prompt="n" * 4097)):
            pass


def test_chat_images_videos_and_speech_share_one_store_and_one_registry(one_thread, datasets_dir):
    config = ServerConfig(preset="tiny-llava", diffusion=(MODEL, "tiny-wan"), tts="tiny-csm", store_bytes=64 * 2**20,
                          image_sizes=("16x16",), max_speech_frames=2)
    with serve(config) as srv:
        assert srv.store is srv.host.engine.store and srv.store.budget_bytes == 64 * 2**20
        client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny-llava", MODEL, "tiny-wan", "tiny-csm"]
        photo = data_url((datasets_dir / "images" / "coffee.png").read_bytes())
        client.chat.completions.create(model="tiny-llava", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": photo}}]}])
        client.images.generate(model=MODEL, prompt="a cup of coffee", extra_body={"num_inference_steps": STEPS})
        wav = io.BytesIO()
        soundfile.write(wav, np.sin(np.arange(8000) / 9.0).astype(np.float32) * 0.2, 16_000, format="WAV")
        client.audio.speech.create(model="tiny-csm", voice="cloned", input="Hello.",
                                   extra_body={"ref_audio": data_url(wav.getvalue(), "audio/wav")})
        negatives = metric(scrape(srv.url), "mmcache:encoder_cache_queries_total", kind="negative_prompt")
        video = httpx.post(srv.base_url + "/videos/sync", timeout=60,
                           json={"model": "tiny-wan", "prompt": "a cup of coffee", "num_inference_steps": 2})
        assert video.status_code == 200 and video.headers["content-type"] == "video/mp4"
        # Wan's prompt and negative prompt went through the same store, under the same kinds
        assert metric(scrape(srv.url), "mmcache:encoder_cache_queries_total", kind="negative_prompt") > negatives
        samples = scrape(srv.url)
        for kind in ("vision", "text_encoder", "negative_prompt", "position_bias", "codec"):
            assert metric(samples, "mmcache:encoder_cache_queries_total", kind=kind) > 0, kind
        assert metric(samples, "mmcache:encoder_cache_entries") == len(srv.store)
        assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
    srv.host.engine.check_invariants()
    _sound(srv)


def test_serve_options_build_the_config(capsys):
    from mmcache.cli import build_parser
    from mmcache.server.cli import config_from_args, serve_main

    args = build_parser().parse_args(["serve", "--diffusion", MODEL, "--tts", "tiny-csm", "--image-size", "16x16",
                                      "--image-size", "32x32", "--negative-prompt", "dull", "--max-inference-steps",
                                      "8", "--max-speech-frames", "20", "--max-ref-audio-seconds", "2.5"])
    config = config_from_args(args)
    assert (config.preset, config.model, config.diffusion, config.tts) == (None, None, (MODEL,), "tiny-csm")
    assert config.image_sizes == ("16x16", "32x32") and config.negative_prompt == "dull"
    assert (config.max_inference_steps, config.max_speech_frames, config.max_ref_audio_seconds) == (8, 20, 2.5)
    assert config.dtype == "float32" and config.model_names == [MODEL, "tiny-csm"]
    folder = config_from_args(build_parser().parse_args(["serve", "--diffusion", "some/sd3-folder"]))
    assert folder.dtype == "bfloat16" and folder.model_names == ["sd3-folder"]
    assert serve_main(build_parser().parse_args(["serve"])) == 2
    assert "nothing to serve" in capsys.readouterr().err
    with pytest.raises(ServerConfigError, match="share a name"):
        ServerConfig(diffusion=(MODEL, "elsewhere/" + MODEL))
    with pytest.raises(ServerConfigError, match="neither a preset nor a local folder"):
        with serve(ServerConfig(diffusion=("no-such-pipeline",))):
            pass


def test_entry_kinds_are_checked(server):
    from encoders.diffusion import CachedSD3Pipeline
    from mmcache.errors import InvalidRequest

    for bad in ("", None, 3):
        with pytest.raises(InvalidRequest, match="entry kind"):
            CachedSD3Pipeline(server.services["images"].pipe, server.store, negative_kind=bad)


def test_closing_a_queue_fails_what_waits_and_stops_what_runs():
    import threading

    from mmcache.server.engine_host import QueueFull
    from mmcache.server.job_queue import GenerationQueue

    queue = GenerationQueue("test", 2)
    gate, started = threading.Event(), threading.Event()

    def hold(job):
        started.set()
        gate.wait(30)
        job.check()  # as a pipeline checks between its steps

    running = queue.submit(hold)
    assert started.wait(30)
    waiting = queue.submit(lambda job: "never run")
    assert (queue.waiting, queue.running) == (1, 1)
    closer = threading.Thread(target=queue.close)
    closer.start()
    assert running.cancelled.wait(30)
    gate.set()
    closer.join(30)
    for job in (running, waiting):
        with pytest.raises(JobCancelled):
            job.future.result(0)
    with pytest.raises(QueueFull):
        queue.submit(lambda job: None)
    assert not queue.alive and (queue.waiting, queue.running) == (0, 0)
