"""``mmcache serve`` over the tiny text preset, driven by the real ``openai`` client (sync and async) and httpx:
chat and completions, streaming, cached tokens on a chat's next turn, stop strings, a cut stream that aborts its
request, every error status with its OpenAI error object, 32 concurrent clients equal to the engine's own
greedy outputs, and /metrics moving as the requests say."""

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
import torch

from mmcache.engine.config import EngineConfig
from mmcache.engine.request import SamplingParams
from mmcache.presets import serve
from mmcache.server import Models, ServerConfig, ServerConfigError, start_server
from server_helpers import error_of, metric, scrape, wait_quiet
from mmcache.presets import engine_from_preset

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "tiny"
PAGE = 16


@pytest.fixture(scope="module")
def server(one_thread):
    config = ServerConfig(preset=MODEL, engine_config=EngineConfig(page_size=PAGE), max_body_bytes=256 * 1024)
    with serve(config) as srv:
        yield srv
    srv.host.engine.check_invariants()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def _quiet_and_sound(server):
    wait_quiet(server.host)
    server.host.engine.check_invariants()
    assert metric(scrape(server.url), "mmcache:kv_pages_live") == 0


def test_chat_non_streamed_and_streamed_agree(server, client):
    messages = [{"role": "system", "content": "You describe photos."},
                {"role": "user", "content": "A quiet harbour at dawn with three fishing boats"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    choice = whole.choices[0]
    assert whole.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("length", "stop") and isinstance(choice.message.content, str)
    assert whole.usage.prompt_tokens > 0 and 1 <= whole.usage.completion_tokens <= 6
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # the same prompt again: its full pages come from the cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= PAGE
    _quiet_and_sound(server)


def test_stream_ends_with_done(server):
    body = {"model": MODEL, "prompt": "rainbow over a wheat field", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.base_url + "/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    last = json.loads(lines[-2][len("data: "):])
    assert last["object"] == "text_completion" and last["choices"][0]["finish_reason"] == "length"


def test_second_turn_reports_cached_tokens(client):
    first = [{"role": "user", "content": "Tell me about a lighthouse keeper who paints seagulls on stormy "
                                         "evenings while the fog horn sounds over the cliffs"}]
    one = client.chat.completions.create(model=MODEL, messages=first, max_tokens=5, temperature=0)
    assert one.usage.prompt_tokens_details.cached_tokens == 0
    second = first + [{"role": "assistant", "content": one.choices[0].message.content},
                      {"role": "user", "content": "And then?"}]
    two = client.chat.completions.create(model=MODEL, messages=second, max_tokens=5, temperature=0)
    cached = two.usage.prompt_tokens_details.cached_tokens
    assert cached >= PAGE * (one.usage.prompt_tokens // PAGE) - PAGE and cached > 0
    assert cached % PAGE == 0 and cached < two.usage.prompt_tokens


def test_cache_salt_separates_cache_entries(client):
    prompt = "an orange tram crossing a bridge in heavy snow at midnight with its lights on"
    run = lambda salt: client.completions.create(  # noqa: E731
        model=MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_body={"cache_salt": salt})
    assert run("alpha").usage.prompt_tokens_details.cached_tokens == 0
    assert run("beta").usage.prompt_tokens_details.cached_tokens == 0
    assert run("alpha").usage.prompt_tokens_details.cached_tokens >= PAGE


def test_long_cache_salts_are_served_within_the_salt_bound(server, client):
    ok = client.completions.create(model=MODEL, prompt="a fox", max_tokens=1, extra_body={"cache_salt": "\u00e9" * 256})
    assert ok.usage.completion_tokens == 1
    r = httpx.post(server.base_url + "/completions", json={"model": MODEL, "prompt": "a fox", "cache_salt": "x" * 257})
    assert r.status_code == 400 and error_of(r)["param"] == "cache_salt"


def test_stop_strings_cut_the_text(server, client):
    args = dict(model=MODEL, prompt=[5, 77, 301, 42, 9], max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True})
    full = client.completions.create(**args).choices[0].text
    stop = next(full[i:i + 2] for i in range(2, len(full) - 1) if "\ufffd" not in full[i:i + 2])
    cut = client.completions.create(**args, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[:full.index(stop)]
    streamed = list(client.completions.create(**args, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == cut.text
    assert streamed[-1].choices[0].finish_reason == "stop"
    _quiet_and_sound(server)


def test_cut_stream_aborts_its_request(server, client):
    before = scrape(server.url)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a long story about a clockwork fox"}],
        max_tokens=900, temperature=0.7, seed=3, stream=True, extra_body={"ignore_eos": True})
    received = 0
    for chunk in stream:
        received += 1
        if received == 3:
            break
    stream.close()
    wait_quiet(server.host)
    server.host.engine.check_invariants()
    after = scrape(server.url)
    assert metric(after, "mmcache:kv_pages_live") == 0
    aborted = metric(after, "mmcache:request_success_total", finished_reason="abort")
    assert aborted == metric(before, "mmcache:request_success_total", finished_reason="abort") + 1
    # the request ended early: far fewer tokens generated than asked for
    assert (metric(after, "mmcache:generation_tokens_total") - metric(before, "mmcache:generation_tokens_total")
            < 900)


def test_completions_accept_token_ids_and_list_forms(client):
    ids = [3, 14, 159, 26, 53]
    a = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0,
                                  extra_body={"return_token_ids": True})
    b = client.completions.create(model=MODEL, prompt=[ids], max_tokens=4, temperature=0,
                                  extra_body={"return_token_ids": True})
    assert a.usage.prompt_tokens == len(ids)
    assert a.choices[0].model_extra["token_ids"] == b.choices[0].model_extra["token_ids"]
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_concurrent_clients_match_the_engine(server):
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, 500, (int(n),), generator=gen).tolist()
               for n in torch.randint(5, 60, (24,), generator=gen)]
    # text prompts too: the server tokenizes them (on its own copy of the tokenizer) as the engine would
    prompts += [f"prompt {i}: a {colour} boat on a lake" for i, colour in enumerate(["red", "blue", "green"] * 3)][:8]
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    reference = engine_from_preset(MODEL, config=EngineConfig(page_size=PAGE)).generate(prompts, sp)

    async def ask_all():
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        async with client:
            return await asyncio.gather(*(client.completions.create(
                model=MODEL, prompt=p, max_tokens=8, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True}) for p in prompts))

    answers = asyncio.run(ask_all())
    assert len(answers) == 32
    for answer, ref in zip(answers, reference):
        assert answer.choices[0].model_extra["token_ids"] == ref.output_ids
        assert answer.usage.prompt_tokens == ref.prompt_len
    _quiet_and_sound(server)


def test_async_streaming_chat(server):
    async def talk():
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        async with client:
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "a kite above the dunes"}], max_tokens=4,
                temperature=0, stream=True, stream_options={"include_usage": True})
            return [chunk async for chunk in stream]

    chunks = asyncio.run(talk())
    assert chunks[-1].usage.completion_tokens == 4
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_metrics_move_as_the_requests_say(server, client):
    before = scrape(server.url)
    out = client.completions.create(model=MODEL, prompt=[7] * 40, max_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True})
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    wait_quiet(server.host)
    after = scrape(server.url)
    delta = lambda name, **kw: metric(after, name, **kw) - metric(before, name, **kw)  # noqa: E731
    assert delta("mmcache:request_success_total", finished_reason="length") == 1
    assert delta("mmcache:prefix_cache_queries_total") == out.usage.prompt_tokens
    assert delta("mmcache:prefix_cache_hits_total") == out.usage.prompt_tokens_details.cached_tokens
    assert delta("mmcache:generation_tokens_total") == 3
    assert delta("mmcache:time_to_first_token_seconds_count") == 1
    assert delta("mmcache:e2e_request_latency_seconds_count") == 1
    assert delta("mmcache:inter_token_latency_seconds_count") == 2
    assert delta("mmcache:request_prompt_tokens_sum") == 40
    assert delta("mmcache:request_errors_total", error_type="model_not_found") == 1
    assert metric(after, "mmcache:num_requests_running") == 0 and metric(after, "mmcache:num_requests_waiting") == 0
    assert metric(after, "mmcache:kv_pages_total") == (metric(after, "mmcache:kv_pages_free")
                                                      + metric(after, "mmcache:kv_pages_cached"))
    assert metric(after, "mmcache:kv_cache_usage_perc") == 0


@pytest.mark.parametrize("body, param", [
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 5}, "temperature"),
    ({"model": MODEL}, "messages"),
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2}, "n"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, "messages.0.content"),
])
def test_bad_fields_are_400_naming_the_field(server, body, param):
    r = httpx.post(server.base_url + "/chat/completions", json=body)
    assert r.status_code == 400
    assert error_of(r)["param"] == param


def test_malformed_json_and_unknown_routes(server):
    r = httpx.post(server.base_url + "/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and error_of(r)["code"] == "invalid_json"
    r = httpx.post(server.base_url + "/completions", json=[1, 2])
    assert r.status_code == 400 and error_of(r)["code"] == "invalid_json"
    r = httpx.get(server.base_url + "/nowhere")
    assert r.status_code == 404 and error_of(r)["code"] == "not_found"
    r = httpx.get(server.base_url + "/chat/completions")
    assert r.status_code == 405 and error_of(r)["code"] == "http_405"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"


def test_prompt_beyond_the_model_is_400(server, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[5] * 2000, max_tokens=1)
    assert info.value.status_code == 400
    _quiet_and_sound(server)


def test_body_beyond_the_limit_is_413(server):
    body = {"model": MODEL, "prompt": "x" * (300 * 1024)}
    r = httpx.post(server.base_url + "/completions", json=body)
    assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"
    for size in (300, 600):  # chunked, without a length: the limit crossed by the last chunk, then by one before
        raw = json.dumps({"model": MODEL, "prompt": "x" * (size * 1024)}).encode()
        chunks = (raw[i:i + 65536] for i in range(0, len(raw), 65536))
        r = httpx.post(server.base_url + "/completions", content=chunks, headers={"content-type": "application/json"})
        assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"


def test_full_waiting_queue_is_503_with_retry_after(server, monkeypatch):
    host = server.host
    monkeypatch.setattr(host, "max_waiting", 2)
    body = {"model": MODEL, "prompt": "a cup of tea", "max_tokens": 2}

    async def scenario():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as c:
            with host.hold():
                queued = [asyncio.ensure_future(c.post("/completions", json=body)) for _ in range(2)]
                while host.waiting < 2:
                    await asyncio.sleep(0.01)
                refused = await c.post("/completions", json=body)
            return refused, await asyncio.gather(*queued)

    refused, served = asyncio.run(scenario())
    assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
    assert error_of(refused)["code"] == "queue_full"
    assert [r.status_code for r in served] == [200, 200]
    _quiet_and_sound(server)


def test_health_and_config_checks(server):
    assert httpx.get(server.url + "/health").status_code == 200
    with pytest.raises(ServerConfigError):
        ServerConfig()
    with pytest.raises(ServerConfigError):
        ServerConfig(preset=MODEL, api_keys="one-key")


def test_client_gone_before_a_whole_answer_aborts_it(server):
    before = scrape(server.url)
    body = {"model": MODEL, "prompt": "a lighthouse", "max_tokens": 900, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/completions", json=body, timeout=httpx.Timeout(10, read=0.3))
    wait_quiet(server.host)
    after = scrape(server.url)
    assert (metric(after, "mmcache:request_success_total", finished_reason="abort")
            == metric(before, "mmcache:request_success_total", finished_reason="abort") + 1)
    assert metric(after, "mmcache:generation_tokens_total") - metric(before, "mmcache:generation_tokens_total") < 900
    server.host.engine.check_invariants()
    assert metric(after, "mmcache:kv_pages_live") == 0


def test_leaving_the_block_aborts_what_is_live(one_thread):
    engine = engine_from_preset(MODEL, config=EngineConfig(page_size=PAGE))
    lines: list = []

    def consume(url):
        body = {"model": MODEL, "prompt": "a very long tale", "max_tokens": 900, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/completions", json=body, timeout=60) as r:
            lines.extend(line for line in r.iter_lines() if line)

    with start_server(ServerConfig(preset=MODEL), lambda config: Models(engine)) as srv:
        reader = threading.Thread(target=consume, args=(srv.base_url,))
        reader.start()
        while not engine.has_unfinished():
            time.sleep(0.005)
    reader.join(timeout=60)
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "abort"
    assert not engine.has_unfinished()
    engine.check_invariants()
