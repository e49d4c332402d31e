"""The ``/v1/videos`` routes (vLLM-Omni's video API shape) over a ``VideoService``: a Wan pipeline's
``VideoJobs`` store.

Wiring (``build_service``, as the server does it)::

    service = VideoService(name, VideoJobs(WanRenderer(CachedWanPipeline(pipe, store)), ...), VideoLimits())
    app.include_router(video_router(service, Intake(config, tenants), metrics.registry))
    service.close()  # when the server stops: stops the queue's worker, frees every stored video

The routes raise ``errors.APIError``; the app's handler for it (``app.build_app``) turns them into OpenAI error
objects and counts them.

Routes: ``POST /v1/videos`` (a job object, status ``queued``), ``GET /v1/videos`` (the caller's jobs, newest
first), ``GET /v1/videos/{id}``, ``GET /v1/videos/{id}/content`` (``video/mp4``), ``DELETE /v1/videos/{id}``,
``POST /v1/videos/sync`` (runs on the same queue and returns the MP4 bytes; a client that goes away cancels it).

Rules:

* Fields come as JSON or as a form (multipart or urlencoded, parsed by python-multipart; a file part is
  refused): ``prompt`` (required), ``negative_prompt``, ``width``, ``height`` (or ``size`` as ``WIDTHxHEIGHT``),
  ``num_frames``, ``fps``, ``num_inference_steps``, ``seed``, ``guidance_scale``, ``model``, ``cache_salt``,
  ``user`` (ignored). Any other field (``seconds`` included: give ``num_frames`` and ``fps``) is refused.
* A request is checked in full before a job exists: 401 (key), 415 (content type), 413 (body), 400 (JSON read
  by ``intake.parse_json_object``, key and body as every route reads them: bad or too deeply nested JSON is
  ``invalid_json``; a ``cache_salt`` longer than ``max_cache_salt``;
  a field's type or value: a size the model cannot render exactly, a frame count not 1 + k x the model's
  temporal factor, fps outside [1, ``max_fps``], a seed outside [0, 2**64 - 1], a guidance scale outside
  [0, ``images.MAX_GUIDANCE_SCALE``], a prompt or negative prompt longer than the renderer's
  ``max_prompt_chars``), 413 (width, height, frames or steps beyond ``VideoLimits``), 404 (model), 503 with
  Retry-After (the queue, or the tenant's share of the queue or of the store, full). A refused request leaves no
  job and no store entry.
* A job holds its prompts and its object (``VideoSpec.kept_bytes``) in the store's byte bound, beside its MP4;
  each tenant has its share of the store's bounds (``VideoJobs(share=Tenants.share)``, wired by the server), so
  one tenant's jobs never refuse or evict another's.
* A job is its tenant's: any other key gets 404 for it, and it is absent from the others' listings. Its prompts
  are keyed in the store under the tenant's salt and the request's ``cache_salt``.
* A seed left out is drawn by the server and shown in the job object, so any video can be made again.
* ``/content`` of a job not completed is 409 (``video_not_ready``, or ``video_failed`` with the job's error in
  its object); a ``/sync`` job that fails is 500 (400 if the pipeline refused its arguments).
"""

from __future__ import annotations

import asyncio
import re
import secrets
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..checks import finite_number, positive_int, unicode_text
from .config import source_name
from .errors import APIError, bad_request, model_not_found, overloaded, too_large
from .images import NEGATIVE_KIND, TEXT_ENCODER_KIND, guidance_error
from .intake import ClientGone, Intake, bounded_body, parse_json_object, unless_disconnected
from .tenants import Tenant
from .video_jobs import COMPLETED, JobsFull, VideoJob, VideoJobs
from .video_render import VideoSpec

MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed's range
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1280.0, 2560.0)
_FIELDS = {"prompt", "negative_prompt", "model", "width", "height", "size", "num_frames", "fps",
           "num_inference_steps", "seed", "guidance_scale", "cache_salt", "user"}
_MAX_FORM_FIELDS = 32
_FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")


@dataclass(frozen=True)
class VideoLimits:
    """What one request may ask for, and what it gets when it leaves a field out (Wan 2.1's 480p defaults)."""

    max_width: int = 1280
    max_height: int = 1280
    max_frames: int = 129
    max_steps: int = 100
    max_fps: int = 60
    default_width: int = 832
    default_height: int = 480
    default_frames: int = 81
    default_fps: int = 16
    default_steps: int = 50

    def __post_init__(self):
        for name, value in self.__dict__.items():
            if not positive_int(value):
                raise ValueError(f"VideoLimits.{name} must be a positive int, got {value!r}")


# what a request leaving fields out gets from the tiny preset: a size and length it renders in a second
TINY_WAN_DEFAULTS = {"default_width": 32, "default_height": 32, "default_frames": 5, "default_steps": 4}


@dataclass
class VideoService:
    """The video jobs of a Wan pipeline served as ``name``, and what one request may ask of it."""

    name: str
    jobs: VideoJobs
    limits: VideoLimits = VideoLimits()
    task: str = "videos"

    @property
    def alive(self) -> bool:
        return self.jobs.alive

    def close(self) -> None:
        self.jobs.close()


def build_service(pipe, store, config, source, tenants, metrics) -> tuple[VideoService, APIRouter]:
    """The service of the Wan pipeline ``pipe`` (from ``source``) over the server's ``store``, and its router."""
    from encoders.diffusion import CachedWanPipeline

    from .video_render import WanRenderer

    wrapper = CachedWanPipeline(pipe, store, prompt_kind=TEXT_ENCODER_KIND, negative_kind=NEGATIVE_KIND)
    jobs = VideoJobs(WanRenderer(wrapper), max_jobs=config.max_video_jobs, max_pending=config.max_generation_waiting,
                     max_bytes=config.max_video_bytes, share=tenants.share)
    limits = config.video_limits or (VideoLimits(**TINY_WAN_DEFAULTS) if source == "tiny-wan" else VideoLimits())
    service = VideoService(source_name(source), jobs, limits)
    return service, video_router(service, Intake(config, tenants), metrics.registry)


def video_router(service: VideoService, intake: Intake, registry) -> APIRouter:
    """The video routes over ``service`` (whose renderer has ``size_error``, ``frames_error`` and
    ``max_prompt_chars``, as ``WanRenderer``), read through ``intake``, recording into the Prometheus
    ``registry``."""
    api = _VideoApi(service, intake, VideoMetrics(registry, service.name, service.jobs))
    router = APIRouter()
    router.add_api_route("/v1/videos", api.create, methods=["POST"])
    router.add_api_route("/v1/videos/sync", api.sync, methods=["POST"])
    router.add_api_route("/v1/videos", api.listing, methods=["GET"])
    router.add_api_route("/v1/videos/{video_id}", api.retrieve, methods=["GET"])
    router.add_api_route("/v1/videos/{video_id}/content", api.content, methods=["GET"])
    router.add_api_route("/v1/videos/{video_id}", api.delete, methods=["DELETE"])
    return router


class VideoMetrics:
    """Requests by route, finished jobs by outcome, job latency; stored jobs, bytes and evictions at scrape."""

    def __init__(self, registry, model_name: str, jobs: VideoJobs):
        self.model_name = model_name
        self.requests = Counter("mmcache:video_requests", "Video API requests, by route.",
                                ["model_name", "route"], registry=registry)
        self.outcomes = Counter("mmcache:video_jobs_finished", "Video jobs finished, by outcome.",
                                ["model_name", "outcome"], registry=registry)
        self.latency = Histogram("mmcache:video_job_latency_seconds", "Creation to completion of a video job.",
                                 ["model_name"], buckets=_LATENCY_BUCKETS, registry=registry)
        registry.register(_JobsCollector(jobs, model_name))
        jobs.observe = self.job_finished

    def request(self, route: str) -> None:
        self.requests.labels(self.model_name, route).inc()

    def job_finished(self, job: VideoJob) -> None:
        self.outcomes.labels(self.model_name, job.outcome).inc()
        if job.outcome == COMPLETED:
            self.latency.labels(self.model_name).observe(job.latency_s)


class _JobsCollector:
    def __init__(self, jobs: VideoJobs, model_name: str):
        self.jobs, self.model_name = jobs, model_name

    def collect(self):
        stats, name = self.jobs.stats(), self.model_name
        stored = GaugeMetricFamily("mmcache:video_jobs_stored", "Video jobs held, by status.",
                                   labels=["model_name", "status"])
        for status, count in stats["jobs"].items():
            stored.add_metric([name, status], count)
        size = GaugeMetricFamily("mmcache:video_stored_bytes",
                                 "Bytes held by kept video jobs: their MP4s, prompts and objects.",
                                 labels=["model_name"])
        size.add_metric([name], stats["stored_bytes"])
        evicted = CounterMetricFamily("mmcache:video_jobs_evicted", "Finished video jobs evicted by the bounds.",
                                      labels=["model_name"])
        evicted.add_metric([name], stats["evictions"])
        yield from (stored, size, evicted)


class _VideoApi:
    def __init__(self, service: VideoService, intake: Intake, metrics: VideoMetrics):
        self.jobs, self.intake, self.metrics = service.jobs, intake, metrics
        self.model_name, self.limits = service.name, service.limits

    # ---- routes -----------------------------------------------------------------------------------------
    async def create(self, request: Request):
        self.metrics.request("create")
        job = await self._submit(request, listed=True)
        return JSONResponse(self._object(job))

    async def sync(self, request: Request):
        self.metrics.request("sync")
        job = await self._submit(request, listed=False)
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def wake(_job):
            try:
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))
            except RuntimeError:  # the loop has closed: nobody is waiting
                pass

        self.jobs.on_done(job, wake)
        try:
            await unless_disconnected(request, done)
        except ClientGone:
            self.jobs.cancel(job)
            return Response(status_code=499)
        if job.status != COMPLETED:
            raise _job_error(job)
        return Response(job.content, media_type="video/mp4",
                        headers={"x-video-id": job.id, "x-video-seed": str(job.spec.seed)})

    async def listing(self, request: Request):
        self.metrics.request("list")
        tenant = self.intake.tenant(request)
        data = [self._object(job) for job in self.jobs.list(tenant.name)]
        return JSONResponse({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                             "last_id": data[-1]["id"] if data else None, "has_more": False})

    async def retrieve(self, request: Request, video_id: str):
        self.metrics.request("retrieve")
        return JSONResponse(self._object(self._job(request, video_id)))

    async def content(self, request: Request, video_id: str):
        self.metrics.request("content")
        job = self._job(request, video_id)
        content = job.content
        if job.status != COMPLETED or content is None:
            if job.status == COMPLETED:  # deleted or evicted between the lookup and here
                raise _video_not_found(video_id)
            code = "video_failed" if job.finished else "video_not_ready"
            raise APIError(409, f"the video {video_id} is {job.status}; its content exists once it has completed",
                           "invalid_request_error", None, code)
        return Response(content, media_type="video/mp4",
                        headers={"content-disposition": f'attachment; filename="{job.id}.mp4"'})

    async def delete(self, request: Request, video_id: str):
        self.metrics.request("delete")
        tenant = self.intake.tenant(request)
        if not self.jobs.delete(tenant.name, video_id):
            raise _video_not_found(video_id)
        return JSONResponse({"id": video_id, "object": "video.deleted", "deleted": True})

    # ---- helpers ----------------------------------------------------------------------------------------
    def _job(self, request: Request, video_id: str) -> VideoJob:
        job = self.jobs.get(self.intake.tenant(request).name, video_id)
        if job is None:
            raise _video_not_found(video_id)
        return job

    async def _submit(self, request: Request, listed: bool) -> VideoJob:
        tenant = self.intake.tenant(request)
        fields, from_form = await self._fields(request)
        spec, salt = self._spec(fields, from_form, tenant)
        try:
            return self.jobs.submit(tenant.name, spec, salt, listed, spec.kept_bytes)
        except JobsFull as e:
            raise overloaded(f"the video queue is full: {e}; retry later",
                             self.intake.config.retry_after_s) from None

    async def _fields(self, request: Request) -> tuple[dict, bool]:
        """The request's fields, and whether they came as a form (every value a str)."""
        ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if ctype not in ("application/json", *_FORM_TYPES):
            raise APIError(415, f"send the fields as application/json or multipart/form-data, not {ctype!r}",
                           "invalid_request_error", None, "unsupported_media_type")
        body = await bounded_body(request, self.intake.config.max_body_bytes)
        if ctype == "application/json":
            return parse_json_object(body), False
        return await _form(request, body), True

    def _spec(self, fields: dict, from_form: bool, tenant: Tenant) -> tuple[VideoSpec, bytes]:
        """A checked ``VideoSpec`` and the salt of its store entries (``tenant``'s and the request's
        ``cache_salt``); ``APIError`` for anything wrong."""
        unknown = sorted(set(fields) - _FIELDS)
        if unknown:
            raise bad_request(f"unsupported field {unknown[0]!r}", unknown[0], "unsupported_field")
        prompt = _text(fields, "prompt", required=True)
        negative = _text(fields, "negative_prompt")
        for name, text in (("prompt", prompt), ("negative_prompt", negative or "")):
            if len(text) > self.jobs.render.max_prompt_chars:
                raise bad_request(f"{name} is {len(text)} characters, above the {self.jobs.render.max_prompt_chars}"
                                  f" this model reads (its text encoder truncates there)", name)
        model = _text(fields, "model")
        if model is not None and model != self.model_name:
            raise model_not_found(model, self.model_name)
        salt = self.intake.salt(tenant, _text(fields, "cache_salt"))
        width, height = self._size(fields, from_form)
        num_frames = self._bounded(fields, "num_frames", from_form, self.limits.default_frames,
                                   self.limits.max_frames)
        reason = self.jobs.render.frames_error(num_frames)
        if reason:
            raise bad_request(reason, "num_frames")
        steps = self._bounded(fields, "num_inference_steps", from_form, self.limits.default_steps,
                              self.limits.max_steps)
        fps = _int(fields, "fps", from_form, self.limits.default_fps)
        if not 1 <= fps <= self.limits.max_fps:
            raise bad_request(f"fps must be in [1, {self.limits.max_fps}], got {fps}", "fps")
        seed = _int(fields, "seed", from_form, None)
        if seed is None:
            seed = secrets.randbits(63)
        elif not 0 <= seed <= MAX_SEED:
            raise bad_request(f"seed must be an int in [0, 2**64 - 1], got {seed}", "seed")
        guidance = _number(fields, "guidance_scale", from_form)
        reason = None if guidance is None else guidance_error(guidance)
        if reason:
            raise bad_request(reason, "guidance_scale")
        spec = VideoSpec(prompt, negative, width, height, num_frames, fps, steps, seed, guidance)
        return spec, salt

    def _size(self, fields: dict, from_form: bool) -> tuple[int, int]:
        size = _text(fields, "size")
        if size is not None:
            match = re.fullmatch(r"([1-9][0-9]{0,5})x([1-9][0-9]{0,5})", size)
            if match is None:
                raise bad_request(f"size must be WIDTHxHEIGHT (e.g. 832x480), got {size!r}", "size")
            for name, value in zip(("width", "height"), match.groups()):
                if name in fields and _int(fields, name, from_form, None) != int(value):
                    raise bad_request(f"size {size} and {name} {fields[name]} disagree", name)
                fields = {**fields, name: int(value)}
        width = self._bounded(fields, "width", from_form, self.limits.default_width, self.limits.max_width)
        height = self._bounded(fields, "height", from_form, self.limits.default_height, self.limits.max_height)
        reason = self.jobs.render.size_error(width, height)
        if reason:
            raise bad_request(reason, "width")
        return width, height

    def _bounded(self, fields: dict, name: str, from_form: bool, default: int, limit: int) -> int:
        value = _int(fields, name, from_form, default)
        if value < 1:
            raise bad_request(f"{name} must be at least 1, got {value}", name)
        if value > limit:
            raise too_large(f"{name} {value} is beyond this server's limit of {limit}", name)
        return value

    def _object(self, job: VideoJob) -> dict:
        spec: VideoSpec = job.spec
        content = job.content
        return {"id": job.id, "object": "video", "model": self.model_name, "status": job.status,
                "progress": job.progress, "created_at": int(job.created_at),
                "completed_at": None if job.completed_at is None else int(job.completed_at),
                "prompt": spec.prompt, "size": f"{spec.width}x{spec.height}",
                "seconds": f"{spec.num_frames / spec.fps:g}", "num_frames": spec.num_frames, "fps": spec.fps,
                "num_inference_steps": spec.num_inference_steps, "seed": spec.seed, "error": job.error,
                "media_type": "video/mp4", "bytes": None if content is None else len(content),
                "inference_time_s": job.latency_s, **job.info}


# ---- field parsing ------------------------------------------------------------------------------------------
def _text(fields: dict, name: str, required: bool = False) -> str | None:
    value = fields.get(name)
    if value is None:
        if required:
            raise bad_request(f"{name} is required", name)
        return None
    if not isinstance(value, str) or not unicode_text(value):
        raise bad_request(f"{name} must be a string of Unicode text", name)
    if required and not value.strip():
        raise bad_request(f"{name} must not be empty", name)
    return value


def _int(fields: dict, name: str, from_form: bool, default):
    value = fields.get(name)
    if value is None or (from_form and value == ""):
        return default
    if from_form and isinstance(value, str) and re.fullmatch(r"[+-]?[0-9]{1,24}", value.strip()):
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise bad_request(f"{name} must be an integer, got {value!r}"[:300], name)


def _number(fields: dict, name: str, from_form: bool) -> float | None:
    value = fields.get(name)
    if value is None or (from_form and value == ""):
        return None
    if from_form and isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise bad_request(f"{name} must be a number, got {value!r}"[:300], name) from None
    if not finite_number(value):
        raise bad_request(f"{name} must be a finite number, got {value!r}"[:300], name)
    return float(value)


def _video_not_found(video_id: str) -> APIError:
    return APIError(404, f"no video {video_id!r}", "invalid_request_error", "video_id", "video_not_found")


def _job_error(job: VideoJob) -> APIError:
    error = job.error or {"code": "generation_failed", "message": "the job failed"}
    if error["code"] == "invalid_request":
        return bad_request(error["message"])
    return APIError(500, error["message"], "internal_server_error", None, error["code"])


# ---- the body -----------------------------------------------------------------------------------------------
async def _form(request: Request, body: bytes) -> dict:
    """The form fields of ``body`` (python-multipart through Starlette); a file part is refused."""
    async def replay():
        return {"type": "http.request", "body": body, "more_body": False}

    try:
        form = await Request(request.scope, replay).form(max_files=0, max_fields=_MAX_FORM_FIELDS)
    except StarletteHTTPException as e:
        raise bad_request(f"bad form: {e.detail}", None, "invalid_form") from None
    except AssertionError as e:  # Starlette's way of saying python-multipart is not installed
        raise APIError(415, f"forms need the python-multipart package on the server: {e}", "invalid_request_error",
                       None, "unsupported_media_type") from None
    fields = {}
    for key, value in form.multi_items():
        if isinstance(value, UploadFile):
            raise bad_request(f"field {key!r} is a file; this endpoint takes text fields only", key)
        if key in fields:
            raise bad_request(f"field {key!r} is given twice", key)
        fields[key] = value
    return fields
