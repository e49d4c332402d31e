"""``mmcache serve`` over the tiny LLaVA preset with two API keys: chat with images (data URLs of the
repository's photos), the second turn's pages and image served from the caches, tenants (keys and cache
salts) that share no hit, and the image and key errors with their statuses and OpenAI error objects."""

import asyncio
import io

import httpx
import openai
import pytest
from PIL import Image

from mmcache.engine.config import EngineConfig
from mmcache.presets import serve
from mmcache.server import ServerConfig
from server_helpers import data_url, error_of, metric, scrape, wait_quiet

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "tiny-llava"
KEYS = ("key-alpha", "key-beta")
MAX_IMAGE_BYTES = 1 << 20
MAX_PIXELS = 400_000


@pytest.fixture(scope="module")
def server(one_thread):
    config = ServerConfig(preset=MODEL, api_keys=KEYS, engine_config=EngineConfig(page_size=16),
                          max_image_bytes=MAX_IMAGE_BYTES, max_image_pixels=MAX_PIXELS)
    with serve(config) as srv:
        yield srv
    srv.host.engine.check_invariants()


@pytest.fixture(scope="module")
def photos(datasets_dir):
    return {name: data_url((datasets_dir / "images" / f"{name}.png").read_bytes())
            for name in ("astronaut", "chelsea", "coffee")}


def _client(server, key=KEYS[0]):
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0)


def _ask(text: str, image: str) -> list:
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": image}}]}]


def _vision(server) -> tuple[float, float]:
    samples = scrape(server.url)
    return (metric(samples, "mmcache:encoder_cache_queries_total", kind="vision"),
            metric(samples, "mmcache:encoder_cache_hits_total", kind="vision"))


def _sound(server):
    wait_quiet(server.host)
    server.host.engine.check_invariants()  # pages, and store hold counts equal to live holders (none)
    assert metric(scrape(server.url), "mmcache:kv_pages_live") == 0


def test_chat_with_and_without_images(server, photos):
    client = _client(server)
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello there"}],
                                           max_tokens=4, temperature=0)
    assert plain.choices[0].message.role == "assistant" and plain.usage.completion_tokens >= 1
    pictured = client.chat.completions.create(model=MODEL, messages=_ask("What is in it?", photos["chelsea"]),
                                              max_tokens=4, temperature=0)
    # the image's 16 placeholders are part of the prompt
    assert pictured.usage.prompt_tokens >= 16 + plain.usage.prompt_tokens - 2
    samples = scrape(server.url)
    assert metric(samples, "mmcache:encoder_cache_entries") >= 1
    assert metric(samples, "mmcache:encoder_cache_bytes") > 0
    _sound(server)


def test_second_turn_hits_pages_and_the_stored_image(server, photos):
    client = _client(server)
    first = _ask("Describe this photo of a cup in detail, please", photos["coffee"])
    q0, h0 = _vision(server)
    one = client.chat.completions.create(model=MODEL, messages=first, max_tokens=6, temperature=0)
    q1, h1 = _vision(server)
    assert (q1 - q0, h1 - h0) == (1, 0) and one.usage.prompt_tokens_details.cached_tokens == 0
    second = first + [{"role": "assistant", "content": one.choices[0].message.content},
                      {"role": "user", "content": "What colour is it?"}]
    two = client.chat.completions.create(model=MODEL, messages=second, max_tokens=6, temperature=0)
    q2, h2 = _vision(server)
    assert (q2 - q1, h2 - h1) == (1, 1)  # the image is a store hit
    assert two.usage.prompt_tokens_details.cached_tokens >= 16
    _sound(server)


def test_two_keys_share_no_hit(server, photos):
    messages = _ask("Who is this person in the white suit?", photos["astronaut"])
    alpha = _client(server, KEYS[0]).chat.completions.create(model=MODEL, messages=messages, max_tokens=3,
                                                             temperature=0)
    assert alpha.usage.prompt_tokens_details.cached_tokens == 0
    q0, h0 = _vision(server)
    beta = _client(server, KEYS[1]).chat.completions.create(model=MODEL, messages=messages, max_tokens=3,
                                                            temperature=0)
    q1, h1 = _vision(server)
    assert beta.usage.prompt_tokens_details.cached_tokens == 0 and (q1 - q0, h1 - h0) == (1, 0)
    again = _client(server, KEYS[0]).chat.completions.create(model=MODEL, messages=messages, max_tokens=3,
                                                             temperature=0)
    q2, h2 = _vision(server)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16 and (q2 - q1, h2 - h1) == (1, 1)
    # a cache_salt subdivides the key's own tenant: no hit on the unsalted entries
    salted = _client(server, KEYS[0]).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=3, temperature=0, extra_body={"cache_salt": "team-1"})
    q3, h3 = _vision(server)
    assert salted.usage.prompt_tokens_details.cached_tokens == 0 and (q3 - q2, h3 - h2) == (1, 0)


def test_async_streamed_chat_with_an_image(server, photos):
    async def talk():
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key=KEYS[1], max_retries=0)
        async with client:
            stream = await client.chat.completions.create(
                model=MODEL, messages=_ask("And this one?", photos["chelsea"]), max_tokens=5, temperature=0,
                stream=True, stream_options={"include_usage": True})
            chunks = [c async for c in stream]
            whole = await client.chat.completions.create(
                model=MODEL, messages=_ask("And this one?", photos["chelsea"]), max_tokens=5, temperature=0)
            return chunks, whole

    chunks, whole = asyncio.run(talk())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert whole.usage.prompt_tokens_details.cached_tokens >= 16
    _sound(server)


def test_keys_are_required(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    for headers in ({}, {"Authorization": "Bearer key-gamma"}, {"Authorization": "Basic key-alpha"}):
        r = httpx.post(server.base_url + "/chat/completions", json=body, headers=headers)
        assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        _client(server, "wrong").models.list()
    assert httpx.get(server.url + "/health").status_code == 200  # no key needed


def _png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("url, status, code", [
    ("https://example.com/cat.png", 400, "invalid_image_url"),
    ("/etc/hostname", 400, "invalid_image_url"),
    ("file:///etc/hostname", 400, "invalid_image_url"),
    (data_url(b"this is not an image"), 400, "invalid_image"),
    (data_url(_png(64, 64)[:60]), 400, "invalid_image"),
    (data_url(bytes(MAX_IMAGE_BYTES + 4096)), 413, "request_too_large"),
    (data_url(_png(1000, 1000)), 413, "request_too_large"),
])
def test_image_errors(server, url, status, code, stream):
    body = {"model": MODEL, "messages": _ask("look", url), "max_tokens": 2, "stream": stream}
    r = httpx.post(server.base_url + "/chat/completions", json=body,
                   headers={"Authorization": f"Bearer {KEYS[0]}"})
    assert r.status_code == status
    err = error_of(r)
    assert err["code"] == code and err["param"].startswith("messages")
    _sound(server)


def test_bad_image_raises_in_the_client(server):
    with pytest.raises(openai.BadRequestError) as info:
        _client(server).chat.completions.create(model=MODEL, messages=_ask("look", "http://example.com/a.png"))
    assert "data URL" in info.value.body["message"]
