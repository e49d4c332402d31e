"""Safe defaults for media from the network: no local paths unless opted in, one message for every refused path,
a cap on images per request and the expanded length checked before any image is encoded, a bounded warnings
registry under any stream of image headers, decompression bombs refused before decoding and a decode budget that
concurrent decodes never overrun."""

import builtins
import io
import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
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
from mmcache.server.errors import beyond_limits
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
    # our limits above Pillow's: every header below (no pixel data) reaches Pillow's check
    limits = ImageLimits(max_pixels=10**9, max_expansion=10**9)
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
    assert image_size(raw, ImageLimits(max_pixels=10**8, max_expansion=10**8)) == (10_000, 9_500)


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


# ---- decompression bombs: the expansion bound, the decode budget ---------------------------------------

def one_bit_png(width: int, height: int, dot: int = 0) -> bytes:
    """A 1-bit PNG of ``width x height`` pixels: all black but one white pixel at (dot, 0); a few KB on the wire."""
    image = Image.new("1", (width, height), 0)
    image.putpixel((dot, 0), 1)
    buf = io.BytesIO()
    image.save(buf, format="PNG", optimize=True)
    return buf.getvalue()


@pytest.fixture(scope="module")
def bomb() -> bytes:
    """The finding's bomb: 7071x7071 (under the 50M pixel limit) in about 6 KB; it cost 2 s of CPU and 730 MB."""
    return one_bit_png(7071, 7071)


def count_loads(monkeypatch) -> list:
    loads = []
    real = Image.Image.load
    monkeypatch.setattr(Image.Image, "load", lambda self: loads.append(self.size) or real(self))
    return loads


def test_a_bomb_under_the_pixel_limit_is_refused_before_any_pixel_is_decoded(bomb, monkeypatch):
    loads = count_loads(monkeypatch)
    raw = RawImage(bomb, media.MediaRef(3, "data_url"))
    limits = ImageLimits()
    assert len(bomb) < 10_000 and 7071 * 7071 < limits.max_pixels
    for attempt in (image_size, decode_image):
        with pytest.raises(MediaDecodeError) as e:
            attempt(raw, limits)
        assert e.value.item is raw.ref and "max_expansion" in e.value.reason
        assert "refused before decoding" in e.value.reason
    assert beyond_limits(e.value)  # the server's 413, as for the pixel limit
    assert loads == [] and limits.decode_budget.reserved == 0


def test_the_expansion_bound_counts_rgb_bytes_over_bytes_sent_above_the_floor():
    flat = one_bit_png(300, 200)
    expansion = 300 * 200 * 3 / len(flat)
    ref = media.MediaRef(0, "bytes")
    small_floor = dict(expansion_free_pixels=100 * 100)
    assert decode_image(RawImage(flat, ref), ImageLimits(max_expansion=int(expansion) + 1, **small_floor))
    with pytest.raises(MediaDecodeError, match=f"exceeds the limit of {int(expansion) - 1} "):
        decode_image(RawImage(flat, ref), ImageLimits(max_expansion=int(expansion) - 1, **small_floor))
    # at or below the floor any image passes, however flat
    assert decode_image(RawImage(flat, ref), ImageLimits(max_expansion=1, expansion_free_pixels=300 * 200))
    screenshot = one_bit_png(1920, 1080)  # a blank full-HD screen: a few KB, far above 512 times
    assert 1920 * 1080 * 3 / len(screenshot) > 512
    assert decode_image(RawImage(screenshot, ref)).size == (1920, 1080)


def test_photos_pass_the_default_bounds(datasets_dir):
    for path in sorted((datasets_dir / "images").glob("*.[pj][np]g")):
        raw = read_image(path, limits=ImageLimits(allow_paths=True))
        assert decode_image(raw).mode == "RGB", path.name


@pytest.mark.parametrize("setting", [{"max_expansion": 0}, {"max_expansion": 2.5}, {"expansion_free_pixels": -1},
                                     {"decode_budget_bytes": 0}, {"decode_budget_bytes": "1 GiB"},
                                     {"decode_budget_bytes": 50_000_000 * media.DECODE_BYTES_PER_PIXEL - 1}])
def test_bomb_bounds_refuse_bad_settings(setting):
    with pytest.raises(InvalidRequest, match=next(iter(setting))):
        ImageLimits(**setting)


def test_the_decode_budget_holds_one_image_at_the_pixel_limit():
    assert ImageLimits().decode_budget.capacity == 50_000_000 * media.DECODE_BYTES_PER_PIXEL  # above 1 GiB
    assert ImageLimits(max_pixels=1000).decode_budget.capacity == media.DEFAULT_DECODE_BUDGET
    budget = ImageLimits(max_pixels=1000, decode_budget_bytes=32_000).decode_budget
    with pytest.raises(InvalidRequest, match="can never fit"):  # refused at once, never awaited
        with budget.reserve(32_001):
            pass
    assert budget.reserved == 0


def test_concurrent_decodes_never_reserve_more_than_the_budget():
    side = 64
    cost = side * side * media.DECODE_BYTES_PER_PIXEL
    limits = ImageLimits(max_pixels=side * side, decode_budget_bytes=2 * cost + cost // 2)  # two fit, not three
    budget = limits.decode_budget
    inside = threading.Lock()
    seen = {"holders": 0, "most_holders": 0, "most_reserved": 0}
    pair = threading.Barrier(2, timeout=60)  # two decodes hold the budget at once, or the test fails

    def decode(i: int) -> None:
        with media.decoding(RawImage(png_of(side, side, i), media.MediaRef(i, "bytes")), limits) as pixels:
            assert pixels.size == (side, side)
            with inside:
                seen["holders"] += 1
                seen["most_holders"] = max(seen["most_holders"], seen["holders"])
                seen["most_reserved"] = max(seen["most_reserved"], budget.reserved)
            pair.wait()
            with inside:
                seen["holders"] -= 1

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(decode, range(8)))
    assert seen["most_holders"] == 2 and seen["most_reserved"] == 2 * cost <= budget.capacity
    assert budget.reserved == 0 and budget.waiting == 0


def test_the_decode_budget_serves_in_order_of_arrival():
    # A large reservation is not passed over by smaller ones that would fit beside what is held.
    budget = media.DecodeBudget(10)
    order = []

    def take(name: str, nbytes: int) -> threading.Thread:
        def run():
            with budget.reserve(nbytes):
                order.append(name)
        thread = threading.Thread(target=run)
        thread.start()
        return thread

    def until(condition):
        for _ in range(10_000):
            if condition():
                return
            threading.Event().wait(0.001)
        raise AssertionError("the waiting thread never queued")

    with budget.reserve(6):
        large = take("large", 10)
        until(lambda: budget.waiting == 1)
        small = take("small", 2)
        until(lambda: budget.waiting == 2)
        assert budget.reserved == 6 and order == []
    large.join(60)
    small.join(60)
    assert order == ["large", "small"] and budget.reserved == 0 and budget.waiting == 0


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2-vl"])
def test_a_request_of_bombs_runs_no_tower_and_decodes_nothing(presets, name, tower_calls, monkeypatch):
    vlm = make_front(presets[name])
    calls = tower_calls(vlm)
    bombs = [one_bit_png(4500, 4500, dot) for dot in range(3)]  # 20 MP each, about 2.5 KB
    loads = count_loads(monkeypatch)
    out = vlm.generate([VLMRequest(chat_with(bombs), sampling=GREEDY)])[0]
    assert isinstance(out.error, MediaDecodeError) and "max_expansion" in str(out.error)
    assert calls == [] and loads == [] and len(vlm.store) == 0
    vlm.check_invariants()


# ---- the server's defaults ----------------------------------------------------------------------------

@pytest.mark.parametrize("name,tower", [("tiny-llava", 32 * 32), ("tiny-qwen2-vl", 112 * 112)])
def test_the_server_pixel_limit_follows_the_towers_processor(presets, name, tower):
    from mmcache.presets.serving import image_limits
    from mmcache.server.config import ServerConfig

    vlm = presets[name]
    assert vlm.adapter_class.tower_pixels(vlm.image_processor) == tower
    limits = image_limits(ServerConfig(preset=name), vlm)
    assert limits.max_pixels == media.PHOTO_PIXELS == 4096 * 4096  # these towers see far less than a photo
    assert limits.max_expansion == 512 and not limits.allow_paths
    assert limits.decode_budget.capacity == media.DEFAULT_DECODE_BUDGET
    given = image_limits(ServerConfig(preset=name, max_image_pixels=10**6, max_image_expansion=64,
                                      image_decode_bytes=10**9), vlm)
    assert (given.max_pixels, given.max_expansion, given.decode_budget.capacity) == (10**6, 64, 10**9)


def test_a_large_tower_raises_the_pixel_limit():
    from transformers import CLIPImageProcessorPil, Qwen2VLImageProcessorPil

    from encoders.vision import LlavaVisionAdapter, Qwen2VLVisionAdapter

    llava = CLIPImageProcessorPil(size={"shortest_edge": 336}, crop_size=336)  # llava-1.5's
    assert LlavaVisionAdapter.tower_pixels(llava) == 336 * 336
    assert media.photo_pixel_limit(336 * 336) == media.PHOTO_PIXELS
    qwen = Qwen2VLImageProcessorPil(max_pixels=12_845_056)  # Qwen2-VL-7B-Instruct's own setting
    assert media.photo_pixel_limit(Qwen2VLVisionAdapter.tower_pixels(qwen)) == 2 * 12_845_056
    assert media.photo_pixel_limit(None) == media.PHOTO_PIXELS


def test_server_image_options_are_checked_before_any_model_is_built():
    from mmcache.presets.serving import image_limits
    from mmcache.server.config import ServerConfig, ServerConfigError

    for bad in ({"max_image_pixels": 0}, {"max_image_expansion": 0}, {"image_decode_bytes": -1},
                {"max_image_pixels": 10**6, "image_decode_bytes": 10**6 * 32 - 1}):
        with pytest.raises(ServerConfigError, match=next(reversed(bad))):
            ServerConfig(preset="tiny-llava", **bad)
    with pytest.raises(ServerConfigError, match="decode_budget_bytes"):  # below one image at the derived limit
        image_limits(ServerConfig(preset="tiny-llava", image_decode_bytes=10**6), build_vlm("tiny-llava"))


def test_serve_options_reach_the_config():
    import argparse

    from mmcache.server import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--preset", "tiny-llava", "--max-image-pixels", "4000000",
                              "--max-image-expansion", "100", "--image-decode-bytes", "200000000"])
    config = cli.config_from_args(args)
    assert (config.max_image_pixels, config.max_image_expansion, config.image_decode_bytes) == (4_000_000, 100,
                                                                                                  200_000_000)
    default = cli.config_from_args(parser.parse_args(["serve", "--preset", "tiny-llava"]))
    assert (default.max_image_pixels, default.max_image_expansion, default.image_decode_bytes) == (None, 512, None)


def test_the_server_answers_a_bomb_413_without_decoding_it(monkeypatch):
    import httpx

    from mmcache.presets import serve
    from mmcache.server.config import ServerConfig
    from server_helpers import data_url, error_of, wait_quiet

    flat = one_bit_png(4000, 4000)  # 16 MP: under the derived pixel limit, 24000 times its bytes
    large = one_bit_png(4500, 4500)  # 20 MP: over it (the old default of 50M let it through)
    loads = count_loads(monkeypatch)
    with serve(ServerConfig(preset="tiny-llava", engine_config=EngineConfig(page_size=16))) as srv:
        assert srv.host.engine.builder.adapter.limits.max_pixels == 4096 * 4096
        for bomb, why in ((flat, "max_expansion"), (large, "exceed the limit of 16777216")):
            parts = [{"type": "image_url", "image_url": {"url": data_url(bomb)}}, {"type": "text", "text": "Here?"}]
            body = {"model": "tiny-llava", "max_tokens": 2, "messages": [{"role": "user", "content": parts}]}
            r = httpx.post(srv.base_url + "/chat/completions", json=body, timeout=60)
            assert r.status_code == 413 and error_of(r)["code"] == "request_too_large", r.text
            assert why in error_of(r)["message"]
        wait_quiet(srv.host)
        srv.host.engine.check_invariants()
    assert loads == []


def test_the_adapter_preprocesses_under_the_reservation_and_releases_it(presets, monkeypatch):
    limits = ImageLimits()
    adapter = presets["tiny-llava"].adapter(EncoderOutputStore(1 << 24), limits)
    processor_class = type(adapter.image_processor)
    seen = []
    real = processor_class.__call__
    monkeypatch.setattr(processor_class, "__call__",
                        lambda self, *a, **kw: seen.append(limits.decode_budget.reserved) or real(self, *a, **kw))
    adapter.encode(png_of(60, 40)).release()
    assert seen == [60 * 40 * media.DECODE_BYTES_PER_PIXEL] and limits.decode_budget.reserved == 0
    with pytest.raises(MediaDecodeError, match="corrupt or truncated"):  # a failed decode gives its bytes back
        adapter.encode(png_of(60, 40, 7)[:-30])
    assert limits.decode_budget.reserved == 0
