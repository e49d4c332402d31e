"""Frames to MP4 bytes with PyAV (FFmpeg inside its wheel), in memory.

Rules:

* ``encode_mp4`` takes uint8 RGB frames shaped (frames, height, width, 3) and returns a whole MP4 file. The same
  frames, fps and settings give the same bytes: the RGB to yuv420p conversion is done here in numpy (BT.601,
  limited range, 2x2 chroma means), every frame carries its timestamp, x264's macroblock tree is off (its float
  propagation gave different bytes for the same frames from one process to the next), and the muxer writes no
  wall-clock time.
* The default is H.264 (libx264) in yuv420p at ``crf`` 18, the format every player reads; yuv420p halves the
  chroma resolution, so width and height must be even (an odd size raises ``Mp4Error``, nothing is padded).
  Where the wheel lacks libx264, FFmpeg's own MPEG-4 part 2 encoder (``mpeg4``) is used instead.
* ``lossless=True`` encodes H.264 in RGB at quantiser 0 (libx264rgb): the decoded frames equal the input bit
  for bit, at any size; files are larger and fewer players read them.
* ``to_uint8`` is the one conversion from a pipeline's float frames in [0, 1]: scale by 255, round half to even,
  clip (diffusers' own PIL conversion rounds the same way).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from ..errors import MmcacheError

MAX_FPS = 240


class Mp4Error(MmcacheError, ValueError):
    """Frames or settings that cannot be encoded."""


@dataclass(frozen=True)
class Mp4Settings:
    codec: str | None = None  # None: libx264 where the wheel has it, else mpeg4
    crf: int = 18  # libx264's constant rate factor (0 best, 51 worst); mpeg4 maps it onto qscale
    lossless: bool = False  # H.264 in RGB at quantiser 0: decodes to the exact input frames

    def __post_init__(self):
        if isinstance(self.crf, bool) or not isinstance(self.crf, int) or not 0 <= self.crf <= 51:
            raise Mp4Error(f"crf must be an int in [0, 51], got {self.crf!r}")
        if self.codec not in (None, "libx264", "mpeg4"):
            raise Mp4Error(f"codec must be libx264, mpeg4 or None (automatic), got {self.codec!r}")
        if self.lossless and self.codec == "mpeg4":
            raise Mp4Error("lossless encoding needs libx264")


def default_codec() -> str:
    import av

    return "libx264" if "libx264" in av.codecs_available else "mpeg4"


def to_uint8(frames: np.ndarray) -> np.ndarray:
    """A pipeline's float frames in [0, 1] as uint8."""
    return np.clip(np.rint(np.asarray(frames, dtype=np.float32) * 255.0), 0, 255).astype(np.uint8)


def _stream_setup(settings: Mp4Settings, height: int, width: int) -> tuple[str, str, dict]:
    """The encoder name, its pixel format and its options."""
    if settings.lossless:
        return "libx264rgb", "rgb24", {"qp": "0"}
    if height % 2 or width % 2:
        raise Mp4Error(f"yuv420p needs an even width and height, got {width}x{height}")
    codec = settings.codec or default_codec()
    if codec == "libx264":
        return codec, "yuv420p", {"crf": str(settings.crf), "x264-params": "mbtree=0"}  # see the module's rules
    return codec, "yuv420p", {"qscale": str(max(1, min(31, settings.crf // 2 + 1)))}


# BT.601 RGB to Y'CbCr in limited ("MPEG") range, rows Y, Cb, Cr, for R'G'B' in [0, 255].
_BT601 = (np.array([[65.481, 128.553, 24.966], [-37.797, -74.203, 112.0], [112.0, -93.786, -18.214]])
          / 255.0).astype(np.float32)
_BT601_OFFSET = np.array([16.0, 128.0, 128.0], dtype=np.float32)


def _row(rgb: np.ndarray, row: int) -> np.ndarray:
    """One of Y, Cb, Cr (``row`` 0, 1, 2) of float RGB pixels (..., 3): three multiply-adds, not a matmul with an
    inner size of 3."""
    c = _BT601[row]
    return rgb[..., 0] * c[0] + rgb[..., 1] * c[1] + rgb[..., 2] * c[2] + _BT601_OFFSET[row]


def _yuv420p(frame: np.ndarray) -> np.ndarray:
    """One frame (H, W, 3) as yuv420p: its flat Y, Cb and Cr planes (chroma at half width and height, the mean of
    each 2x2 block) shaped (H * 3 / 2, W), the layout ``av.VideoFrame.from_ndarray`` takes. Converted here
    rather than by swscale inside the encoder, so the bytes depend on the frames alone."""
    height, width, _ = frame.shape
    rgb = frame.astype(np.float32)
    # The conversion is linear, so the 2x2 chroma means are the conversion of the 2x2 RGB means.
    half = rgb.reshape(height // 2, 2, width // 2, 2, 3).mean(axis=(1, 3))
    planes = [_row(rgb, 0).ravel(), _row(half, 1).ravel(), _row(half, 2).ravel()]
    flat = np.clip(np.rint(np.concatenate(planes)), 0, 255).astype(np.uint8)
    return flat.reshape(height * 3 // 2, width)


def encode_mp4(frames: np.ndarray, fps: int, settings: Mp4Settings = Mp4Settings()) -> bytes:
    """The MP4 file of ``frames`` (uint8, (F, H, W, 3)) at ``fps`` frames per second."""
    import av

    if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise Mp4Error("frames must be a uint8 array shaped (frames, height, width, 3)")
    count, height, width, _ = frames.shape
    if count < 1 or height < 1 or width < 1:
        raise Mp4Error(f"no pixels to encode: shape {frames.shape}")
    if isinstance(fps, bool) or not isinstance(fps, int) or not 1 <= fps <= MAX_FPS:
        raise Mp4Error(f"fps must be an int in [1, {MAX_FPS}], got {fps!r}")
    codec, pix_fmt, options = _stream_setup(settings, height, width)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream(codec, rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
        stream.options = options
        if pix_fmt == "yuv420p":  # say how the planes were made, so no player guesses BT.709 for HD sizes
            stream.codec_context.colorspace = av.video.reformatter.Colorspace.ITU601
            stream.codec_context.color_range = av.video.reformatter.ColorRange.MPEG
        for index, pixels in enumerate(frames):  # one frame at a time: a whole video in float is large
            planes = np.ascontiguousarray(pixels) if pix_fmt == "rgb24" else _yuv420p(pixels)
            frame = av.VideoFrame.from_ndarray(planes, format=pix_fmt)
            # Explicit timestamps: x264's rate control reads frame durations, and a frame without a pts would
            # leave them to whatever the encoder guesses.
            frame.pts, frame.time_base = index, Fraction(1, fps)
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))  # flush the encoder's delayed frames
    return buf.getvalue()
