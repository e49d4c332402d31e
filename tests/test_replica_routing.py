"""The replicas' routing key (``mmcache.replicas.routing.RoutingKey``) and the merged /metrics exposition, without
Ray: a chat keeps one key turn after turn; distinct chats, images, salts get distinct keys; a completion routes
by its depth page; the single-process server never imports Ray."""

import subprocess
import sys

import numpy as np
import pytest

from mmcache.errors import InvalidRequest
from mmcache.hosts.vlm import VLMRequest
from mmcache.engine.request import Request
from mmcache.replicas.metrics import merge_expositions
from mmcache.replicas.routing import RoutingKey
from mmcache.server.protocol import ChatMessage

PAGE = 16


class _Words:
    """A tokenizer of one token per word (enough for the key's first-turn estimate)."""

    def encode(self, text, add_special_tokens=False):
        return text.split()


@pytest.fixture(scope="module")
def vlm_template():
    from mmcache.presets.vlm import build_vlm

    return build_vlm("tiny-llava").template


def _key(key, *args):
    """The routing name (not the overflow's)."""
    return key.of(*args)[0]


def _ids(n, start=0):
    return list(range(start, start + n))


def _chat(*texts):
    return [ChatMessage(role="user" if i % 2 == 0 else "assistant", content=t) for i, t in enumerate(texts)]


def test_a_chat_keeps_its_key_as_it_grows_and_distinct_first_messages_differ():
    key = RoutingKey("m", PAGE, 2048, _Words())
    first = " ".join(f"w{i}" for i in range(40))  # 40 tokens: the key's page is the second
    turn1 = _ids(60)
    turn2 = turn1 + _ids(100, 1000)
    a1 = _key(key, Request(turn1), _chat(first))
    a2 = _key(key, Request(turn2), _chat(first, "answer", "next"))
    assert a1 == a2 is not None
    other = _key(key, Request(_ids(16) + _ids(44, 500)), _chat(first))  # same first page, other second page
    assert other != a1
    short = _key(key, Request(_ids(15)), _chat("short"))  # no full page: the first turn's tokens themselves
    assert short == _key(key, Request(_ids(15) + _ids(5, 99)), _chat("short", "x", "y")) is not None
    assert short != _key(key, Request(_ids(15), salt=b"t"), _chat("short"))


def test_salts_split_keys_and_a_completion_routes_by_its_depth_page():
    key = RoutingKey("m", PAGE, 64, _Words())  # depth 4 pages
    ids = _ids(200)
    assert _key(key, Request(ids, salt=b"a")) != _key(key, Request(ids, salt=b"b"))
    assert _key(key, Request(ids)) == _key(key, Request(ids[:64] + _ids(50, 900)))  # equal through page 4
    assert _key(key, Request(ids)) != _key(key, Request(ids[:48] + _ids(50, 900)))  # page 4 differs
    assert _key(key, Request(ids[:40])) == _key(key, Request(ids[:16] + _ids(24, 700)))  # shorter: the first page


def test_images_count_through_their_digests(vlm_template):
    key = RoutingKey("m", PAGE, 2048, None, vlm_template)

    def chat(image, text="What is in this photo, please describe it in detail for me now?"):
        return VLMRequest(messages=[{"role": "user", "content": [
            {"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": image}}]}])

    a, b = "data:image/png;base64,AAAA", "data:image/png;base64,BBBB"
    assert _key(key, chat(a)) == _key(key, chat(a))
    assert _key(key, chat(a)) != _key(key, chat(b))
    grown = chat(a)
    grown.messages += [{"role": "assistant", "content": "a cat"}, {"role": "user", "content": "and more?"}]
    assert _key(key, grown) == _key(key, chat(a))


def test_a_depth_below_one_is_refused():
    with pytest.raises(InvalidRequest):
        RoutingKey("m", PAGE, 0)


@pytest.mark.parametrize("kwargs", [dict(router="prefix-text", prefix_imbalance=-1),
                                    dict(router="prefix-text", prefix_imbalance=True),
                                    dict(router="prefix-text", prefix_imbalance="10"),
                                    dict(router="mmcache", prefix_imbalance=10)])
def test_the_prefix_text_threshold_is_a_number_for_that_router_only(kwargs):
    from mmcache.replicas.launch import ReplicaOptions
    from mmcache.server.config import ServerConfigError

    with pytest.raises(ServerConfigError, match="prefix_imbalance"):
        ReplicaOptions(2, **kwargs)
    assert ReplicaOptions(2, router="prefix-text", prefix_imbalance=10).prefix_imbalance == 10


def test_merged_metrics_label_each_replica_once_per_family():
    own = b'# HELP x_total errors\n# TYPE x_total counter\nx_total{model_name="m"} 2.0\n'
    rep = b'# HELP x_total errors\n# TYPE x_total counter\nx_total{model_name="m"} 5.0\n'
    text = merge_expositions(own, {"r1": rep, "r2": rep}).decode()
    assert text.count("# TYPE x_total counter") == 1
    assert 'x_total{model_name="m"} 2.0' in text
    assert 'x_total{model_name="m",replica="r1"} 5.0' in text and 'replica="r2"' in text


def test_the_single_process_server_never_imports_ray():
    code = ("import sys; from mmcache.presets import serve; from mmcache.server import ServerConfig\n"
            "with serve(ServerConfig(preset='tiny')) as srv: pass\n"
            "import mmcache.server.cli, mmcache.replicas.routing\n"
            "print(any(m == 'ray' or m.startswith('ray.') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("False")


def test_the_overflow_name_lies_deeper_and_is_none_without_pages():
    key = RoutingKey("m", PAGE, 64, _Words())  # depth 4 pages
    ids = _ids(200)
    name, overflow = key.of(Request(ids))
    assert overflow == key.of(Request(ids[:128] + _ids(72, 900)))[1]  # page 8: twice the depth
    assert overflow != key.of(Request(ids[:112] + _ids(88, 900)))[1]
    assert key.of(Request(_ids(10))) == (None, None)


def test_pinned_calls_go_to_their_replica_or_to_the_router_when_it_is_gone():
    from types import SimpleNamespace

    from mmcache.replicas.ray_routers import _pinned
    from mmcache.replicas.routing import EngineCall

    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=u)) for u in ("a", "b")]
    pending = SimpleNamespace(kwargs={"replica": "b"}, args=[EngineCall(None, None, 7, 0.0)])
    assert _pinned(replicas, pending) == [[replicas[1]]]
    assert _pinned(replicas, SimpleNamespace(kwargs={"replica": "gone"}, args=[])) is None  # the router decides
    assert _pinned(replicas, SimpleNamespace(kwargs={}, args=[])) is None


def test_an_engine_error_carried_across_processes_answers_as_it_would_here():
    import pickle

    from mmcache.errors import AllocationFailed, MediaDecodeError
    from mmcache.server.errors import carry, from_engine_error

    for err in (InvalidRequest("bad ids", "r1"), AllocationFailed("r1", 4, 2), MediaDecodeError("image #0", "not an image")):
        here = from_engine_error(err, "messages")
        there = from_engine_error(pickle.loads(pickle.dumps(carry(err))), "messages")
        assert (there.status, there.type, there.code, there.param, there.headers) == \
            (here.status, here.type, here.code, here.param, here.headers)
        assert there.message == here.message
