"""``POST /v1/images/generations``: text-to-image through ``CachedSD3Pipeline``, in OpenAI's images shape.

Rules:

* Every field is checked before anything is queued or encoded: ``size`` is one of the configured sizes
  (``invalid_size``), ``n`` and ``num_inference_steps`` within the configured limits, ``seed`` not negative,
  ``response_format`` ``b64_json`` (``url`` is refused: this server stores no files), PNG output only, the
  guidance scale in [0, ``MAX_GUIDANCE_SCALE``], ``prompt`` and ``negative_prompt`` at most the pipeline's
  ``max_prompt_chars`` (its tokenizers truncate there: a longer text would only hold the worker while it is
  tokenized). A refused request holds nothing.
* A render whose pixels are not all finite (NaN or infinity: an overflowing model) fails with
  ``NonFiniteOutput`` (500 ``generation_failed``); it is never served as an image.
* The images are the pipeline's own for the same arguments: the wrapper's call (prompt and negative-prompt
  embeddings from the store, under the request's tenant salt) with a CPU ``torch.Generator`` seeded with
  ``seed`` (drawn at random when the request names none), ``output_type="np"`` turned into images by the
  pipeline's ``image_processor.numpy_to_pil`` (what ``output_type="pil"`` does, with the finiteness check
  between), each image written as a PNG (lossless): decoding the PNG gives the pipeline's pixels.
* The negative prompt is the request's, or the deployment's (``ServerConfig.negative_prompt``) when it sends
  none: its store entries are computed once per tenant salt and hit after. Prompt entries are of kind
  ``text_encoder``, negative-prompt entries of kind ``negative_prompt``, position biases ``position_bias``.
* Generation runs on the pipeline's ``GenerationQueue`` (one call at a time, a bounded queue: 503 beyond). A
  client that goes away cancels its job: a waiting job never runs, a running one stops at its next denoising
  step; the wrapper releases its leases either way.
"""

from __future__ import annotations

import base64
import inspect
import io
import secrets
from dataclasses import dataclass

import numpy as np
import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..errors import MmcacheError
from .config import ServerConfigError, parse_size
from .errors import APIError, bad_request
from .job_queue import Job, QueuedService
from .protocol import ImageGenerationRequest, now

TEXT_ENCODER_KIND = "text_encoder"
NEGATIVE_KIND = "negative_prompt"
# Classifier-free guidance scales in use run from 1 to about 20 (SD3's default 7, Wan's 5); past 100 the
# guided noise is dominated by the difference term and, far past, overflows to NaN (1e308 gives a flat image).
MAX_GUIDANCE_SCALE = 100.0


class NonFiniteOutput(MmcacheError):
    """A render whose pixels or frames hold NaN or infinity: a failure, never served as a success."""


def finite(array: np.ndarray, what: str) -> np.ndarray:
    """``array``, or ``NonFiniteOutput`` when any value is NaN or infinite."""
    if not np.isfinite(array).all():
        raise NonFiniteOutput(f"the pipeline's {what} hold NaN or infinity (the model overflowed); "
                              f"nothing is returned")
    return array


def guidance_error(value: float) -> str | None:
    """Why ``value`` is not a guidance scale this server runs, or None (NaN fails every comparison)."""
    if not 0 <= value <= MAX_GUIDANCE_SCALE:
        return f"guidance_scale must be a number in [0, {MAX_GUIDANCE_SCALE:g}], got {value!r}"
    return None


@dataclass(frozen=True)
class ImageSpec:
    """A checked image request: what the pipeline is called with."""

    prompt: str
    negative_prompt: str
    width: int
    height: int
    n: int
    seed: int
    guidance_scale: float | None  # None: the pipeline's default
    num_inference_steps: int


class ImageService(QueuedService):
    """One SD3-family pipeline served through the store: ``check`` a request, ``submit`` it, PNG bytes back."""

    task = "images"

    def __init__(self, pipe, store, config, name: str, owner_share: int | None = None):
        from encoders.diffusion import CachedSD3Pipeline

        self.pipe = pipe
        self.wrapper = CachedSD3Pipeline(pipe, store, prompt_kind=TEXT_ENCODER_KIND, negative_kind=NEGATIVE_KIND)
        pipe.set_progress_bar_config(disable=True)  # a server's stderr is its log, not a terminal
        self.sizes = _sizes(pipe, config.image_sizes)
        self.max_prompt_chars = self.wrapper.max_prompt_chars
        if len(config.negative_prompt) > self.max_prompt_chars:
            raise ServerConfigError(f"negative_prompt is longer than the {self.max_prompt_chars} characters "
                                    f"{name} reads of a prompt")
        default_steps = inspect.signature(type(pipe).__call__).parameters["num_inference_steps"].default
        self.default_steps = min(int(default_steps), config.max_inference_steps)
        super().__init__(name, config, owner_share)

    def check(self, req) -> ImageSpec:
        """The request as an ``ImageSpec``, or an ``APIError`` (400) naming the field."""
        limits = self.config
        if req.response_format not in (None, "b64_json"):
            raise bad_request(f"response_format {req.response_format!r} is not supported: this server stores no "
                              f"files, so it answers b64_json only", "response_format")
        if req.output_format not in (None, "png"):
            raise bad_request(f"output_format {req.output_format!r} is not supported: images are PNG",
                              "output_format")
        size = self.sizes[0] if req.size in (None, "auto") else parse_size(req.size)
        if size not in self.sizes:
            known = ", ".join(f"{w}x{h}" for w, h in self.sizes)
            raise bad_request(f"size {req.size!r} is not served; this server serves {known}", "size", "invalid_size")
        if req.n > limits.max_images_per_request:
            raise bad_request(f"n is {req.n}, above the limit of {limits.max_images_per_request} images a request",
                              "n")
        steps = self.default_steps if req.num_inference_steps is None else req.num_inference_steps
        if steps > limits.max_inference_steps:
            raise bad_request(f"num_inference_steps is {steps}, above the limit of {limits.max_inference_steps}",
                              "num_inference_steps")
        for field, text in (("prompt", req.prompt), ("negative_prompt", req.negative_prompt or "")):
            if len(text) > self.max_prompt_chars:
                raise bad_request(f"{field} is {len(text)} characters, above the {self.max_prompt_chars} this "
                                  f"model reads (its text encoders truncate there)", field)
        reason = None if req.guidance_scale is None else guidance_error(req.guidance_scale)
        if reason:
            raise bad_request(reason, "guidance_scale")
        negative = limits.negative_prompt if req.negative_prompt is None else req.negative_prompt
        seed = secrets.randbelow(2**63) if req.seed is None else req.seed
        return ImageSpec(req.prompt, negative, size[0], size[1], req.n, seed, req.guidance_scale, steps)

    def submit(self, spec: ImageSpec, salt: bytes, owner: str | None = None) -> Job:
        """Queue ``spec`` for the tenant ``owner`` (``QueueFull`` when the queue or the tenant's share of it is
        full); the job's result is a list of PNG bytes."""
        return self.queue.submit(lambda job: self.render(spec, salt, job), owner)

    def render(self, spec: ImageSpec, salt: bytes, job: Job | None = None) -> list[bytes]:
        """The PNG bytes of each image of ``spec`` (in the calling thread); ``InvalidRequest`` for arguments the
        wrapper refuses; ``JobCancelled`` when ``job`` is cancelled during the call; ``NonFiniteOutput`` when a
        pixel is NaN or infinite."""
        if job is not None:
            job.check()
        extra = {} if spec.guidance_scale is None else {"guidance_scale": spec.guidance_scale}

        def on_step(pipe, step, timestep, tensors):
            if job is not None:
                job.check()  # raises inside the pipeline: the wrapper releases its leases on the way out
            return tensors

        with torch.no_grad():  # as the pipeline itself runs; no inference tensors enter the shared store
            out = self.wrapper(spec.prompt, spec.negative_prompt, cache_salt=salt, height=spec.height,
                               width=spec.width, num_inference_steps=spec.num_inference_steps,
                               num_images_per_prompt=spec.n, output_type="np",
                               generator=torch.Generator("cpu").manual_seed(spec.seed),
                               callback_on_step_end=on_step, **extra)
        images = self.pipe.image_processor.numpy_to_pil(finite(out.images, "pixels"))
        return [png(image) for image in images]


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def images_body(created: int, pngs: list[bytes], size: tuple[int, int]) -> dict:
    """OpenAI's images response."""
    return {"created": created, "data": [{"b64_json": base64.b64encode(p).decode("ascii")} for p in pngs],
            "output_format": "png", "size": f"{size[0]}x{size[1]}"}


def _sizes(pipe, configured: tuple[str, ...]) -> list[tuple[int, int]]:
    """The served sizes, each checked against what the pipeline takes: a multiple of its latent patch in pixels
    (SD3's ``check_inputs``), and within its position embedding when it has a maximum."""
    step = pipe.vae_scale_factor * pipe.patch_size
    default = pipe.default_sample_size * pipe.vae_scale_factor
    sizes = [parse_size(s) for s in configured] or [(default, default)]
    limit = getattr(pipe.transformer.config, "pos_embed_max_size", None)
    for w, h in sizes:
        if w % step or h % step:
            raise ServerConfigError(f"image size {w}x{h} is not a multiple of the pipeline's {step} pixels")
        if limit and max(w, h) // step > limit:
            raise ServerConfigError(f"image size {w}x{h} is beyond the pipeline's position embedding "
                                    f"({limit * step} pixels a side)")
    return sizes


def image_router(service: ImageService, intake, metrics) -> APIRouter:
    """``POST /v1/images/generations`` over ``service``, read through ``intake`` (an ``intake.Intake``)."""
    router = APIRouter()

    @router.post("/v1/images/generations")
    async def generations(request: Request):
        with metrics.timed("images", service.name) as outcome:
            tenant, req, salt = await intake.read(request, ImageGenerationRequest, service.name, model_required=False)
            spec = service.check(req)
            try:
                pngs = await intake.run_job(request, lambda: service.submit(spec, salt, tenant.name))
            except NonFiniteOutput as e:
                raise APIError(500, str(e), "internal_server_error", None, "generation_failed") from None
            if pngs is None:
                outcome.status = 499
                return Response(status_code=499)
            return JSONResponse(images_body(now(), pngs, (spec.width, spec.height)))

    return router

