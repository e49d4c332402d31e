"""The /v1/videos routes over a real tiny Wan pipeline, mounted on their own FastAPI app under uvicorn: a job
that outlives its client, MP4 content decoded back, frames equal to the pipeline's own, deletion and the
bounds' eviction, tenants, /sync, store hits for a shared negative prompt, every error status; and the job
store on its own with a gated fake renderer (queue bound, byte bound, cancellation, shutdown)."""

from __future__ import annotations

import io
import json
import socket
import threading
import time

import av
import httpx
import numpy as np
import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, generate_latest

from mmcache.server.config import ServerConfig
from mmcache.server.errors import APIError
from mmcache.server.intake import Intake
from mmcache.server.tenants import Tenants
from mmcache.server.video_jobs import COMPLETED, FAILED, JobsFull, VideoJobs
from mmcache.server.video_mp4 import Mp4Error, Mp4Settings, default_codec, encode_mp4, to_uint8
from mmcache.server.images import NonFiniteOutput
from mmcache.server.video_render import JOB_OBJECT_BYTES, VideoSpec, WanRenderer
from mmcache.server.videos import VideoLimits, VideoService, video_router
from server_helpers import error_of, metric, scrape

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "tiny-wan"
KEYS = ("key-a", "key-b")
A = {"Authorization": "Bearer key-a"}
B = {"Authorization": "Bearer key-b"}
LIMITS = VideoLimits(max_width=64, max_height=64, max_frames=9, max_steps=3, max_fps=30, default_width=16,
                     default_height=16, default_frames=5, default_fps=8, default_steps=2)
BODY = {"prompt": "a red kite over the dunes", "negative_prompt": "blurry, static", "width": 16, "height": 32,
        "num_frames": 5, "fps": 8, "num_inference_steps": 2, "seed": 7, "guidance_scale": 4.0}


# ---- serving an app under uvicorn -----------------------------------------------------------------------
class _Served:
    def __init__(self, app: FastAPI):
        import uvicorn

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.sock = sock
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def stop(self):
        self.server.should_exit = True
        self.thread.join()
        self.sock.close()


def _app(jobs: VideoJobs, limits: VideoLimits = LIMITS, max_body_bytes: int = 64 * 2**20) -> tuple[FastAPI,
                                                                                              CollectorRegistry]:
    """The router on a bare app with the server's APIError handling and a /metrics route; the server's intake with
    ``max_body_bytes`` and its defaults otherwise."""
    registry = CollectorRegistry(auto_describe=False)
    app = FastAPI()
    errors = []

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        errors.append(err.code)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.get("/metrics")
    async def _metrics():
        return Response(generate_latest(registry))

    intake = Intake(ServerConfig(diffusion=[MODEL], max_body_bytes=max_body_bytes), Tenants(KEYS, b"s" * 32))
    app.include_router(video_router(VideoService(MODEL, jobs, limits), intake, registry))
    app.state.errors = errors
    return app, registry


class _Recording(WanRenderer):
    """Keeps the frames of every render, to compare them with the pipeline's before encoding."""

    def __init__(self, *args):
        super().__init__(*args)
        self.rendered = []

    def frames(self, *args):
        frames, hits = super().frames(*args)
        self.rendered.append(frames)
        return frames, hits


@pytest.fixture(scope="module")
def wan():
    from mmcache.presets.diffusion import tiny_wan_pipeline

    return tiny_wan_pipeline()


@pytest.fixture(scope="module")
def store():
    from mmcache.store import EncoderOutputStore

    return EncoderOutputStore(64 * 2**20)


@pytest.fixture(scope="module")
def served(wan, store, one_thread):
    from encoders.diffusion import CachedWanPipeline

    jobs = VideoJobs(_Recording(CachedWanPipeline(wan, store)), max_jobs=3, max_pending=2, max_bytes=2**20)
    app, _ = _app(jobs, max_body_bytes=16 * 1024)
    srv = _Served(app)
    srv.jobs = jobs
    srv.app = app
    yield srv
    srv.stop()
    jobs.close()
    jobs.check_invariants()
    assert jobs.stored_bytes == 0
    store.check_invariants()
    assert all(store.held(key) == 0 for key in store.keys())


def _wait(url: str, video_id: str, headers=A, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=url, headers=headers) as client:
        while True:
            job = client.get(f"/v1/videos/{video_id}").json()
            if job["status"] in (COMPLETED, FAILED):
                return job
            assert time.monotonic() < deadline, job
            time.sleep(0.02)


def _create(url: str, body: dict, headers=A) -> dict:
    r = httpx.post(url + "/v1/videos", json=body, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


def _decode(data: bytes) -> tuple[np.ndarray, str, float]:
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
        return frames, stream.codec_context.name, float(stream.average_rate)


def _own_frames(wan, body: dict) -> np.ndarray:
    """The unwrapped pipeline's frames for ``body``, as uint8."""
    out = wan(prompt=body["prompt"], negative_prompt=body.get("negative_prompt"), height=body["height"],
              width=body["width"], num_frames=body["num_frames"], num_inference_steps=body["num_inference_steps"],
              guidance_scale=body["guidance_scale"], generator=torch.Generator().manual_seed(body["seed"]),
              output_type="np").frames
    return to_uint8(out[0])


# ---- the routes over the real pipeline ------------------------------------------------------------------
def test_a_job_outlives_its_client_and_serves_the_pipelines_frames(served, wan):
    with httpx.Client(base_url=served.url, headers=A) as first:  # multipart form fields, as vLLM-Omni's curl
        r = first.post("/v1/videos", files={k: (None, str(v)) for k, v in BODY.items()})
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["object"] == "video" and job["status"] in ("queued", "in_progress", "completed")
    assert job["model"] == MODEL and job["size"] == "16x32" and job["seed"] == 7 and job["error"] is None
    assert isinstance(job["created_at"], int)
    done = _wait(served.url, job["id"])  # a new client polls: the first one is gone
    assert done["status"] == COMPLETED and done["progress"] == 100 and done["bytes"] > 0
    content = httpx.get(f"{served.url}/v1/videos/{job['id']}/content", headers=A)
    assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
    assert len(content.content) == done["bytes"]
    frames, codec, rate = _decode(content.content)
    assert frames.shape == (5, 32, 16, 3) and codec == "h264" and rate == 8.0
    # The frames the job rendered, before encoding, are the pipeline's own for that seed, bit for bit; the MP4 is
    # exactly their encoding (the encoder is deterministic); test_lossless_encoding_decodes_to_the_pipelines_frames
    # compares decoded frames without loss.
    own = _own_frames(wan, BODY)
    assert np.array_equal(served.jobs.render.rendered[-1], own)
    assert content.content == encode_mp4(own, 8)
    assert np.abs(frames.astype(int) - own).mean() < 40  # yuv420p: chroma at half resolution


def test_lossless_encoding_decodes_to_the_pipelines_frames(wan, store):
    from encoders.diffusion import CachedWanPipeline

    renderer = WanRenderer(CachedWanPipeline(wan, store), Mp4Settings(lossless=True))
    spec = VideoSpec(BODY["prompt"], BODY["negative_prompt"], 16, 32, 5, 8, 2, 7, 4.0)
    steps = []
    data, info = renderer(spec, b"", steps.append)
    frames, _, _ = _decode(data)
    assert np.array_equal(frames, _own_frames(wan, BODY))
    assert steps == [0.5, 1.0] and set(info) == {"encoder_cache_hits"}


def test_sync_returns_the_mp4_of_the_same_request(served):
    r = httpx.post(served.url + "/v1/videos/sync", json=BODY, headers=A)
    assert r.status_code == 200 and r.headers["content-type"] == "video/mp4"
    assert r.headers["x-video-seed"] == "7"
    frames, _, _ = _decode(r.content)
    assert frames.shape == (5, 32, 16, 3)
    job = _wait(served.url, _create(served.url, BODY)["id"])
    assert httpx.get(f"{served.url}/v1/videos/{job['id']}/content", headers=A).content == r.content
    listed = httpx.get(served.url + "/v1/videos", headers=A).json()["data"]
    assert r.headers["x-video-id"] not in {j["id"] for j in listed}  # a /sync job is never stored


def test_a_shared_negative_prompt_is_a_store_hit_and_salts_share_nothing(served, store):
    base = dict(BODY, negative_prompt="overexposed, static, low quality " + str(time.time_ns()))
    hits = store.metrics.kind("output").hits
    first = _wait(served.url, _create(served.url, dict(base, prompt="a lighthouse at dusk"))["id"])
    assert first["encoder_cache_hits"] == 0 and store.metrics.kind("output").hits == hits
    second = _wait(served.url, _create(served.url, dict(base, prompt="a heron in reeds"))["id"])
    assert store.metrics.kind("output").hits == hits + 1  # the negative prompt; the new prompt is a miss
    assert second["encoder_cache_hits"] >= 1
    other_tenant = _wait(served.url, _create(served.url, dict(base, prompt="a heron in reeds"), B)["id"], B)
    salted = _wait(served.url, _create(served.url, dict(base, prompt="a heron in reeds", cache_salt="x"))["id"])
    assert other_tenant["encoder_cache_hits"] == 0 and salted["encoder_cache_hits"] == 0
    assert store.metrics.kind("output").hits == hits + 1


def test_another_tenant_gets_404_and_delete_frees_the_bytes(served):
    job = _wait(served.url, _create(served.url, BODY)["id"])
    vid = job["id"]
    for method, path in (("GET", ""), ("GET", "/content"), ("DELETE", "")):
        r = httpx.request(method, f"{served.url}/v1/videos/{vid}{path}", headers=B)
        assert r.status_code == 404 and error_of(r)["code"] == "video_not_found"
    assert vid not in {j["id"] for j in httpx.get(served.url + "/v1/videos", headers=B).json()["data"]}
    listed = httpx.get(served.url + "/v1/videos", headers=A).json()
    assert listed["object"] == "list" and listed["first_id"] == vid  # newest first
    before = served.jobs.stored_bytes
    assert before >= job["bytes"] and metric(scrape(served.url), "mmcache:video_stored_bytes") == before
    r = httpx.delete(f"{served.url}/v1/videos/{vid}", headers=A)
    assert r.json() == {"id": vid, "object": "video.deleted", "deleted": True}
    held = job["bytes"] + JOB_OBJECT_BYTES + len(BODY["prompt"]) + len(BODY["negative_prompt"])  # video, prompts
    assert served.jobs.stored_bytes == before - held
    assert metric(scrape(served.url), "mmcache:video_stored_bytes") == before - held
    assert httpx.get(f"{served.url}/v1/videos/{vid}", headers=A).status_code == 404
    assert httpx.delete(f"{served.url}/v1/videos/{vid}", headers=A).status_code == 404
    served.jobs.check_invariants()


def test_the_job_bound_evicts_the_oldest_finished_job(served):
    evicted = served.jobs.evictions
    ids = [_wait(served.url, _create(served.url, dict(BODY, seed=s))["id"])["id"] for s in range(4)]
    kept = {j["id"] for j in httpx.get(served.url + "/v1/videos", headers=A).json()["data"]} | \
        {j["id"] for j in httpx.get(served.url + "/v1/videos", headers=B).json()["data"]}
    assert len(kept) == 3 and set(ids[1:]) <= kept and ids[0] not in kept  # max_jobs=3
    assert httpx.get(f"{served.url}/v1/videos/{ids[0]}", headers=A).status_code == 404
    assert served.jobs.evictions >= evicted + 1
    samples = scrape(served.url)
    assert metric(samples, "mmcache:video_jobs_evicted_total") == served.jobs.evictions
    assert metric(samples, "mmcache:video_jobs_finished_total", outcome="completed") >= 4
    assert metric(samples, "mmcache:video_job_latency_seconds_count") >= 4
    assert metric(samples, "mmcache:video_requests_total", route="create") >= 4
    served.jobs.check_invariants()


def _errors():
    """(request kwargs, status, code or None, param or None) for every refusal the routes make up front."""
    j = lambda **kw: {"json": dict(BODY, **kw), "headers": A}  # noqa: E731
    return [
        ({"json": BODY}, 401, "invalid_api_key", None),
        ({"json": BODY, "headers": {"Authorization": "Bearer nope"}}, 401, "invalid_api_key", None),
        ({"content": b"x" * 20000, "headers": {**A, "content-type": "application/json"}}, 413,
         "request_too_large", None),
        ({"content": b"prompt=a", "headers": {**A, "content-type": "text/plain"}}, 415, "unsupported_media_type",
         None),
        ({"content": b"{nope", "headers": {**A, "content-type": "application/json"}}, 400, "invalid_json", None),
        ({"content": b"[1]", "headers": {**A, "content-type": "application/json"}}, 400, "invalid_json", None),
        ({"content": json.dumps(dict(BODY, guidance_scale=1)).replace("1}", "NaN}").encode(),
          "headers": {**A, "content-type": "application/json"}}, 400, "invalid_request", "guidance_scale"),
        ({"files": {"prompt": ("p.txt", b"a file")}, "headers": A}, 400, "invalid_form", None),
        ({"json": {k: v for k, v in BODY.items() if k != "prompt"}, "headers": A}, 400, "invalid_request",
         "prompt"),
        (j(prompt="  "), 400, "invalid_request", "prompt"),
        (j(prompt=7), 400, "invalid_request", "prompt"),
        (j(colour="red"), 400, "unsupported_field", "colour"),
        (j(width=24), 400, "invalid_request", "width"),
        (j(num_frames=6), 400, "invalid_request", "num_frames"),
        (j(num_frames=0), 400, "invalid_request", "num_frames"),
        (j(seed=-1), 400, "invalid_request", "seed"),
        (j(seed=2**64), 400, "invalid_request", "seed"),
        (j(seed="7"), 400, "invalid_request", "seed"),
        (j(fps=0), 400, "invalid_request", "fps"),
        (j(fps=31), 400, "invalid_request", "fps"),
        (j(num_inference_steps=True), 400, "invalid_request", "num_inference_steps"),
        (j(guidance_scale=-1), 400, "invalid_request", "guidance_scale"),
        (j(guidance_scale=1e308), 400, "invalid_request", "guidance_scale"),  # a "completed" video of NaN before
        (j(guidance_scale=100.5), 400, "invalid_request", "guidance_scale"),
        ({"content": json.dumps(BODY).replace('"guidance_scale": 4.0', '"guidance_scale": 1e400').encode(),
          "headers": {**A, "content-type": "application/json"}}, 400, "invalid_request", "guidance_scale"),
        (j(prompt="p" * 8193), 400, "invalid_request", "prompt"),  # tiny-wan reads 16 x 512 characters
        (j(negative_prompt="n" * 8193), 400, "invalid_request", "negative_prompt"),
        ({"files": {"prompt": (None, "p" * 8193)}, "headers": A}, 400, "invalid_request", "prompt"),
        (j(size="16x16"), 400, "invalid_request", "height"),
        (j(size="big"), 400, "invalid_request", "size"),
        (j(cache_salt="s" * 300), 400, "invalid_request", "cache_salt"),
        (j(num_frames=13), 413, "request_too_large", "num_frames"),
        (j(num_inference_steps=4), 413, "request_too_large", "num_inference_steps"),
        (j(width=80), 413, "request_too_large", "width"),
        (j(model="other"), 404, "model_not_found", "model"),
    ]


@pytest.mark.parametrize("route", ["/v1/videos", "/v1/videos/sync"])
def test_every_refusal_holds_nothing(served, store, route):
    before = (served.jobs.stats(), store.metrics.lookups, len(store))
    for kwargs, status, code, param in _errors():
        r = httpx.post(served.url + route, **kwargs)
        assert r.status_code == status, (kwargs, r.text)
        err = error_of(r)
        assert err["code"] == code and err["param"] == param, (kwargs, err)
    assert (served.jobs.stats(), store.metrics.lookups, len(store)) == before


def test_lookups_of_unknown_or_unfinished_videos(served):
    assert error_of(httpx.get(served.url + "/v1/videos/video_nope", headers=A))["code"] == "video_not_found"
    assert httpx.get(served.url + "/v1/videos/video_nope/content", headers=A).status_code == 404
    assert httpx.get(served.url + "/v1/videos", headers={"Authorization": "Bearer x"}).status_code == 401
    # a job too long to finish at once: its content is not there yet (409), and deleting it stops it
    job = _create(served.url, dict(BODY, width=64, height=64, num_frames=9, num_inference_steps=3))
    r = httpx.get(f"{served.url}/v1/videos/{job['id']}/content", headers=A)
    if r.status_code != 200:  # it may already have finished on a fast machine
        assert r.status_code == 409 and error_of(r)["code"] == "video_not_ready"
    assert httpx.delete(f"{served.url}/v1/videos/{job['id']}", headers=A).status_code == 200
    deadline = time.monotonic() + 60
    while served.jobs.pending:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    served.jobs.check_invariants()


def test_served_by_mmcache_serve_a_shared_negative_prompt_is_a_store_hit_in_metrics():
    from mmcache.presets import serve
    from mmcache.server import ServerConfig

    body = {"prompt": "a cat on a wall", "negative_prompt": "blurry, static", "guidance_scale": 5.0, "seed": 1,
            "width": 16, "height": 16, "num_frames": 5, "num_inference_steps": 1}
    config = ServerConfig(diffusion=("tiny-wan",), api_keys=KEYS)
    with serve(config) as srv:
        jobs = srv.services["videos"].jobs
        assert jobs.alive
        # each of the two keys has half of each bound (Tenants.share)
        assert (jobs.owner_pending, jobs.owner_jobs, jobs.owner_bytes) == (
            config.max_generation_waiting // 2, config.max_video_jobs // 2, config.max_video_bytes // 2)
        for prompt in ("a cat on a wall", "a dog in the snow"):
            job = _wait(srv.url, _create(srv.url, dict(body, prompt=prompt))["id"])
            assert job["status"] == COMPLETED
        samples = scrape(srv.url)
        assert metric(samples, "mmcache:encoder_cache_hits_total", kind="negative_prompt") == 1
        assert metric(samples, "mmcache:video_jobs_finished_total", outcome="completed") == 2
    assert not jobs.alive and jobs.stored_bytes == 0


# ---- the job store and the router with a gated fake renderer ---------------------------------------------
class _Gated:
    """A renderer that waits for ``gate`` between steps and returns ``size`` bytes; failures on demand."""

    size_multiple = 16
    max_prompt_chars = 8192

    def __init__(self, size: int = 100, steps: int = 3):
        self.gate = threading.Semaphore(0)
        self.size, self.steps, self.calls, self.fail = size, steps, [], False

    def size_error(self, width, height):
        return None

    def frames_error(self, num_frames):
        return None

    def __call__(self, spec, salt, progress):
        self.calls.append(spec)
        for i in range(self.steps):
            assert self.gate.acquire(timeout=30)
            progress((i + 1) / self.steps)
        if self.fail:
            raise RuntimeError("the model broke")
        return bytes([len(self.calls) % 256]) * self.size, {}


def _until(predicate, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def _release(render: _Gated, n: int):
    for _ in range(n):
        render.gate.release()


def test_the_byte_bound_evicts_the_oldest_completed_job_and_refuses_an_oversized_one():
    render = _Gated(size=400, steps=1)
    with VideoJobs(render, max_jobs=8, max_pending=4, max_bytes=1000) as jobs:
        first, second = jobs.submit("t", "s1", b""), jobs.submit("t", "s2", b"")
        _release(render, 2)
        _until(lambda: second.finished)
        assert jobs.stored_bytes == 800
        third = jobs.submit("t", "s3", b"")
        _release(render, 1)
        _until(lambda: third.finished)
        assert jobs.get("t", first.id) is None and jobs.get("t", second.id) is second  # oldest finished first
        assert jobs.stored_bytes == 800 and jobs.evictions == 1
        render.size = 1001
        big = jobs.submit("t", "big", b"")
        _release(render, 1)
        _until(lambda: big.finished)
        assert big.status == FAILED and big.error["code"] == "video_too_large" and jobs.stored_bytes == 800
        jobs.check_invariants()
    assert jobs.stored_bytes == 0


def test_queued_and_running_jobs_are_never_evicted_and_the_queue_bound_refuses():
    render = _Gated(steps=2)
    with VideoJobs(render, max_jobs=2, max_pending=2, max_bytes=10_000) as jobs:
        running, queued = jobs.submit("t", "a", b""), jobs.submit("t", "b", b"")
        with pytest.raises(JobsFull):
            jobs.submit("t", "c", b"")
        _until(lambda: running.status == "in_progress")
        _release(render, 1)
        _until(lambda: running.progress == 50)
        _release(render, 1)
        _until(lambda: running.finished)
        third = jobs.submit("t", "c", b"")  # evicts the finished one, never the queued one
        assert jobs.get("t", running.id) is None and jobs.get("t", queued.id) is queued
        _release(render, 4)
        _until(lambda: third.finished)
        assert [j.status for j in (queued, third)] == [COMPLETED, COMPLETED]
        jobs.check_invariants()


def test_deleting_a_running_job_stops_it_and_close_fails_the_queued():
    render = _Gated(steps=3)
    outcomes = []
    jobs = VideoJobs(render, max_jobs=4, max_pending=3, max_bytes=10_000, observe=lambda j: outcomes.append(j.outcome))
    running = jobs.submit("t", "a", b"")
    queued = jobs.submit("t", "b", b"")
    _until(lambda: running.status == "in_progress")
    assert not jobs.delete("u", running.id)  # another owner
    assert jobs.delete("t", running.id) and jobs.get("t", running.id) is None
    _release(render, 1)  # the next step sees the cancellation
    _until(lambda: running.finished)
    assert running.outcome == "cancelled" and running.content is None
    last = jobs.submit("t", "c", b"")
    _until(lambda: queued.status == "in_progress")
    closing = threading.Thread(target=jobs.close)  # the queued one fails at once; the running one stops at
    closing.start()  # its next step
    _until(lambda: queued.cancelled)
    _release(render, 1)
    closing.join()
    assert last.outcome == "cancelled" and queued.outcome == "cancelled"
    assert outcomes.count("cancelled") == 3 and jobs.stats()["jobs"] == dict.fromkeys(
        ("queued", "in_progress", "completed", "failed"), 0)
    with pytest.raises(JobsFull):
        jobs.submit("t", "d", b"")


def test_video_jobs_run_on_a_generation_queue_and_stop_by_its_one_cancellation():
    from mmcache.server.job_queue import JobCancelled

    render = _Gated(steps=2)
    seen = []

    def recording(spec, salt, progress):
        seen.append(threading.current_thread().name)
        try:
            return render(spec, salt, progress)
        except BaseException as e:
            seen.append(type(e))
            raise

    with VideoJobs(recording, max_jobs=2, max_pending=2, max_bytes=10_000) as jobs:
        job = jobs.submit("t", "a", b"")
        _until(lambda: job.status == "in_progress")
        assert jobs.delete("t", job.id)
        _release(render, 1)
        _until(lambda: job.finished)
        assert job.outcome == "cancelled" and jobs.pending == 0
    assert seen == ["mmcache-videos", JobCancelled]  # the GenerationQueue's worker, the queue's JobCancelled


def test_a_failed_render_is_a_failed_job_and_sync_maps_it_to_500():
    render = _Gated(steps=1)
    render.fail = True
    jobs = VideoJobs(render, max_jobs=2, max_pending=1, max_bytes=10_000)
    app, _ = _app(jobs)
    srv = _Served(app)
    try:
        created = _create(srv.url, BODY)
        r = httpx.post(srv.url + "/v1/videos", json=BODY, headers=A)  # one pending at most
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and error_of(r)["code"] == "queue_full"
        _release(render, 1)
        job = _wait(srv.url, created["id"])
        assert job["status"] == FAILED and job["error"]["code"] == "generation_failed"
        assert "the model broke" in job["error"]["message"]
        r = httpx.get(f"{srv.url}/v1/videos/{created['id']}/content", headers=A)
        assert r.status_code == 409 and error_of(r)["code"] == "video_failed"
        _release(render, 1)
        r = httpx.post(srv.url + "/v1/videos/sync", json=BODY, headers=A)
        assert r.status_code == 500 and error_of(r)["code"] == "generation_failed"
        assert metric(scrape(srv.url), "mmcache:video_jobs_finished_total", outcome="failed") == 2
    finally:
        srv.stop()
        jobs.close()


def test_deeply_nested_json_is_invalid_json_and_holds_nothing():
    render = _Gated(steps=1)
    with VideoJobs(render, max_jobs=2, max_pending=2, max_bytes=10_000) as jobs:
        srv = _Served(_app(jobs)[0])  # the default body limit of 64 MiB: the depth is what is refused
        try:
            depth = 100_000
            for body in (b"[" * depth + b"]" * depth, b'{"prompt": ' + b'{"a": ' * depth + b"1" + b"}" * depth + b"}",
                         b"\xef\xbb\xbf" + b"[" * depth):
                for route in ("/v1/videos", "/v1/videos/sync"):
                    r = httpx.post(srv.url + route, content=body, headers={**A, "content-type": "application/json"})
                    assert r.status_code == 400 and error_of(r)["code"] == "invalid_json", r.text[:200]
            ok = httpx.post(srv.url + "/v1/videos", content=b"\xef\xbb\xbf" + json.dumps(BODY).encode(),
                            headers={**A, "content-type": "application/json"})  # the same reading as the chat routes
            assert ok.status_code == 200, ok.text
            assert jobs.stats()["jobs"]["queued"] + jobs.stats()["jobs"]["in_progress"] == 1
        finally:
            _release(render, 1)
            srv.stop()


def test_each_tenant_has_its_share_of_the_queue_and_of_the_kept_jobs():
    render = _Gated(steps=1)
    jobs = VideoJobs(render, max_jobs=4, max_pending=2, max_bytes=10**6, share=Tenants(KEYS).share)
    srv = _Served(_app(jobs)[0])  # shares: 2 kept jobs, 1 pending
    try:
        first = _create(srv.url, BODY)
        r = httpx.post(srv.url + "/v1/videos", json=BODY, headers=A)
        assert r.status_code == 503 and error_of(r)["code"] == "queue_full" and "share" in error_of(r)["message"]
        r = httpx.post(srv.url + "/v1/videos/sync", json=BODY, headers=A)
        assert r.status_code == 503  # the share counts /sync jobs too
        other = _create(srv.url, BODY, B)  # the other tenant is not refused
        _release(render, 2)
        assert _wait(srv.url, other["id"], B)["status"] == COMPLETED
        made = [_wait(srv.url, first["id"])["id"]]
        for _ in range(3):  # A makes three more; its share of kept jobs is 2: its own oldest go, never B's
            job = _create(srv.url, BODY)
            _release(render, 1)
            made.append(_wait(srv.url, job["id"])["id"])
        listed = [j["id"] for j in httpx.get(srv.url + "/v1/videos", headers=A).json()["data"]]
        assert listed == made[:1:-1]
        assert httpx.get(f"{srv.url}/v1/videos/{other['id']}/content", headers=B).status_code == 200
        jobs.check_invariants()
    finally:
        srv.stop()
        jobs.close()


def test_kept_prompts_count_in_the_byte_bound_and_a_tenant_evicts_only_its_own():
    render = _Gated(size=400, steps=1)
    with VideoJobs(render, max_jobs=8, max_pending=4, max_bytes=2000, share=Tenants(KEYS).share) as jobs:
        theirs = jobs.submit("key-1", "b", b"", kept_bytes=100)
        assert jobs.stored_bytes == 100  # counted from creation, before any video
        _release(render, 1)
        _until(lambda: theirs.finished)
        mine = []
        for i in range(3):  # 500 bytes each of key-0's 1000: the third evicts key-0's first
            mine.append(jobs.submit("key-0", f"a{i}", b"", kept_bytes=100))
            _release(render, 1)
            _until(lambda: mine[-1].finished)
        assert jobs.get("key-0", mine[0].id) is None and jobs.get("key-0", mine[1].id) is mine[1]
        assert jobs.get("key-1", theirs.id) is theirs and jobs.stored_bytes == 1500
        evictions = jobs.evictions
        with pytest.raises(JobsFull):
            jobs.submit("key-0", "too much to keep", b"", kept_bytes=1001)
        assert jobs.evictions == evictions  # a refusal evicts nothing
        render.size = 950
        big = jobs.submit("key-0", "big", b"", kept_bytes=100)  # room for its prompts: mine[1] goes
        _release(render, 1)
        _until(lambda: big.finished)
        assert big.status == FAILED and big.error["code"] == "video_too_large"  # 100 + 950 > 1000
        assert jobs.get("key-0", mine[2].id) is mine[2] and jobs.stored_bytes == 500 + 500 + 100
        jobs.check_invariants()
    assert jobs.stored_bytes == 0


def test_frames_that_are_not_finite_fail_the_job(wan, store):
    from encoders.diffusion import CachedWanPipeline

    spec = VideoSpec("a boat", "", 16, 16, 5, 8, 2, 0, 1e308)  # past the route's bound: the guidance overflows
    renderer = WanRenderer(CachedWanPipeline(wan, store))
    with pytest.raises(NonFiniteOutput):
        renderer(spec, b"", lambda fraction: None)
    with VideoJobs(renderer, max_jobs=2, max_pending=1, max_bytes=2**20) as jobs:
        job = jobs.submit("t", spec, b"")
        _until(lambda: job.finished, 60)
        assert job.status == FAILED and job.error["code"] == "generation_failed" and "NaN" in job.error["message"]
        assert jobs.stored_bytes == 0
    assert all(store.held(key) == 0 for key in store.keys())


def test_a_sync_client_that_goes_away_cancels_its_job():
    render = _Gated(steps=2)
    jobs = VideoJobs(render, max_jobs=2, max_pending=2, max_bytes=10_000)
    srv = _Served(_app(jobs)[0])
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/videos/sync", json=BODY, headers=A, timeout=0.5)
        _until(lambda: jobs._running is not None and jobs._running.cancelled)
        _release(render, 1)  # the next step sees the cancellation
        _until(lambda: jobs.pending == 0)
        assert jobs.stats()["jobs"]["completed"] == 0 and render.gate.acquire(timeout=0) is False
    finally:
        srv.stop()
        jobs.close()


# ---- MP4 encoding ---------------------------------------------------------------------------------------
def test_encoding_is_deterministic_and_refuses_what_yuv420p_cannot_hold():
    frames = np.random.default_rng(0).integers(0, 256, (3, 16, 16, 3), dtype=np.uint8)
    assert encode_mp4(frames, 8) == encode_mp4(frames.copy(), 8)
    decoded, codec, rate = _decode(encode_mp4(frames, 12, Mp4Settings(codec="mpeg4")))
    assert decoded.shape == frames.shape and codec == "mpeg4" and rate == 12.0
    # Frames constant over 2x2 blocks lose nothing to chroma subsampling: at crf 0 the round trip through this
    # module's BT.601 conversion and FFmpeg's decoder is off by rounding only.
    blocky = np.repeat(np.repeat(frames[:, :9, :11], 2, 1), 2, 2)
    decoded = _decode(encode_mp4(blocky, 8, Mp4Settings(crf=0)))[0]
    assert decoded.shape == blocky.shape and np.abs(decoded.astype(int) - blocky).max() <= 3
    with pytest.raises(Mp4Error, match="even"):
        encode_mp4(frames[:, :15], 8)
    odd = frames[:, :15, :13]
    assert np.array_equal(_decode(encode_mp4(odd, 8, Mp4Settings(lossless=True)))[0], odd)
    for bad in (frames.astype(np.float32), frames[0]):
        with pytest.raises(Mp4Error):
            encode_mp4(bad, 8)
    with pytest.raises(Mp4Error):
        encode_mp4(frames, 0)
    with pytest.raises(Mp4Error):
        Mp4Settings(crf=52)
    assert to_uint8(np.array([0.0, 0.5, 1.0, 1.2, -0.1])).tolist() == [0, 128, 255, 255, 0]


def test_without_libx264_the_encoder_falls_back_to_mpeg4(monkeypatch):
    assert default_codec() == "libx264"  # PyPI's av wheel carries it
    monkeypatch.setattr(av, "codecs_available", set(av.codecs_available) - {"libx264"})
    frames = np.zeros((2, 16, 16, 3), dtype=np.uint8)
    assert default_codec() == "mpeg4" and _decode(encode_mp4(frames, 8))[1] == "mpeg4"
