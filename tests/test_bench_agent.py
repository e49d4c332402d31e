"""``mmcache bench serve --workloads agent`` and ``--host-tier-bytes``: the agent workload's shape (the repository's
agent sessions scaled, their tool waits, determinism by seed), the session runner's per-turn wait (a fake client
and an injected sleep: the wait comes after the previous answer ended and before the next turn is sent), and the
options and their refusals. No server is started and no speed is asserted."""

import asyncio
from types import SimpleNamespace

import pytest

import benchmarks.serve as serve
import benchmarks.serve_open_loop as ol
from benchmarks import loadgen
from benchmarks.runner import bench_parser
from mmcache.replay.sessions import AgentSessions, SessionParams

SPACE = serve.sw.TokenSpace(2, 512)


# ---- the workload ----------------------------------------------------------------------------------------
def test_the_agent_workload_is_a_function_of_its_seed():
    a = serve.sw.agent(SPACE, 3, 4, 4, 0.125, 12)
    b = serve.sw.agent(SPACE, 3, 4, 4, 0.125, 12)
    c = serve.sw.agent(SPACE, 4, 4, 4, 0.125, 12)
    assert (a.turns, a.max_tokens, a.waits_s) == (b.turns, b.max_tokens, b.waits_s)
    assert a.turns != c.turns and a.waits_s != c.waits_s
    more = serve.sw.agent(SPACE, 3, 6, 4, 0.125, 12)  # more sessions: the first ones unchanged
    assert (more.turns[:4], more.waits_s[:4]) == (a.turns, a.waits_s)


def test_the_tool_waits_and_turn_counts_are_the_session_generators():
    plan = serve.sw.agent(SPACE, 5, 6, 3, 0.125, 12)
    data = AgentSessions(SessionParams(seed=5, sessions=6))  # unscaled: scaling lengths leaves the latencies alone
    for i, s in enumerate(data.sessions):
        n = min(3, len(s.outputs))
        assert len(plan.turns[i]) == len(plan.max_tokens[i]) == len(plan.waits_s[i]) == n
        assert plan.waits_s[i] == [0.0] + [float(x) for x in s.latency[:n - 1]]
    assert any(w > 0 for ws in plan.waits_s for w in ws[1:])
    assert plan.unit == "sessions" and plan.params["mean_wait_s"] > 0


def test_the_agent_sessions_share_the_system_prompt_and_stay_in_the_token_space():
    plan = serve.sw.agent(SPACE, 0, 5, 4, 0.125, 7)
    system = plan.params["system_prompt_tokens"]
    assert system == round(1500 * 0.125)
    firsts = [t[0] for t in plan.turns]
    assert all(f[:system] == firsts[0][:system] for f in firsts)  # the shared system prompt
    assert len({tuple(f[system:]) for f in firsts}) == len(firsts)  # each task its own
    ids = [x for t in plan.turns for part in t for x in part]
    assert SPACE.low <= min(ids) and max(ids) < SPACE.high
    assert all(1 <= m <= 7 for ms in plan.max_tokens for m in ms)
    sessions = plan.sessions({"model": "m"}, 7)  # beyond its length: the list again, waits included
    assert [s.waits_s for s in sessions] == plan.waits_s + plan.waits_s[:2]


def test_bad_agent_shapes_are_refused():
    for bad in (dict(scale=0.0), dict(scale=1.5), dict(sessions=0), dict(max_turns=0), dict(max_answer=0)):
        shape = {"sessions": 2, "max_turns": 2, "scale": 0.1, "max_answer": 4, **bad}
        with pytest.raises(serve.WorkloadShapeError, match="agent"):
            serve.sw.agent(SPACE, 0, shape["sessions"], shape["max_turns"], shape["scale"], shape["max_answer"])


def test_a_token_session_refuses_waits_that_do_not_fit_its_turns():
    with pytest.raises(ValueError, match="one value per turn"):
        loadgen.TokenSession([[1], [2]], {}, waits_s=[0.0])
    with pytest.raises(ValueError, match="non-negative"):
        loadgen.TokenSession([[1], [2]], {}, waits_s=[0.0, -1.0])


# ---- the session runner's wait ---------------------------------------------------------------------------
class FakeStream:
    """One streamed completion: ``n`` text chunks, the answer's ids on the last, then the usage."""

    def __init__(self, prompt: list[int], n: int):
        ids = [1000 + len(prompt) + i for i in range(n)]
        choice = lambda i: SimpleNamespace(text=f"t{i}", token_ids=ids if i == n - 1 else None, model_extra={})
        usage = SimpleNamespace(prompt_tokens=len(prompt), completion_tokens=n,
                                prompt_tokens_details=SimpleNamespace(cached_tokens=0))
        self.chunks = [SimpleNamespace(choices=[choice(i)], usage=None) for i in range(n)]
        self.chunks.append(SimpleNamespace(choices=[], usage=usage))

    def __aiter__(self):
        return self._chunks()

    async def _chunks(self):
        for c in self.chunks:
            yield c

    async def close(self):
        pass


class FakeClient:
    def __init__(self, log: list):
        self.log = log
        self.completions = self

    async def create(self, prompt, max_tokens, stream, stream_options, **rest):
        self.log.append(("send", len(prompt)))
        return FakeStream(prompt, max_tokens)


def test_each_turn_is_sent_its_wait_after_the_previous_answer_ended():
    log, records = [], []

    async def sleep(seconds):  # the injected sleep sees what has ended when the wait starts
        log.append(("wait", seconds, [r.end is not None and r.outcome == "ok" for r in records]))

    session = loadgen.TokenSession([[1, 2], [3], [4, 5]], {"model": "m"}, max_tokens=[2, 2, 1],
                                   waits_s=[9.0, 0.5, 1.25])
    asyncio.run(loadgen.run_token_session(FakeClient(log), session, 0, records, sleep=sleep))
    assert log == [("send", 2), ("wait", 0.5, [True]), ("send", 5), ("wait", 1.25, [True, True]), ("send", 9)]
    assert [r.outcome for r in records] == ["ok"] * 3


def test_without_waits_no_sleep_is_taken():
    log, records = [], []

    async def sleep(seconds):
        log.append(("wait", seconds))

    session = loadgen.TokenSession([[1], [2]], {"model": "m"}, max_tokens=[1, 1])
    asyncio.run(loadgen.run_token_session(FakeClient(log), session, 0, records, sleep=sleep))
    assert log == [("send", 1), ("send", 3)]


def test_the_open_loop_honours_the_waits_on_the_clock():
    """The real sleep through ``open_loop``: a lower bound on the gap only, never an upper one."""
    log = []
    client = FakeClient(log)
    session = loadgen.TokenSession([[1], [2], [3]], {"model": "m"}, max_tokens=[1, 1, 1], waits_s=[0.0, 0.05, 0.1])
    records = asyncio.run(loadgen.open_loop(lambda key: client, [session], 100.0, seed=0, time_limit_s=30.0,
                                            offsets=[0.0]))
    assert [r.turn for r in records] == [0, 1, 2]
    for prev, nxt, wait in zip(records, records[1:], (0.05, 0.1)):
        assert nxt.send - prev.end >= 0.9 * wait


# ---- options ---------------------------------------------------------------------------------------------
def parsed(*argv):
    args = bench_parser("serve", serve).parse_args(["--quick", *argv])
    serve.settle(args)
    return args


def test_agent_is_named_only_and_builds_as_a_sessions_workload():
    assert "agent" not in parsed().workloads
    args = parsed("--workloads", "agent", "--text-sessions", "3")
    assert args.workloads == ["agent"]
    works = ol.text_workloads(args, SPACE, 0, ["agent"])
    work = works["agent"]
    assert work.unit == "sessions/s" and work.params["scale"] == serve.TEXT_SHAPES["quick"]["scale"]
    made = work.make({"model": "m", "max_tokens": 8}, 2)
    assert all(s.waits_s is not None and len(s.waits_s) == len(s.turns) <= args.text_turns for s in made)


def test_the_host_tier_adds_mmcache_tier_beside_mmcache():
    args = parsed("--workloads", "agent")
    assert ol.engine_names(args) == ["mmcache_nocache", "mmcache"]
    args = parsed("--workloads", "agent", "--host-tier-bytes", str(1 << 20))
    assert ol.engine_names(args) == ["mmcache_nocache", "mmcache", "mmcache_tier"]
    assert serve.engine_config(args).host_tier_bytes == 0
    tier = ol.text_server_config(args, "folder", "on", args.host_tier_bytes).engine_config
    assert tier.host_tier_bytes == 1 << 20 and tier.num_pages == args.num_pages
    assert serve.run_config(args)["host_tier_bytes"] == 1 << 20


@pytest.mark.parametrize("argv, says", [(["--no-load"], "--no-load"), (["--tune-peer", "256"], "--tune-peer")])
def test_a_host_tier_where_no_open_loop_runs_is_refused(argv, says):
    args = bench_parser("serve", serve).parse_args(["--quick", "--host-tier-bytes", "4096", *argv])
    with pytest.raises(serve.WorkloadShapeError, match=f"--host-tier-bytes .* {says}"):
        serve.settle(args)


@pytest.mark.parametrize("value, says", [("-1", "at least 0"), ("x", "not a whole number"),
                                         (str(2**41), "at most")])
def test_bad_host_tier_sizes_are_refused_by_the_parser(value, says, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_parser("serve", serve).parse_args(["--quick", f"--host-tier-bytes={value}"])
    assert exc.value.code == 2 and says in capsys.readouterr().err
