"""The server's parts without a server: chat rendering for text models, stop strings and held-back text, tenant
keys and salts, and the engine-error to HTTP-status mapping."""

from types import SimpleNamespace

import pytest

from mmcache.presets.text import build_model
from mmcache.errors import InvalidRequest, MediaDecodeError
from mmcache.server import ServerConfig
from mmcache.server.errors import APIError, from_engine_error
from mmcache.server.text_output import TextAssembler
from mmcache.server.prompts import PlainChatTemplate, PromptMaker
from mmcache.server.protocol import ChatCompletionRequest, CompletionRequest
from mmcache.server.tenants import ANONYMOUS, Tenants


@pytest.fixture(scope="module")
def tokenizer():
    return build_model("tiny")[1]


def _chat(messages, **kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "tiny", "messages": messages, **kw})


def _maker(tokenizer) -> PromptMaker:
    host = SimpleNamespace(core=SimpleNamespace(tokenizer=tokenizer, max_model_len=512), is_vlm=False)
    return PromptMaker(host, ServerConfig(preset="tiny"))


def test_plain_template_keeps_earlier_turns_and_generated_ids(tokenizer):
    template = PlainChatTemplate(tokenizer)
    first = template.render([("user", "a red kite", None)])
    answer = [301, 17, 0]
    later = template.render([("user", "a red kite", None), ("assistant", "", answer), ("user", "why?", None)])
    assert later[:len(first) + len(answer)] == first + answer
    assert tokenizer.decode(first) == "user: a red kite\nassistant:"


def test_text_chat_uses_the_tokenizers_own_template_when_it_has_one(tokenizer):
    plain = _maker(tokenizer).chat(_chat([{"role": "user", "content": "hi there"}]), "r", b"", 0.0)
    assert tokenizer.decode(plain.prompt) == "user: hi there\nassistant:"
    tokenizer.chat_template = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                               "{% if add_generation_prompt %}[assistant]{% endif %}")
    try:
        req = _maker(tokenizer).chat(_chat([{"role": "developer", "content": "be brief"},
                                            {"role": "user", "content": "hi"}]), "r", b"salt", 0.0)
    finally:
        tokenizer.chat_template = None
    assert tokenizer.decode(req.prompt) == "[system]be brief[user]hi[assistant]"
    assert req.salt == b"salt" and req.request_id == "r"


def test_the_server_tokenizes_on_its_own_copy(tokenizer):
    maker = _maker(tokenizer)
    assert maker.tokenizer is not tokenizer and maker.tokenizer._tokenizer is not tokenizer._tokenizer
    req = maker.completion(CompletionRequest(model="tiny", prompt="a kite"), "r", b"", 0.0)
    assert req.prompt == tokenizer("a kite", add_special_tokens=False)["input_ids"]


def test_text_chat_maps_sampling_fields(tokenizer):
    req = _maker(tokenizer).chat(_chat([{"role": "user", "content": "x"}], max_tokens=9, max_completion_tokens=5,
                                       temperature=0, top_k=-1, top_p=0.5, seed=4), "r", b"", 0.0)
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_k, s.top_p, s.seed) == (5, 0.0, 0, 0.5, 4)


def test_images_go_to_vlms_only_and_as_data_urls(tokenizer):
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}
    with pytest.raises(APIError) as info:
        _maker(tokenizer).chat(_chat([image]), "r", b"", 0.0)
    assert info.value.status == 400 and info.value.code == "invalid_image"
    vlm = PromptMaker(SimpleNamespace(core=SimpleNamespace(tokenizer=tokenizer, max_model_len=512), is_vlm=True),
                      ServerConfig(preset="tiny-llava", max_image_bytes=10, max_images=1))
    for url, status in (("https://a/b.png", 400), ("HTTP://a/b.png", 400), ("b.png", 400),
                        ("data:image/png;base64," + "A" * 40, 413)):
        msg = {"role": "user", "content": [{"type": "image_url", "image_url": url}]}
        with pytest.raises(APIError) as info:
            vlm.chat(_chat([msg]), "r", b"", 0.0)
        assert info.value.status == status
    two = {"role": "user", "content": [{"type": "image_url", "image_url": "data:image/png;base64,AA=="}] * 2}
    with pytest.raises(APIError) as info:
        vlm.chat(_chat([two]), "r", b"", 0.0)
    assert info.value.status == 400 and "at most 1" in info.value.message


class _Chars:
    """A tokenizer whose token i is the character chr(i) (and 0xFFFD for an unfinished byte, id 1)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join("\ufffd" if i == 1 else chr(i) for i in ids)


def test_stop_strings_cut_and_held_back_text_is_never_taken_back():
    asm = TextAssembler(_Chars(), ["END"])
    sent = "".join(asm.add(ord(c)) for c in "abE")
    assert sent == "ab"  # "E" may begin the stop string: held back
    assert asm.add(ord("x")) == "Ex" and not asm.stopped
    assert asm.add(ord("E")) + asm.add(ord("N")) == "" and asm.add(ord("D")) == "" and asm.stopped
    assert asm.text == "abEx"
    asm = TextAssembler(_Chars(), [])
    assert asm.add(ord("a")) + asm.add(1) == "a"  # an incomplete character waits for the next token
    assert asm.flush() == "\ufffd"


def test_keys_are_tenants_with_their_own_salts():
    tenants = Tenants(("k1", "k2"), secret=b"s" * 32)
    one, two = tenants.authenticate("Bearer k1"), tenants.authenticate("bearer k2")
    assert one.name == "key-0" and two.name == "key-1" and one.salt != two.salt and len(one.salt) == 32
    assert tenants.authenticate("Bearer k3") is None and tenants.authenticate(None) is None
    assert tenants.authenticate("k1") is None
    # a caller's cache_salt subdivides its own tenant and cannot spell another tenant's salt
    assert Tenants.salt(one, "x") != Tenants.salt(two, "x") and Tenants.salt(one, "x").startswith(one.salt)
    assert Tenants.salt(one, None) == one.salt
    assert len(Tenants.salt(one, "\u00e9" * 256)) == len(Tenants.salt(ANONYMOUS, "x")) + 32 <= 256
    # salts are derived from the server's secret: another server's differ
    assert Tenants(("k1",), secret=b"t" * 32).authenticate("Bearer k1").salt != one.salt
    assert Tenants().authenticate(None) is ANONYMOUS and Tenants.salt(ANONYMOUS, None) == b""


def test_engine_errors_map_to_statuses():
    assert from_engine_error(MediaDecodeError(0, "9 bytes exceed the limit of 8")).status == 413
    assert from_engine_error(MediaDecodeError(0, "not an image")).status == 400
    assert from_engine_error(InvalidRequest("prompt too long")).status == 400
    assert from_engine_error(RuntimeError("boom")).status == 500


def test_the_listening_socket_disables_nagle():
    """Accepted connections inherit TCP_NODELAY; without it every small response waited ~40 ms for the
    client's delayed ACK."""
    import socket

    from mmcache.server.launch import _bind

    sock = _bind("127.0.0.1", 0)
    try:
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        assert sock.getsockname()[1] != 0
    finally:
        sock.close()


def test_bodies_are_parsed_and_validated_in_one_pass():
    """``parse_body`` reads the bytes with pydantic's own parser: the same request as ``json.loads`` then
    ``model_validate``, a leading byte-order mark ignored; bad JSON and non-objects are ``invalid_json``, a bad
    field names itself."""
    import json

    from mmcache.server.intake import parse_body

    body = {"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "QUJD" * 5000}},
        {"type": "text", "text": "caf\u00e9 \u2615"}]}], "max_tokens": 3, "stream": True, "cache_salt": "s"}
    raw = json.dumps(body).encode()
    assert parse_body(raw, ChatCompletionRequest) == ChatCompletionRequest.model_validate(body)
    assert parse_body(b"\xef\xbb\xbf" + raw, ChatCompletionRequest) == ChatCompletionRequest.model_validate(body)
    for bad in (b"{not json", b"", b'{"model": "tiny"} trailing', b"[1, 2]", b"null", b'"text"'):
        with pytest.raises(APIError) as info:
            parse_body(bad, CompletionRequest)
        assert (info.value.status, info.value.code) == (400, "invalid_json"), bad
    with pytest.raises(APIError) as info:
        parse_body(b'{"model": "tiny", "messages": [{"role": "robot", "content": "hi"}]}', ChatCompletionRequest)
    assert (info.value.status, info.value.param) == (400, "messages.0.role")


def test_prefix_cache_counters_count_new_requests_and_re_admissions_apart():
    """vLLM's rule: a preempted request's lookup on re-admission (mostly its own pages) is not a new query."""
    import numpy as np
    import torch
    from prometheus_client.parser import text_string_to_metric_families

    from mmcache.engine import Engine, EngineConfig, SamplingParams
    from mmcache.server.metrics import ServerMetrics
    from mmcache.server.engine_host import EngineHost

    torch.set_num_threads(1)
    model, tok = build_model("tiny", "float32")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 512, size=int(rng.integers(40, 70))).tolist() for _ in range(2)]
    engine = Engine(model, tok, EngineConfig(page_size=16, num_pages=10))  # too few pages: one is preempted
    engine.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    main = engine.metrics()["main"]
    assert engine.metrics()["engine"]["preemptions"] == 1 and main["readmission_hit_tokens"] > 0
    text = ServerMetrics(EngineHost(engine), "tiny", None).render().decode()
    got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert got["mmcache:prefix_cache_queries_total"] == sum(len(p) for p in prompts)  # both cold first lookups
    assert got["mmcache:prefix_cache_hits_total"] == 0
    assert got["mmcache:prefix_cache_preempted_queries_total"] == main["readmission_lookup_tokens"] > 0
    assert got["mmcache:prefix_cache_preempted_hits_total"] == main["readmission_hit_tokens"]


@pytest.mark.parametrize("dtype,mode,says", [("float32", "on", None),
                                             ("float16", "on", "KV dtype float16 has not passed the bit-exact gate"),
                                             ("float32", "off", "cache mode 'off'")])
def test_a_pool_with_reuse_off_is_said_at_start_and_in_the_metrics(dtype, mode, says):
    """A cache that runs off (a gate, or the configuration) must not pass unseen: engine.metrics() carries the
    mode and the gate's reason, /metrics a gauge, and ``mmcache serve`` prints why at start."""
    import torch
    from prometheus_client.parser import text_string_to_metric_families

    from mmcache.engine import Engine, EngineConfig
    from mmcache.server.cli import reuse_off_reasons
    from mmcache.server.metrics import ServerMetrics
    from mmcache.server.engine_host import EngineHost

    torch.set_num_threads(1)
    model, tok = build_model("tiny", dtype)
    host = EngineHost(Engine(model, tok, EngineConfig(page_size=16, cache_mode=mode)))
    main = host.engine.metrics()["main"]
    assert main["mode"] == ("on" if says is None else "off")
    assert (main["reuse_off"] is None) == (dtype == "float32")
    reasons = reuse_off_reasons(host)
    assert reasons == [] if says is None else (len(reasons) == 1 and reasons[0].startswith("main pool: " + says))
    text = ServerMetrics(host, "tiny", None).render().decode()
    got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert got["mmcache:prefix_cache_enabled"] == (1.0 if says is None else 0.0)
    assert reuse_off_reasons(None) == []  # a server without a chat model


class _WatchedText(str):
    """A str that records the widest slice and search range taken of it."""

    widest = 0

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, _ = key.indices(len(self))
            _WatchedText.widest = max(_WatchedText.widest, stop - start)
        return str.__getitem__(self, key)

    def find(self, sub, start=0, end=None):
        end = len(self) if end is None else end
        _WatchedText.widest = max(_WatchedText.widest, end - max(start, 0))
        return str.find(self, sub, start, end)


class _WatchedChars(_Chars):
    def decode(self, ids, skip_special_tokens=True):
        return _WatchedText(super().decode(ids, skip_special_tokens))


def test_the_stop_check_looks_at_a_window_bounded_by_the_stop_strings():
    stops = ["ab" * 100 + "c", "b" * 150 + "c", "ba" * 64 + "x"]
    asm = TextAssembler(_WatchedChars(), stops)
    text = "ab" * 1500  # every tail begins some stop string, none completes
    sent = "".join(asm.add(ord(c)) for c in text)
    longest = max(len(s) for s in stops)
    assert _WatchedText.widest <= 2 * longest  # never the whole text (3000 characters)
    assert sent + asm.flush() == text and not asm.stopped
    asm = TextAssembler(_WatchedChars(), stops)
    out = "".join(asm.add(ord(c)) for c in "xy" + "b" * 150 + "cz")
    assert asm.stopped and out == "xy" == asm.text
