"""Safe defaults for media from the network: no local paths unless opted in, one message for every refused path,
a cap on images per request and the expanded length checked before any image is encoded, and a bounded warnings
registry under any stream of image headers."""

import builtins
import io
import os
import struct
from pathlib import Path

import pytest
from PIL import Image

import encoders.media as media
from encoders.audio import AudioLimits, read_audio
from encoders.media import ImageLimits, RawImage, decode_image, image_size, read_image
from mmcache.engine import Engine, EngineConfig, SamplingParams
from mmcache.hosts.vlm import VLMEngine, VLMRequest
from mmcache.presets.vlm import build_vlm
from mmcache.errors import InvalidRequest, MediaDecodeError
from mmcache.store import EncoderOutputStore

GREEDY = SamplingParams(max_tokens=2, temperature=0.0)


def png_of(width: int, height: int, shade: int = 0) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (shade, 255 - shade, 40)).save(buf, format="PNG")
    return buf.getvalue()


def bmp_header(width: int, height: int) -> bytes:
    """A 24-bit BMP whose header claims ``width x height`` pixels and holds none of them."""
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 24, 0, 0, 2835, 2835, 0, 0)
    return b"BM" + struct.pack("<IHHI", 14 + len(info), 0, 0, 14 + len(info)) + info


# ---- paths -------------------------------------------------------------------------------------------

def test_paths_are_refused_by_default_without_touching_the_filesystem(tmp_path, monkeypatch):
    image = tmp_path / "cat.png"
    image.write_bytes(png_of(4, 4))
    touched = []

    def spy(name, real):
        def call(*args, **kwargs):
            touched.append((name, args[:1]))
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(os, "stat", spy("stat", os.stat))
    monkeypatch.setattr(builtins, "open", spy("open", builtins.open))
    monkeypatch.setattr(io, "open", spy("io.open", io.open))  # what Path.open calls
    monkeypatch.setattr(Path, "resolve", spy("resolve", Path.resolve))
    sources = ["/etc/passwd", "file:///etc/passwd", "/proc/self/environ", str(tmp_path / "absent.png"),
               str(tmp_path), str(image), image, image.as_uri()]
    for reader, limits in ((read_image, ImageLimits()), (read_audio, AudioLimits())):
        messages = set()
        for source in sources:
            with pytest.raises(MediaDecodeError) as e:
                reader(source, 0, limits)
            messages.add(e.value.reason)
        assert len(messages) == 1 and "file paths are not accepted" in messages.pop()
    assert touched == []


def test_under_a_path_root_every_refused_path_reads_the_same(tmp_path):
    root = tmp_path / "media"
    root.mkdir()
    (root / "cat.png").write_bytes(png_of(4, 4))
    (root / "big.png").write_bytes(b"\0" * 5000)
    (root / "folder").mkdir()
    (root / "escape.png").symlink_to("/etc/passwd")
    secret = root / "secret.png"
    secret.write_bytes(png_of(4, 4))
    secret.chmod(0)
    outside = tmp_path / "outside.png"
    outside.write_bytes(png_of(4, 4))
    limits = ImageLimits(path_root=root, max_bytes=4000)
    assert read_image(root / "cat.png", limits=limits).data == (root / "cat.png").read_bytes()
    refused = [root / "absent.png", root / "big.png", root / "folder", root / "escape.png", outside,
               root / ".." / "outside.png", "/etc/passwd", f"file://{root}/absent.png", str(root / "a\x00b")]
    if os.geteuid() != 0:  # root reads a file of mode 000
        refused.append(secret)
    messages = set()
    for source in refused:
        with pytest.raises(MediaDecodeError) as e:
            read_image(source, limits=limits)
        messages.add(e.value.reason)
    assert messages == {"no readable image file at this path inside the folder media may be read from"}
    audio = AudioLimits(path_root=root)
    for source in (root / "absent.wav", outside):
        with pytest.raises(MediaDecodeError, match="no readable audio file at this path inside the folder"):
            read_audio(source, limits=audio)


def test_a_trusted_caller_opts_in_and_is_told_why(tmp_path):
    image = tmp_path / "cat.png"
    image.write_bytes(png_of(4, 4))
    assert read_image(image, limits=ImageLimits(allow_paths=True)).data == image.read_bytes()
    with pytest.raises(MediaDecodeError, match="cannot read file 'absent.png'"):
        read_image(tmp_path / "absent.png", limits=ImageLimits(allow_paths=True))
    with pytest.raises(InvalidRequest, match="max_images"):
        ImageLimits(max_images=0)


# ---- Pillow's warnings registry ----------------------------------------------------------------------

def test_distinct_oversized_headers_leave_the_warnings_registry_as_it_was():
    # Pillow warns (DecompressionBombWarning) above its own limit of about 89 megapixels; each distinct
    # size is a new message, and the default action keeps one registry entry per message for good.
    limits = ImageLimits(max_pixels=10**9)  # our limit above Pillow's: every header below reaches Pillow's check
    decode_image(RawImage(png_of(2, 2), media.MediaRef(0, "bytes")), limits)  # the registry in its steady state
    registry = vars(Image).setdefault("__warningregistry__", {})
    before = len(registry)
    for i in range(300):
        raw = RawImage(bmp_header(10_000 + i, 9_000), media.MediaRef(i, "bytes"))
        with pytest.raises(MediaDecodeError):  # no pixel data: the decode fails after the header
            decode_image(raw, limits)
        assert image_size(raw, limits) == (10_000 + i, 9_000)
    assert len(registry) <= before + 1  # at most the registry's own "version" key
    assert not [k for k in registry if isinstance(k, tuple) and k[1] is Image.DecompressionBombWarning]


def test_the_pixel_limit_is_ours_not_pillows():
    raw = RawImage(bmp_header(10_000, 9_500), media.MediaRef(0, "bytes"))
    with pytest.raises(MediaDecodeError, match="exceed the limit of 50000000"):
        image_size(raw)
    assert image_size(raw, ImageLimits(max_pixels=10**8)) == (10_000, 9_500)


# ---- images per request and the expanded length, before any encode --------------------------------

@pytest.fixture(scope="module")
def presets() -> dict:
    return {name: build_vlm(name) for name in ("tiny-llava", "tiny-qwen2-vl")}


def make_front(preset, max_model_len=4096, store_bytes=1 << 24, limits=ImageLimits()) -> VLMEngine:
    config = EngineConfig(page_size=16, num_pages=512, max_model_len=max_model_len)
    return VLMEngine(Engine(preset.model, None, config),
                     preset.prompt_builder(EncoderOutputStore(store_bytes), limits))


def chat_with(images: list, text: str = "What is here?") -> list:
    parts = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2-vl"])
def test_the_placeholder_count_from_the_header_is_the_towers(presets, name):
    builder = presets[name].prompt_builder(EncoderOutputStore(1 << 24))
    for size in ((32, 32), (451, 300), (30, 120), (200, 57), (57, 200), (640, 16)):
        raw = read_image(png_of(*size))
        encoded = builder.adapter.encode(raw)
        assert builder.placeholder_count(raw) == encoded.num_placeholders, size
        encoded.release()


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2-vl"])
def test_refused_requests_run_no_tower_and_leave_the_store_as_it_was(presets, name, tower_calls):
    vlm = make_front(presets[name], max_model_len=160)
    calls = tower_calls(vlm)
    kept = png_of(64, 64, 200)
    served = vlm.generate([VLMRequest(chat_with([kept]), sampling=GREEDY)])[0]
    assert served.error is None and len(calls) == 1
    store_before, metrics_before = len(vlm.store), vlm.store.metrics.as_dict()
    many = [png_of(8 + i, 8, i) for i in range(33)]  # over the default cap of 32
    long_chat = chat_with([png_of(112, 112, i) for i in range(12)])  # 16 placeholders each: > 160 tokens
    ids_request = VLMRequest(token_ids=[1, 2] + [vlm.builder.template.image_token_id, 3] * 12,
                             images=[png_of(112, 112, 50 + i) for i in range(12)], sampling=GREEDY)
    wrong_run = VLMRequest(token_ids=[1, 2] + [vlm.builder.template.image_token_id] * 3 + [3],
                           images=[png_of(112, 112, 99)], sampling=GREEDY)
    refused = vlm.generate([VLMRequest(chat_with(many), sampling=GREEDY), VLMRequest(long_chat, sampling=GREEDY),
                            ids_request, wrong_run])
    assert [type(o.error) for o in refused] == [InvalidRequest] * 4
    assert "max_images" in str(refused[0].error) and "a run of 3 image tokens" in str(refused[3].error)
    assert all("refused before any image was encoded" in str(o.error) for o in refused[1:3])
    assert len(calls) == 1
    assert len(vlm.store) == store_before and vlm.store.metrics.as_dict() == metrics_before
    vlm.check_invariants()
    again = vlm.generate([VLMRequest(chat_with([kept]), sampling=GREEDY)])[0]  # still a store hit
    assert again.output_ids == served.output_ids and len(calls) == 1


def test_the_bound_is_what_intake_accepts(presets):
    vlm = make_front(presets["tiny-llava"], max_model_len=64)
    tok = vlm.builder.template.image_token_id
    limit = vlm.max_prompt_tokens(GREEDY)
    assert limit == 63
    image = png_of(40, 40)
    fits = VLMRequest(token_ids=[1] * (limit - 16) + [tok], images=[image], sampling=GREEDY)
    over = VLMRequest(token_ids=[1] * (limit - 15) + [tok], images=[image], sampling=GREEDY)
    outs = vlm.generate([fits, over])
    assert outs[0].error is None and outs[0].prompt_len == limit
    assert isinstance(outs[1].error, InvalidRequest)
    bad_sampling = VLMRequest(chat_with([image]), sampling=SamplingParams(max_tokens=0))
    assert isinstance(vlm.generate([bad_sampling])[0].error, InvalidRequest)
    vlm.check_invariants()
