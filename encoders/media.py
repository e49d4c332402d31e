"""Images as a request sends them: the bytes as sent, and a guarded decode of those bytes into RGB pixels.

A request names an image by raw bytes, a file path (or ``file://`` URL) or a data URL
(``data:image/png;base64,...``). ``read_image`` turns any of them into a ``RawImage``: the encoded file exactly
as the user sent it (for a data URL, its decoded payload), which is what the media digest is taken over
(docs/DESIGN.md, "Digests and salts"). ``decode_image`` turns a ``RawImage`` into pixels.

Invariants:

* ``RawImage.data`` is never re-encoded: equal bytes give equal digests whatever the source kind was.
* Local files are read only where the caller opted in (``allow_paths=True``, or ``path_root=`` to confine
  paths to one folder); by default a path or ``file://`` URL is refused before the filesystem is touched. A
  refusal under ``path_root`` reads the same whatever the file's state (absent, unreadable, outside the folder,
  not a regular file, too large), so a request cannot probe which files exist; only a fully trusted caller
  (``allow_paths=True`` without a root) is told why.
* Every failure to read or decode an item raises ``MediaDecodeError`` whose ``item`` is the ``MediaRef`` (index
  in the request, source kind); nothing else escapes for bad input, and nothing is cached or held by a failure.
* The pixel count (width * height from the header) and the aspect ratio are checked against
  ``ImageLimits.max_pixels`` and ``max_aspect_ratio`` before any pixel is decoded, and byte sizes against
  ``max_bytes`` before a payload is read or base64-decoded, so a decompression bomb, an oversized upload or a
  strip that a processor would upscale into gigabytes costs no memory.
* Above ``expansion_free_pixels`` an image whose decoded RGB (3 bytes a pixel, from the header) is more than
  ``max_expansion`` times its bytes as sent is refused before decoding, with the pixel limit's wording: a few KB
  of 1-bit PNG no longer buy hundreds of MB and seconds of CPU. Below that floor (a 4K screenshot) any image
  passes, however flat. Decoding is never reduced (no JPEG ``draft``): the model's processor resizes from the
  full pixels, and a DCT-scaled draft would give other features than the model's own preprocessing.
* Every decode holds ``DECODE_BYTES_PER_PIXEL`` bytes a pixel of ``ImageLimits``'s ``DecodeBudget`` while it
  runs (``decoding``: and while its caller preprocesses the pixels), reserved before the first pixel is decoded;
  decodes that do not fit wait, first come first served. The budget holds at least one image at the pixel limit,
  so a reservation always fits once the others end and no decode waits forever.
* ``ImageLimits.max_images`` bounds the images of one request; the prompt builder (``encoders.chat``) refuses a
  request over it before any of its images is read.
* The pixel limit is ``max_pixels``, not Pillow's: headers are parsed with Pillow's decompression-bomb warning
  ignored (``_header``), because each distinct oversized header would otherwise add an entry to the warnings
  registry of ``PIL.Image`` for the life of the process. Pillow's hard error (twice its own limit) still applies.
* A decoded image is fully loaded RGB: the first frame, EXIF orientation applied, transparency composited on
  white (the rule of transformers' ``convert_to_rgb``). ``DECODE_PARAMS`` names this rule; it is part of every
  media digest, so changing the rule changes the digests.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import re
import stat
import struct
import threading
import urllib.parse
import warnings
import zlib
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import PIL
from PIL import Image, ImageOps

from mmcache.checks import positive_int
from mmcache.errors import InvalidRequest, MediaDecodeError

SOURCE_BYTES = "bytes"
SOURCE_PATH = "path"
SOURCE_DATA_URL = "data_url"

DECODE_PARAMS = {"decoder": f"pillow-{PIL.__version__}", "decode": "first-frame,exif-transpose,alpha-on-white,rgb"}
"""What the decode step contributes to a media digest: the decoder and its version, and the conversion rule."""

_URL_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# Pillow's format plugins report malformed input with any of these, not only OSError.
_DECODE_FAILURES = (OSError, SyntaxError, ValueError, EOFError, struct.error, zlib.error, IndexError, TypeError,
                    Image.DecompressionBombError)


# What a decode may hold at its peak, per pixel of the header's size: the most measured (an RGBA PNG through a
# LLaVA or Qwen2-VL processor) is 24 bytes (the frame, its RGBA copy, the white background, the composite, the RGB
# result, the processor's arrays); an EXIF rotation adds a copy of the frame.
DECODE_BYTES_PER_PIXEL = 32
DEFAULT_DECODE_BUDGET = 2**30
# The server's pixel limit for a vision tower that sees ``tower_pixels``: photos up to 4096x4096 (16.8 MP) always,
# and twice what the tower sees where that is more (Qwen2-VL takes up to 12.8 MP).
PHOTO_PIXELS = 4096 * 4096
TOWER_PIXELS_MULTIPLE = 2


def photo_pixel_limit(tower_pixels: int | None) -> int:
    """The pixel limit for a tower fed at most ``tower_pixels`` (None: unknown): the larger of ``PHOTO_PIXELS``
    and ``TOWER_PIXELS_MULTIPLE`` times the tower's pixels."""
    return max(PHOTO_PIXELS, TOWER_PIXELS_MULTIPLE * (tower_pixels or 0))


class DecodeBudget:
    """Bytes that the decodes in flight may hold together. ``reserve(n)`` waits until ``n`` fits beside what is
    reserved, first come first served (a large reservation is not passed over for ever by small ones);
    ``reserved`` never exceeds ``capacity``, and a reservation above ``capacity`` is refused, never awaited."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._reserved = 0
        self._waiting: deque[object] = deque()
        self._changed = threading.Condition()

    @property
    def reserved(self) -> int:
        return self._reserved

    @property
    def waiting(self) -> int:
        """Reservations waiting their turn."""
        return len(self._waiting)

    @contextmanager
    def reserve(self, nbytes: int):
        """Holds ``nbytes`` of the budget for the ``with`` block, waiting first while they do not fit."""
        if nbytes > self.capacity:
            raise InvalidRequest(f"a reservation of {nbytes} bytes can never fit a budget of {self.capacity}")
        ticket = object()
        with self._changed:
            self._waiting.append(ticket)
            try:
                self._changed.wait_for(lambda: self._waiting[0] is ticket
                                       and self._reserved + nbytes <= self.capacity)
            finally:
                self._waiting.remove(ticket)
                self._changed.notify_all()  # the next in line may fit beside this one
            self._reserved += nbytes
        try:
            yield
        finally:
            with self._changed:
                self._reserved -= nbytes
                self._changed.notify_all()


@dataclass(frozen=True)
class ImageLimits:
    """What an image may cost before it is refused. The defaults accept any photo up to 50 megapixels and read
    no local file (see ``allow_paths``)."""

    max_pixels: int = 50_000_000
    max_bytes: int = 32 * 2**20
    formats: tuple[str, ...] = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
    # Local paths are for trusted callers only: True reads any file the process can read; ``path_root`` reads
    # files inside that folder only (and turns paths on by itself).
    allow_paths: bool = False
    path_root: Path | None = None
    # Images per request (every image of every message, repeats included). A chat sends its whole history each
    # turn, so the cap must cover a conversation's images, not one turn's; each distinct image may cost one
    # vision-tower run, so the cap bounds what one request can make the tower do.
    max_images: int = 32
    # Longest over shortest edge. Image processors resize the shortest edge up to their size, so a 1-pixel-high
    # strip of a few hundred bytes grows by its width times that size squared (about 10 KB per pixel of width
    # at CLIP's 32, 49 times more at 224). 200 is the bound Qwen2-VL's own processor sets.
    max_aspect_ratio: float = 200.0
    # Decoded RGB bytes per byte sent, above ``expansion_free_pixels`` (a 4K screenshot). A JPEG photo expands
    # about 10 times, a PNG photo 2; a 1-bit PNG of 7071x7071 is 6 KB and expands 24000 times.
    max_expansion: int = 512
    expansion_free_pixels: int = 3840 * 2160
    # Bytes all decodes of these limits hold at once (``DecodeBudget``); None: ``DEFAULT_DECODE_BUDGET``, or one
    # image at ``max_pixels`` where that is more. A given value must hold that one image.
    decode_budget_bytes: int | None = None
    decode_budget: DecodeBudget = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        check_limits(self, ("max_pixels", "max_bytes", "max_images", "max_expansion", "expansion_free_pixels"))
        largest = self.max_pixels * DECODE_BYTES_PER_PIXEL
        budget = self.decode_budget_bytes
        if budget is not None and (not positive_int(budget) or budget < largest):
            raise InvalidRequest(f"decode_budget_bytes must be an int of at least max_pixels * "
                                 f"{DECODE_BYTES_PER_PIXEL} = {largest} (one image at the pixel limit), got {budget!r}")
        object.__setattr__(self, "decode_budget", DecodeBudget(budget or max(DEFAULT_DECODE_BUDGET, largest)))
        r = self.max_aspect_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 1 <= r < float("inf"):
            raise InvalidRequest(f"max_aspect_ratio must be a finite number of at least 1, got {r!r}")
        if not isinstance(self.formats, (tuple, list)) or not all(isinstance(f, str) for f in self.formats):
            raise InvalidRequest(f"formats must be a tuple of format names, got {self.formats!r}")
        object.__setattr__(self, "formats", tuple(self.formats))


def paths_allowed(limits) -> bool:
    """Whether ``limits`` (an ``ImageLimits`` or ``audio.AudioLimits``) lets a request name a local file."""
    return limits.allow_paths or limits.path_root is not None


def check_limits(limits, counts: tuple[str, ...]) -> None:
    """The checks every medium's limits share: the named counts are positive ints, ``allow_paths`` a bool and
    ``path_root`` a folder path or None."""
    for name in counts:
        if not positive_int(getattr(limits, name)):
            raise InvalidRequest(f"{name} must be a positive int, got {getattr(limits, name)!r}")
    if not isinstance(limits.allow_paths, bool):
        raise InvalidRequest(f"allow_paths must be a bool, got {limits.allow_paths!r}")
    if limits.path_root is not None and not isinstance(limits.path_root, (str, Path)):
        raise InvalidRequest(f"path_root must be a folder path or None, got {limits.path_root!r}")


@dataclass(frozen=True)
class MediaRef:
    """Which item of a request an error is about: its index among the request's items of its medium (image,
    audio) and its source kind."""

    index: int
    kind: str
    medium: str = "image"

    def __repr__(self) -> str:
        return f"{self.medium} #{self.index} ({self.kind})"


@dataclass(frozen=True)
class RawImage:
    """An image's encoded bytes exactly as sent, and where in the request it came from."""

    data: bytes
    ref: MediaRef


def read_image(source: object, index: int = 0, limits: ImageLimits = ImageLimits()) -> RawImage:
    """The bytes as sent of ``source`` (bytes-like, path, ``file://`` URL or data URL), without decoding them."""
    if isinstance(source, RawImage):
        return source
    return RawImage(*read_source(source, index, limits, "image"))


def read_source(source: object, index: int, limits, medium: str) -> tuple[bytes, MediaRef]:
    """The bytes as sent of a ``medium`` item (bytes-like, path, ``file://`` URL or data URL) and its
    ``MediaRef``, under ``limits`` (an ``ImageLimits`` or ``audio.AudioLimits``)."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        ref = MediaRef(index, SOURCE_BYTES, medium)
        try:
            size = source.nbytes if isinstance(source, memoryview) else len(source)
        except ValueError as e:  # a released memoryview
            raise MediaDecodeError(ref, f"the {medium} buffer cannot be read: {e}") from None
        if size > limits.max_bytes:  # before the copy
            raise MediaDecodeError(ref, f"{size} bytes exceed the limit of {limits.max_bytes}")
        return bytes(source), ref
    if isinstance(source, str) and source[:5].lower() == "data:":
        ref = MediaRef(index, SOURCE_DATA_URL, medium)
        return data_url_payload(source, ref, limits), ref
    if isinstance(source, (str, Path)):
        ref = MediaRef(index, SOURCE_PATH, medium)
        return read_path(source, ref, limits), ref
    raise MediaDecodeError(MediaRef(index, type(source).__name__, medium),
                           f"{medium} must be bytes, a file path or a data URL")


def data_url_payload(url: str, ref: MediaRef, limits) -> bytes:
    """The payload of an RFC 2397 data URL; base64 or percent-encoded; the media type, if given, must be of the
    item's medium (``image/*``, ``audio/*``). ``limits``: an ``ImageLimits`` or ``audio.AudioLimits``."""
    comma = url.find(",")
    if comma < 0:
        raise MediaDecodeError(ref, "data URL has no ',' before its payload")
    params = [p.strip() for p in url[5:comma].split(";")]
    mime = params[0].lower() if params and "/" in params[0] else ""
    if mime and not mime.startswith(ref.medium + "/"):
        raise MediaDecodeError(ref, f"data URL media type {mime!r} is not an {ref.medium} type")
    payload = url[comma + 1:]
    if params[-1].lower() == "base64":
        payload = re.sub(r"\s+", "", payload)
        if len(payload) // 4 * 3 > limits.max_bytes:
            raise MediaDecodeError(ref, f"data URL payload exceeds the limit of {limits.max_bytes} bytes")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise MediaDecodeError(ref, f"data URL payload is not valid base64: {e}") from None
    else:
        try:
            data = urllib.parse.unquote_to_bytes(payload)
        except UnicodeError:  # a lone surrogate (JSON can carry one)
            raise MediaDecodeError(ref, "data URL payload is not valid text") from None
        if len(data) > limits.max_bytes:
            raise MediaDecodeError(ref, f"data URL payload exceeds the limit of {limits.max_bytes} bytes")
    if not data:
        raise MediaDecodeError(ref, "data URL payload is empty")
    return data


_PATHS_OFF = "file paths are not accepted here; send the {medium} bytes or a data URL"
_ROOTED_REFUSAL = "no readable {medium} file at this path inside the folder media may be read from"


def read_path(source: str | Path, ref: MediaRef, limits) -> bytes:
    """The bytes of a local file named by a path or ``file://`` URL, under ``limits`` (``max_bytes``,
    ``allow_paths``, ``path_root``: an ``ImageLimits`` or ``audio.AudioLimits``). With paths off nothing on
    the filesystem is looked at; under ``path_root`` every refusal has one message (module docstring)."""
    text = str(source)
    if text.lower().startswith("file://"):
        try:
            url = urllib.parse.urlparse(text)
        except ValueError as e:  # "file://[abc/x" (an unclosed IPv6 host)
            raise MediaDecodeError(ref, f"not a valid file URL: {e}") from None
        if url.netloc not in ("", "localhost"):
            raise MediaDecodeError(ref, f"file URL names host {url.netloc!r}; only local files are read")
        text = urllib.parse.unquote(url.path)
    elif _URL_SCHEME.match(text):
        raise MediaDecodeError(ref, f"remote URLs are not fetched; send the {ref.medium} bytes or a data URL")
    if not paths_allowed(limits):
        raise MediaDecodeError(ref, _PATHS_OFF.format(medium=ref.medium))
    if limits.path_root is None:
        return _read_file(Path(text), ref, limits)
    inside = _inside_root(text, limits.path_root)
    try:
        if inside is None:
            raise MediaDecodeError(ref, "outside the folder")
        return _read_file(inside, ref, limits)
    except MediaDecodeError:
        raise MediaDecodeError(ref, _ROOTED_REFUSAL.format(medium=ref.medium)) from None


def _inside_root(text: str, root: str | Path) -> Path | None:
    """``text`` resolved (symlinks followed) when it lies inside ``root``, else None."""
    try:
        resolved = Path(text).resolve()
        return resolved if resolved.is_relative_to(Path(root).resolve()) else None
    except (OSError, ValueError, RuntimeError):  # the errors _read_file names
        return None


def _read_file(path: Path, ref: MediaRef, limits) -> bytes:
    """The bytes of the regular file ``path``, at most ``limits.max_bytes``; ``MediaDecodeError`` saying why not."""
    try:
        info = path.stat()
        # Devices and pipes report no size and never end (/dev/zero would be read until memory runs out; a
        # FIFO would block the caller): only regular files are read.
        if not stat.S_ISREG(info.st_mode):
            raise MediaDecodeError(ref, f"{path.name!r} is not a regular file")
        if info.st_size > limits.max_bytes:
            raise MediaDecodeError(ref, f"file of {info.st_size} bytes exceeds the limit of {limits.max_bytes}")
        with path.open("rb") as f:
            data = f.read(limits.max_bytes + 1)  # bounded: the file may have grown since the stat
        if len(data) > limits.max_bytes:
            raise MediaDecodeError(ref, f"file grew past the limit of {limits.max_bytes} bytes while read")
        return data
    except MediaDecodeError:
        raise
    except (OSError, ValueError, RuntimeError) as e:  # ValueError: a NUL byte or a lone surrogate in the path;
        # RuntimeError: a symlink loop met by resolve() (Python < 3.13)
        raise MediaDecodeError(ref, f"cannot read file {path.name!r}: {getattr(e, 'strerror', None) or e}") from None


# ``warnings.catch_warnings`` swaps the process's filter list and puts it back on exit; two threads inside it at
# once could leave one's list installed for good, so header parses that use it take turns (a header parse reads a
# few hundred bytes; pixel decoding runs outside the lock). Python also marks every warnings registry stale on
# entry and exit: a once-shown warning elsewhere may show again, but no registry grows.
_HEADER_LOCK = threading.Lock()


def _header(raw: RawImage, limits: ImageLimits) -> Image.Image:
    """``raw`` opened (header parsed, no pixel decoded) and checked against ``limits``: format, size, pixel count
    and aspect ratio; the caller closes it. ``MediaDecodeError`` naming ``raw.ref`` otherwise."""
    if not raw.data:
        raise MediaDecodeError(raw.ref, "image bytes are empty")
    try:
        with _HEADER_LOCK, warnings.catch_warnings():
            # max_pixels is the limit, checked below; Pillow's warning would only leave a registry entry behind
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(raw.data), formats=list(limits.formats))  # reads the header only
    except Image.UnidentifiedImageError:
        raise MediaDecodeError(raw.ref, f"not an image in an accepted format ({', '.join(limits.formats)})") from None
    except Image.DecompressionBombError as e:
        raise MediaDecodeError(raw.ref, f"too many pixels (refused before decoding): {e}") from None
    except _DECODE_FAILURES as e:
        raise MediaDecodeError(raw.ref, f"unreadable image header: {e}") from None
    try:
        _check_size(raw.ref, image.size, limits)
        _check_expansion(raw, image.size, limits)
    except BaseException:
        image.close()
        raise
    return image


def _check_size(ref: MediaRef, size: tuple[int, int], limits: ImageLimits) -> None:
    width, height = size
    if width <= 0 or height <= 0:
        raise MediaDecodeError(ref, f"image has an empty size {width}x{height}")
    if width * height > limits.max_pixels:
        raise MediaDecodeError(ref, f"{width}x{height} = {width * height} pixels exceed the limit of "
                                    f"{limits.max_pixels} (refused before decoding)")
    if max(width, height) > limits.max_aspect_ratio * min(width, height):
        raise MediaDecodeError(ref, f"{width}x{height}: the long edge is more than {limits.max_aspect_ratio:g} "
                                    f"times the short one (max_aspect_ratio; refused before decoding)")


def _check_expansion(raw: RawImage, size: tuple[int, int], limits: ImageLimits) -> None:
    """Refuses an image above ``expansion_free_pixels`` whose decoded RGB exceeds ``max_expansion`` times its
    bytes as sent; worded with "exceed" as every size limit is (the server answers 413)."""
    pixels = size[0] * size[1]
    if pixels <= limits.expansion_free_pixels:
        return
    expansion = pixels * 3 / len(raw.data)
    if expansion > limits.max_expansion:
        raise MediaDecodeError(raw.ref, f"{size[0]}x{size[1]} decodes to {pixels * 3} bytes of RGB from "
                                        f"{len(raw.data)} bytes sent: {math.ceil(expansion)} times exceeds the limit "
                                        f"of {limits.max_expansion} (max_expansion; refused before decoding)")


def image_size(raw: RawImage, limits: ImageLimits = ImageLimits()) -> tuple[int, int]:
    """``(width, height)`` of ``raw`` from its header, checked as ``decode_image`` checks it, without decoding a
    pixel: what a prompt's placeholder count is computed from before any image is encoded. The upright size
    (EXIF orientation applied) may swap the two."""
    with _header(raw, limits) as image:
        return image.size


def decode_image(raw: RawImage, limits: ImageLimits = ImageLimits()) -> Image.Image:
    """Fully decoded RGB pixels of ``raw``, or ``MediaDecodeError`` naming ``raw.ref``; the decode budget is held
    while decoding only."""
    with decoding(raw, limits) as pixels:
        return pixels


@contextmanager
def decoding(raw: RawImage, limits: ImageLimits = ImageLimits()):
    """``decode_image`` for a ``with`` block: the decode's bytes of ``limits.decode_budget`` stay reserved until the
    block ends, so that what the caller does with the full-size pixels (a processor's resize) is counted too."""
    with _header(raw, limits) as image:
        width, height = image.size
        with limits.decode_budget.reserve(width * height * DECODE_BYTES_PER_PIXEL):
            pixels = _decoded(raw.ref, image)
            image.close()  # the frame's pixels are not needed beside the RGB ones during the block
            yield pixels


def _decoded(ref: MediaRef, image: Image.Image) -> Image.Image:
    fmt = image.format
    try:
        image.load()
        upright = ImageOps.exif_transpose(image)
        return _to_rgb(upright)
    except _DECODE_FAILURES as e:
        raise MediaDecodeError(ref, f"corrupt or truncated {fmt} data: {e}") from None


def _to_rgb(image: Image.Image) -> Image.Image:
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")
