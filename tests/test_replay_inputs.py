"""Trace and parameter-file loading: the Mooncake mapping, malformed lines, the sessions generator."""

import json

import numpy as np
import pytest

from mmcache import AllocationManager, CacheConfig, InvalidRequest, TraceFormatError
from mmcache.replay import AgentSessions, MooncakeTrace, SessionParams, SessionParamsError, load_params
from mmcache.replay.report import duplicate_media_rate
from mmcache.replay.sessions import DEFAULT_PARAMS, Dist, MediaParams, params_to_dict
from mmcache.replay.simulate import ReplayConfig, RunLog, replay_fingerprint
from test_replay_ceiling import small_sessions, write_trace

GOOD = {"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [7, 8]}


def test_mooncake_blocks_map_to_deterministic_512_token_blocks(tmp_path):
    records = [GOOD, {"timestamp": 3, "input_length": 1024, "output_length": 2, "hash_ids": [7, 9]},
               {"timestamp": 9, "input_length": 100, "output_length": 0, "hash_ids": [8]}]
    trace = MooncakeTrace(write_trace(tmp_path / "t.jsonl", records))
    a, b, c = (trace.request(i).prompt_ids() for i in range(3))
    assert (len(a), len(b), len(c)) == (700, 1024, 100)
    np.testing.assert_array_equal(a[:512], b[:512])  # equal id 7: equal block
    assert not np.array_equal(a[512:700], b[512:700])  # ids 8 and 9 differ
    np.testing.assert_array_equal(a[512:612], c)  # id 8 at another position: the same block, cut to length
    assert len(trace.request(0).output_ids()) == 5 and len(trace.request(2).output_ids()) == 0
    assert not np.array_equal(trace.request(0).output_ids()[:2], trace.request(1).output_ids())
    again = MooncakeTrace(write_trace(tmp_path / "u.jsonl", records))
    np.testing.assert_array_equal(again.request(1).prompt_ids(), b)
    np.testing.assert_array_equal(again.request(1).output_ids(), trace.request(1).output_ids())
    assert [t for t, _ in trace.initial()] == [0.0, 0.003, 0.009]


@pytest.mark.parametrize("bad, reason", [
    ("{not json", "not JSON"),
    ("[1, 2]", "JSON object"),
    ('{"timestamp": 5, "input_length": 700, "output_length": 5}', "missing key"),
    ('{"timestamp": 5, "input_length": 700, "output_length": 5, "hash_ids": [1]}', "hash ids for input_length"),
    ('{"timestamp": 5, "input_length": 0, "output_length": 5, "hash_ids": []}', "input_length"),
    ('{"timestamp": 5, "input_length": 700, "output_length": -1, "hash_ids": [1, 2]}', "output_length"),
    ('{"timestamp": 5, "input_length": 700, "output_length": true, "hash_ids": [1, 2]}', "output_length"),
    ('{"timestamp": 5, "input_length": 700, "output_length": 5, "hash_ids": [1, "x"]}', "hash ids"),
    ('{"timestamp": 5, "input_length": 700, "output_length": 5, "hash_ids": [1, -2]}', "hash ids"),
    ('{"timestamp": 5, "input_length": 700, "output_length": 5, "hash_ids": 3}', "must be a list"),
    ('{"timestamp": -1, "input_length": 700, "output_length": 5, "hash_ids": [1, 2]}', "timestamp"),
    ('{"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [1, 2]}', "earlier than"),
    ("", "not JSON"),
    # these raised OverflowError, RecursionError or MemoryError (the last one's output was built before the
    # replay refused it as too long for the pool)
    ('{"timestamp": 1%s, "input_length": 700, "output_length": 5, "hash_ids": [1, 2]}' % ("0" * 400), "timestamp"),
    ('{"timestamp": 5, "input_length": 700, "output_length": 5, "hash_ids": [18446744073709551616, 2]}', "hash ids"),
    ('{"timestamp": 5, "input_length": 700, "output_length": %d, "hash_ids": [1, 2]}' % 2**70, "exceeds"),
    ('{"timestamp": 5, "input_length": 700, "output_length": 1000000000000, "hash_ids": [1, 2]}', "exceeds"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
])
def test_malformed_line_names_its_line(tmp_path, bad, reason):
    first = json.dumps({**GOOD, "timestamp": 2})
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{first}\n{first}\n{bad}\n{first}\n")
    with pytest.raises(TraceFormatError) as err:
        MooncakeTrace(path)
    assert err.value.line == 3
    assert "bad.jsonl:3:" in str(err.value) and reason in str(err.value)


def test_a_bad_line_past_the_limit_still_fails(tmp_path):
    path = tmp_path / "late.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + "{oops\n")
    with pytest.raises(TraceFormatError) as err:
        MooncakeTrace(path, limit=1)
    assert err.value.line == 2


def test_empty_or_missing_trace_is_refused(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(TraceFormatError):
        MooncakeTrace(tmp_path / "empty.jsonl")
    with pytest.raises(TraceFormatError):
        MooncakeTrace(tmp_path / "absent.jsonl")


def test_session_turn_prompt_extends_previous_prompt_output_and_tool_result():
    work = small_sessions()
    for s, sess in enumerate(work.sessions):
        for k in range(len(sess.outputs) - 1):
            turn, nxt = work.turn(s, k), work.turn(s, k + 1)
            prompt, out, following = turn.prompt_ids(), turn.output_ids(), nxt.prompt_ids()
            assert len(following) == len(prompt) + len(out) + int(sess.tools[k])
            np.testing.assert_array_equal(following[:len(prompt) + len(out)], np.concatenate([prompt, out]))
    system = work.params.system_prompt_tokens
    firsts = [work.turn(s, 0).prompt_ids() for s in range(len(work.sessions))]
    assert all(np.array_equal(f[:system], firsts[0][:system]) for f in firsts)
    assert not np.array_equal(firsts[0][system:system + 3], firsts[1][system:system + 3])


def test_sessions_are_closed_loop_with_fixed_concurrency():
    work = small_sessions(sessions=5, concurrency=2, turns=Dist("constant", 2), start_spacing_s=1.0)
    assert [(t, s.session, s.turn) for t, s in work.initial()] == [(0.0, 0, 0), (1.0, 1, 0)]
    assert [(t, s.session, s.turn) for t, s in work.follow_ups(work.turn(0, 0), 10.0, True)] == [(10.5, 0, 1)]
    assert [(t, s.session, s.turn) for t, s in work.follow_ups(work.turn(0, 1), 20.0, True)] == [(20.0, 2, 0)]
    # A rejected turn ends its session; the slot moves on.
    assert [(s.session, s.turn) for _, s in work.follow_ups(work.turn(1, 0), 5.0, False)] == [(3, 0)]
    assert work.follow_ups(work.turn(4, 1), 5.0, True) == []


def test_sessions_are_deterministic_per_seed():
    a, b, c = small_sessions(seed=9), small_sessions(seed=9), small_sessions(seed=10)
    np.testing.assert_array_equal(a.turn(2, 1).prompt_ids(), b.turn(2, 1).prompt_ids())
    assert a.num_requests == b.num_requests
    assert not np.array_equal(a.turn(0, 0).prompt_ids(), c.turn(0, 0).prompt_ids())


def test_default_parameter_file_is_the_dataclass_defaults():
    assert load_params(DEFAULT_PARAMS) == SessionParams()
    assert json.loads(DEFAULT_PARAMS.read_text()) == params_to_dict(SessionParams())


@pytest.mark.parametrize("change, key", [
    ({"sesions": 3}, "sesions"),
    ({"sessions": 0}, "sessions"),
    ({"concurrency": "8"}, "concurrency"),
    ({"turns": {"kind": "normal", "mean": 3}}, "turns.kind"),
    ({"turns": {"kind": "lognormal", "mean": 3, "sigma": -1}}, "turns.sigma"),
    ({"output_tokens": {"kind": "lognormal", "mean": 3, "low": 5}}, "output_tokens"),
    ({"task_tokens": {"mean": 3, "spread": 1}}, "task_tokens.spread"),
    ({"media": {"probability": 2}}, "media.probability"),
    ({"media": [1]}, "media"),
    # these raised OverflowError, AttributeError or numpy errors, or asked for terabytes
    ({"seed": 2**64}, "seed"),
    ({"turns": {"kind": "constant", "mean": 10**400, "high": None}}, "turns.mean"),
    ({"turns": {"kind": "lognormal", "mean": 5, "sigma": 1e300, "low": 1, "high": None}}, "turns.sigma"),
    ({"turns": None}, "turns"),
    ({"vocab": 2**31, "media": {"probability": 1.0}}, "vocab"),
    ({"media": {"probability": 1.0, "distinct": 2**70}}, "media.distinct"),
    ({"system_prompt_tokens": 10**13}, "system_prompt_tokens"),
    ({"output_tokens": {"kind": "constant", "mean": 10**9, "low": 10**9, "high": None}}, "output_tokens.low"),
])
def test_bad_parameter_names_its_key(tmp_path, change, key):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**params_to_dict(SessionParams()), **change}))
    with pytest.raises(SessionParamsError) as err:
        load_params(path)
    assert err.value.key.startswith(key)


@pytest.mark.parametrize("change", [
    {"turns": {"kind": "constant", "mean": 1e15, "high": None}},  # 7 PiB of per-turn arrays
    {"output_tokens": {"kind": "constant", "mean": 10**6, "high": None}, "turns": {"kind": "constant", "mean": 100}},
    {"task_tokens": {"kind": "lognormal", "mean": 1e300, "sigma": 10, "high": None}},  # draws overflow to inf
])
def test_a_session_longer_than_a_replayed_sequence_may_be_is_refused_before_its_tokens_exist(tmp_path, change):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**params_to_dict(SessionParams()), "sessions": 3, **change}))
    with pytest.raises(SessionParamsError, match="over the 16777216") as err:
        AgentSessions(load_params(path), source=path.name)
    assert err.value.key == "(sessions)"


def test_unparsable_parameter_file_names_its_line(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('{\n "sessions": 3,\n oops\n}')
    with pytest.raises(SessionParamsError) as err:
        load_params(path)
    assert "line 3" in err.value.key


def test_duplicate_media_rate_counts_images_brought_again():
    turns = 5
    work = small_sessions(sessions=1, concurrency=1, turns=Dist("constant", turns),
                          media=MediaParams(probability=1.0, distinct=1, image_tokens=6))
    specs = [work.turn(0, k) for k in range(turns)]
    # Turn k carries the k images of the earlier tool results, all the same picture: turn k brings one anew
    # (the newest tool result's), and every one after the first is that picture again.
    assert [len(s.media()) for s in specs] == list(range(turns))
    log = RunLog(ReplayConfig(), specs=specs)
    assert duplicate_media_rate(log) == pytest.approx((turns - 2) / (turns - 1))
    placeholder = work.params.vocab
    for s in specs:
        ids = s.prompt_ids()
        for m in s.media():
            assert (ids[m.position:m.position + 6] == placeholder).all()
    assert duplicate_media_rate(RunLog(ReplayConfig(), specs=[small_sessions().turn(0, 1)])) is None


def test_distinct_images_give_distinct_page_names():
    one = small_sessions(sessions=1, turns=Dist("constant", 3), media=MediaParams(1.0, 1, 6))
    two = AgentSessions(SessionParams(**{**one.params.__dict__, "media": MediaParams(1.0, 50, 6)}))
    # Same text everywhere (same seed and lengths); only the image digests can differ.
    a, b = one.turn(0, 2), two.turn(0, 2)
    np.testing.assert_array_equal(a.prompt_ids(), b.prompt_ids())
    manager = AllocationManager(CacheConfig(num_pages=8, page_size=4), replay_fingerprint(4))
    names_a = manager.prepare(a.prompt_ids(), a.media()).names
    names_b = manager.prepare(b.prompt_ids(), b.media()).names
    first_image_page = a.media()[0].position // 4
    np.testing.assert_array_equal(names_a[:first_image_page], names_b[:first_image_page])
    assert names_a[first_image_page] != names_b[first_image_page]


def test_a_replayed_pool_past_int32_page_ids_is_refused_by_its_config():
    # 2**31 pages got through ReplayConfig and raised OverflowError from the pool's int32 free stack (the
    # replay CLI printed a traceback instead of its one-line error).
    assert ReplayConfig(pool_tokens=2**31 - 1, page_size=1).num_pages == 2**31 - 1
    with pytest.raises(InvalidRequest, match="at most 2147483647 pages"):
        ReplayConfig(pool_tokens=2**31, page_size=1)
    with pytest.raises(InvalidRequest, match="at most 2147483647 pages"):
        ReplayConfig(pool_tokens=2**40, page_size=128)


def test_a_chat_re_sending_its_history_repeats_no_medium():
    """Five turns of a chat, every image different: each turn re-sends the images of the turns before in its
    history, which brings none of them anew (this reported 0.6 when every carried image counted as a
    duplicate)."""
    turns = 5
    work = small_sessions(sessions=2, concurrency=2, turns=Dist("constant", turns),
                          media=MediaParams(probability=1.0, distinct=10**6, image_tokens=6))
    chat = [work.turn(0, k) for k in range(turns)]
    digests = [m.digest for m in chat[-1].media()]
    assert len(digests) == len(set(digests)) == turns - 1  # distinct images, all in the last turn's history
    assert duplicate_media_rate(RunLog(ReplayConfig(), specs=chat)) == 0
    # Interleaved with another chat, still none; the same image brought by another chat is a duplicate.
    other = [work.turn(1, k) for k in range(turns)]
    mixed = [s for pair in zip(chat, other) for s in pair]
    assert duplicate_media_rate(RunLog(ReplayConfig(), specs=mixed)) == 0
    again = small_sessions(sessions=2, concurrency=2, turns=Dist("constant", 2),
                           media=MediaParams(probability=1.0, distinct=1, image_tokens=6))
    two_chats = [again.turn(0, 1), again.turn(1, 1)]  # each brings the one picture anew
    assert duplicate_media_rate(RunLog(ReplayConfig(), specs=two_chats)) == pytest.approx(0.5)
