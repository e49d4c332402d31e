"""Rendering one video request: a ``CachedWanPipeline`` call, its frames as uint8, the MP4 bytes.

Rules:

* ``VideoSpec`` is a checked request: the renderer's ``check`` refuses, before any job exists, what the pipeline
  would silently change (a width or height that is not a multiple of ``size_multiple``, a frame count that is not
  ``1 + k * frame_multiple``), so the video served has exactly the size and frame count asked for.
* The frames equal the pipeline's own for the same arguments and seed: the call is the wrapper's (prompt and
  negative-prompt embeddings from the store, under the request's salt), with a CPU ``torch.Generator`` seeded
  with ``seed``, ``output_type="np"``, then ``video_mp4.to_uint8``.
* The store entries a request uses are leased from ``prepare`` until the pipeline returns or raises (a cancelled
  job included), so a failed or stopped job holds nothing.
* Progress is reported after every denoising step through the pipeline's ``callback_on_step_end``; the callback
  may raise ``JobCancelled``, which ends the call.
* Frames that are not all finite (NaN or infinity) raise ``NonFiniteOutput``: such a job fails, it never
  completes with a video of garbage.
* ``max_prompt_chars`` is the wrapper's (the longest prompt its tokenizers read); ``VideoSpec.kept_bytes`` is
  what a job of the spec holds besides its video, which the job store counts in its byte bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .images import finite
from .video_mp4 import Mp4Settings, encode_mp4, to_uint8

# What a kept job holds besides its prompts and video: the job, its spec and the JSON object it is served as
# (about a kilobyte together); an allowance, so that a job of empty prompts still counts.
JOB_OBJECT_BYTES = 2048


@dataclass(frozen=True)
class VideoSpec:
    prompt: str
    negative_prompt: str | None
    width: int
    height: int
    num_frames: int
    fps: int
    num_inference_steps: int
    seed: int
    guidance_scale: float | None  # None: the pipeline's default

    @property
    def kept_bytes(self) -> int:
        """The bytes a job of this spec holds while it is kept, its video aside: its prompts and its object."""
        prompts = len(self.prompt.encode("utf-8")) + len((self.negative_prompt or "").encode("utf-8"))
        return JOB_OBJECT_BYTES + prompts


class WanRenderer:
    """Renders ``VideoSpec``s with ``pipe`` (a ``CachedWanPipeline``); a ``VideoJobs`` renderer."""

    def __init__(self, pipe, mp4: Mp4Settings = Mp4Settings()):
        self.pipe = pipe
        self.mp4 = mp4
        wan = pipe.pipe
        wan.set_progress_bar_config(disable=True)
        patch = wan.transformer.config.patch_size
        self.size_multiple = int(wan.vae_scale_factor_spatial * max(patch[1], patch[2]))
        self.frame_multiple = int(wan.vae_scale_factor_temporal)
        self.max_prompt_chars = pipe.max_prompt_chars

    def size_error(self, width: int, height: int) -> str | None:
        """Why the pipeline cannot render this size as asked, or None."""
        m = self.size_multiple
        if width % m or height % m:
            return f"width and height must be multiples of {m} for this model, got {width}x{height}"
        return None

    def frames_error(self, num_frames: int) -> str | None:
        """Why the pipeline cannot render this many frames as asked, or None."""
        m = self.frame_multiple
        if (num_frames - 1) % m:
            return f"num_frames must be 1 + a multiple of {m} for this model (e.g. {1 + m}, {1 + 2 * m}), " \
                   f"got {num_frames}"
        return None

    def frames(self, spec: VideoSpec, salt: bytes, progress=None) -> tuple[np.ndarray, int]:
        """The uint8 frames (F, H, W, 3) of ``spec`` and the number of store hits its prompts had."""
        kwargs = {"height": spec.height, "width": spec.width, "num_frames": spec.num_frames,
                  "num_inference_steps": spec.num_inference_steps, "output_type": "np",
                  "generator": torch.Generator(device="cpu").manual_seed(spec.seed)}
        if spec.guidance_scale is not None:
            kwargs["guidance_scale"] = spec.guidance_scale
        if progress is not None:
            steps = spec.num_inference_steps

            def on_step(pipe, i, t, tensors):
                progress((i + 1) / steps)
                return tensors

            kwargs["callback_on_step_end"] = on_step
        with self.pipe.prepare(spec.prompt, spec.negative_prompt, cache_salt=salt, **kwargs) as call:
            video = self.pipe.pipe(**call.kwargs).frames
            hits = call.hits
        return to_uint8(finite(video[0], "frames")), hits

    def __call__(self, spec: VideoSpec, salt: bytes, progress) -> tuple[bytes, dict]:
        frames, hits = self.frames(spec, salt, progress)
        return encode_mp4(frames, spec.fps, self.mp4), {"encoder_cache_hits": hits}
