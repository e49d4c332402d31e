"""Image sources, the guarded decode and media digests (encoders/media.py), on real image files."""

import base64
import io
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from PIL import Image

from encoders.media import (DECODE_PARAMS, ImageLimits, MediaRef, RawImage, decode_image, read_image,
                            SOURCE_BYTES, SOURCE_DATA_URL, SOURCE_PATH)
from mmcache.errors import InvalidRequest, MediaDecodeError
from mmcache.names import media_digest


@pytest.fixture(scope="module")
def png(datasets_dir) -> bytes:
    return (datasets_dir / "images" / "chelsea.png").read_bytes()


@pytest.fixture(scope="module")
def jpg(datasets_dir) -> bytes:
    return (datasets_dir / "images" / "extreme_ironing.jpg").read_bytes()


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_with_header(width: int, height: int) -> bytes:
    """A well-formed PNG whose header claims ``width x height`` RGB pixels, with almost no pixel data."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + _chunk(b"IEND", b""))


TRUSTED = ImageLimits(allow_paths=True)  # a library caller that reads its own files


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def test_every_source_kind_yields_the_bytes_as_sent(png, tmp_path):
    path = tmp_path / "cat.png"
    path.write_bytes(png)
    sources = {SOURCE_BYTES: png, SOURCE_PATH: str(path), SOURCE_DATA_URL: data_url(png)}
    for kind, source in sources.items():
        raw = read_image(source, index=3, limits=TRUSTED)
        assert raw.data == png and raw.ref == MediaRef(3, kind)
    assert read_image(path, limits=TRUSTED).data == png
    assert read_image(path.as_uri(), limits=TRUSTED).data == png  # file:// URL
    assert read_image(bytearray(png)).data == png
    percent = "data:image/png," + "".join(f"%{b:02x}" for b in png[:300])
    assert read_image(percent).data == png[:300]
    b64 = base64.b64encode(png[:600]).decode()
    spaced = "data:image/png;base64," + "\n".join(b64[i:i + 76] for i in range(0, len(b64), 76))
    assert read_image(spaced).data == png[:600]


@pytest.mark.parametrize("url, reason", [
    ("data:text/plain;base64,aGVsbG8=", "not an image"),
    ("data:image/png;base64,@@@notbase64", "not valid base64"),
    ("data:image/png;base64", "no ','"),
    ("data:image/png;base64,", "empty"),
    ("https://example.com/cat.png", "remote URLs are not fetched"),
])
def test_bad_sources_raise_media_decode_error(url, reason):
    with pytest.raises(MediaDecodeError, match=reason) as e:
        read_image(url, index=2)
    assert e.value.item.index == 2


def test_unsupported_source_type():
    with pytest.raises(MediaDecodeError, match="bytes, a file path or a data URL") as e:
        read_image(12345, index=1)
    assert e.value.item == MediaRef(1, "int")


def test_missing_file_and_path_policy(png, tmp_path):
    with pytest.raises(MediaDecodeError, match="cannot read file") as e:
        read_image(tmp_path / "absent.png", index=4, limits=TRUSTED)
    assert e.value.item == MediaRef(4, SOURCE_PATH)
    inside = tmp_path / "ok" / "cat.png"
    inside.parent.mkdir()
    inside.write_bytes(png)
    outside = tmp_path / "cat.png"
    outside.write_bytes(png)
    rooted = ImageLimits(path_root=inside.parent)
    assert read_image(inside, limits=rooted).data == png
    with pytest.raises(MediaDecodeError, match="no readable image file at this path inside the folder"):
        read_image(outside, limits=rooted)
    with pytest.raises(MediaDecodeError, match="no readable image file at this path inside the folder"):
        read_image(str(inside.parent / ".." / "cat.png"), limits=rooted)
    with pytest.raises(MediaDecodeError, match="not accepted"):
        read_image(inside, limits=ImageLimits(allow_paths=False))
    for odd in (str(tmp_path / "a\x00b.png"), str(tmp_path / "\ud800.png")):  # ValueErrors, not OSErrors
        with pytest.raises(MediaDecodeError, match="cannot read file"):
            read_image(odd, limits=TRUSTED)


_READ_CAPPED = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
from encoders.media import ImageLimits, read_image
try:
    read_image(sys.argv[1], limits=ImageLimits(allow_paths=True))
except Exception as e:
    print(type(e).__name__, e)
"""


@pytest.mark.parametrize("setting", [{"max_pixels": 0}, {"max_bytes": "1 MiB"}, {"max_pixels": True},
                                     {"max_bytes": 1.5}, {"formats": "PNG"}, {"formats": None}, {"formats": (1,)},
                                     {"allow_paths": "no"}, {"path_root": 5}, {"max_aspect_ratio": 0.5},
                                     {"max_aspect_ratio": float("inf")}, {"max_aspect_ratio": "200"}])
def test_image_limits_refuse_bad_settings_with_a_typed_error(setting):
    # A string limit used to fail comparing with 0 (TypeError), a float or bool passed, a bad formats value
    # surfaced only when an image was decoded.
    with pytest.raises(InvalidRequest, match=next(iter(setting))):
        ImageLimits(**setting)
    assert ImageLimits(formats=["PNG"]).formats == ("PNG",)


def test_only_regular_files_are_read(tmp_path):
    # /dev/zero reports size 0 and never ends: it used to be read until memory ran out; a FIFO blocked its
    # reader forever. Each is tried in a child process with 1 GiB of address space and a timeout, so that a
    # regression fails this test instead of taking the machine's memory or hanging the run.
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    root = Path(__file__).resolve().parents[1]
    for source in ("/dev/zero", f"file://{fifo}"):
        run = subprocess.run([sys.executable, "-c", _READ_CAPPED, source], capture_output=True, text=True,
                             timeout=60, cwd=root)
        assert run.stdout.startswith("MediaDecodeError") and "not a regular file" in run.stdout, (source, run)
    with pytest.raises(MediaDecodeError, match="not a regular file"):
        read_image(tmp_path, limits=TRUSTED)


def test_a_file_that_grows_past_the_limit_after_its_size_was_read_is_refused(png, tmp_path, monkeypatch):
    path = tmp_path / "cat.png"
    path.write_bytes(png[:500])
    real_stat = type(path).stat

    def stat_then_grow(self, *args, **kwargs):
        info = real_stat(self, *args, **kwargs)
        if self == path:
            path.write_bytes(png)  # written between the size check and the read
        return info

    monkeypatch.setattr(type(path), "stat", stat_then_grow)
    with pytest.raises(MediaDecodeError, match="grew past the limit of 1000"):
        read_image(path, limits=ImageLimits(max_bytes=1000, allow_paths=True))


def test_byte_limits_apply_before_decoding(png, tmp_path):
    small = ImageLimits(max_bytes=1000, allow_paths=True)
    path = tmp_path / "cat.png"
    path.write_bytes(png)
    for source in (png, data_url(png), path):
        with pytest.raises(MediaDecodeError, match="limit of 1000"):
            read_image(source, limits=small)


def _corrupt_cases(png: bytes, jpg: bytes) -> dict:
    return {
        "truncated png": png[: len(png) // 2],
        "truncated jpeg": jpg[: len(jpg) // 2],
        "png header only": png[:60],
        "jpeg header only": jpg[:600],
        "random bytes": os.urandom(4096),
        "empty": b"",
        "huge header (Pillow's bomb limit)": png_with_header(100_000, 100_000),
        "huge header (our limit)": png_with_header(9000, 9000),
    }


@pytest.mark.parametrize("case", list(_corrupt_cases(b"x", b"x")))
def test_corrupt_bytes_raise_media_decode_error(case, png, jpg):
    data = _corrupt_cases(png, jpg)[case]
    ref = MediaRef(7, SOURCE_BYTES)
    with pytest.raises(MediaDecodeError) as e:
        decode_image(RawImage(data, ref))
    assert e.value.item is ref
    assert "image #7 (bytes)" in str(e.value)


def test_pixel_limit_is_checked_from_the_header(png):
    with pytest.raises(MediaDecodeError, match="refused before decoding"):
        decode_image(RawImage(png_with_header(9000, 9000), MediaRef(0, SOURCE_BYTES)))
    with pytest.raises(MediaDecodeError, match=r"451x300 = 135300 pixels exceed the limit of 135299"):
        decode_image(RawImage(png, MediaRef(0, SOURCE_BYTES)), ImageLimits(max_pixels=135299))
    assert decode_image(RawImage(png, MediaRef(0, SOURCE_BYTES)), ImageLimits(max_pixels=135300)).size == (451, 300)


def test_aspect_ratio_is_checked_from_the_header():
    # A 1-pixel-high strip of a few hundred bytes passed the pixel limit; LLaVA's processor then resized its
    # short edge up to 32 and worked on 32x32 times its width: about 4 GB for 1x400000, a MemoryError or the
    # process killed.
    for width, height in ((400_000, 1), (1, 201), (2010, 10)):
        with pytest.raises(MediaDecodeError, match="more than 200 times the short one"):
            decode_image(RawImage(png_with_header(width, height), MediaRef(0, SOURCE_BYTES)))
    strip = io.BytesIO()
    Image.new("RGB", (200, 1), "white").save(strip, format="PNG")
    assert decode_image(RawImage(strip.getvalue(), MediaRef(0, SOURCE_BYTES))).size == (200, 1)
    with pytest.raises(MediaDecodeError, match="more than 100 times"):
        decode_image(RawImage(strip.getvalue(), MediaRef(0, SOURCE_BYTES)), ImageLimits(max_aspect_ratio=100))


def test_formats_outside_the_accepted_list_are_refused(png):
    tiff = io.BytesIO()
    Image.open(io.BytesIO(png)).save(tiff, format="TIFF")
    with pytest.raises(MediaDecodeError, match="accepted format"):
        decode_image(RawImage(tiff.getvalue(), MediaRef(0, SOURCE_BYTES)))
    accepted = decode_image(RawImage(tiff.getvalue(), MediaRef(0, SOURCE_BYTES)), ImageLimits(formats=("TIFF",)))
    assert accepted.size == (451, 300)


def _encode(image: Image.Image, fmt: str, **kw) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **kw)
    return out.getvalue()


def test_decode_gives_upright_opaque_rgb(png, jpg):
    rgb = decode_image(RawImage(png, MediaRef(0, SOURCE_BYTES)))
    assert rgb.mode == "RGB" and rgb.size == (451, 300)
    assert decode_image(RawImage(jpg, MediaRef(0, SOURCE_BYTES))).size == (570, 380)

    rgba = Image.new("RGBA", (4, 2), (10, 20, 30, 255))
    rgba.putpixel((0, 0), (200, 0, 0, 0))  # fully transparent: composited on white
    out = decode_image(RawImage(_encode(rgba, "PNG"), MediaRef(0, SOURCE_BYTES)))
    assert out.getpixel((0, 0)) == (255, 255, 255) and out.getpixel((1, 0)) == (10, 20, 30)

    gray = decode_image(RawImage(_encode(Image.new("L", (3, 3), 77), "PNG"), MediaRef(0, SOURCE_BYTES)))
    assert gray.mode == "RGB" and gray.getpixel((1, 1)) == (77, 77, 77)

    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    rotated = _encode(Image.new("RGB", (40, 20), (0, 128, 0)), "JPEG", exif=exif.tobytes())
    assert decode_image(RawImage(rotated, MediaRef(0, SOURCE_BYTES))).size == (20, 40)


def test_digest_covers_bytes_as_sent_and_every_parameter(png):
    params = {"size": 32, "image_mean": [0.5, 0.5, 0.5], **DECODE_PARAMS}
    same_pixels = _encode(Image.open(io.BytesIO(png)), "PNG", compress_level=1)
    assert same_pixels != png
    assert decode_image(RawImage(same_pixels, MediaRef(0, SOURCE_BYTES))).tobytes() == \
        decode_image(RawImage(png, MediaRef(0, SOURCE_BYTES))).tobytes()
    base = media_digest(png, params)
    assert len(base) == 32  # BLAKE2b-256 (names.media_digest)
    assert media_digest(read_image(data_url(png)).data, params) == base
    assert media_digest(same_pixels, params) != base  # bytes as sent, not pixels
    assert media_digest(png, {**params, "size": 33}) != base
    assert media_digest(png, {**params, "image_mean": [0.5, 0.5, 0.4]}) != base
    assert media_digest(png, dict(reversed(list(params.items())))) == base


def test_an_unparsable_file_url_and_a_released_buffer_are_media_errors(png):
    for url in ("file://[abc/cat.png", "file://[::1/cat.png"):  # ValueError (Invalid IPv6 URL) before
        with pytest.raises(MediaDecodeError, match="not a valid file URL"):
            read_image(url)
    view = memoryview(bytearray(png))
    view.release()
    with pytest.raises(MediaDecodeError, match="cannot be read"):  # ValueError before
        read_image(view)
    wide = memoryview(bytearray(png[:400])).cast("I")  # 100 items of 4 bytes: the limit counts bytes
    assert read_image(wide).data == png[:400]
    for source in (wide, png[:400], bytearray(png[:400])):  # the limit's own message, not wrapped in another
        with pytest.raises(MediaDecodeError) as e:
            read_image(source, limits=ImageLimits(max_bytes=399))
        message = str(e.value)
        assert message.endswith("(bytes): 400 bytes exceed the limit of 399") and "cannot be read" not in message
