"""The second tier in replay, and TraceLab's agent sessions replayed closed-loop.

* A TraceLab CSV's rounds arrive when the previous round of their session ended plus its tool wait, under the
  cost model's times; each round's prompt begins with the session's context up to ``prefix_len``.
* A malformed CSV is refused with the line named.
* With a host tier as large as the working set, a pool too small for the sessions realizes the ceiling; without
  it, evictions lose part of it. A disk level below a small host tier takes what the host tier gives up and
  recovers the rest (``--disk-tier-tokens``).
"""

import json
from dataclasses import replace

import numpy as np
import pytest

from mmcache.cli import main as cli_main
from mmcache.errors import InvalidRequest
from mmcache.replay.cli import load_workload
from mmcache.replay.costmodel import CostModel
from mmcache.replay.report import replay
from mmcache.replay.simulate import ReplayConfig, simulate
from mmcache.replay.tracelab import TraceLabError, TraceLabSessions

CSV = """session_id,arrival_time,round_idx,prefix_len,input_len,output_len,tool_wait_after_ms
0,0,0,0,512,64,100
0,0,1,576,128,64,100
0,0,2,768,128,64,0
1,200,0,0,400,48,80
1,200,1,448,100,48,0
2,500,0,0,600,64,50
2,500,1,664,120,48,50
2,500,2,784,80,48,0
"""


@pytest.fixture
def sessions(tmp_path):
    path = tmp_path / "sessions.csv"
    path.write_text(CSV)
    return path


def test_rounds_arrive_when_the_previous_round_ended_plus_its_tool_wait(sessions):
    # prefill 1,000 tokens/s of what was not matched, decode 100 tokens/s; pages of 16 tokens
    log = simulate(TraceLabSessions(sessions), ReplayConfig(pool_tokens=1 << 16, page_size=16,
                                                           cost=CostModel(1000.0, 100.0), check_invariants=True))
    got = sorted((s.session, s.round, t, m) for s, t, m in zip(log.specs, log.arrival_s, log.matched))
    expected = [(0, 0, 0.0, 0), (0, 1, 1.252, 576), (0, 2, 2.12, 768),
                (1, 0, 0.2, 0), (1, 1, 1.16, 448),
                (2, 0, 0.5, 0), (2, 1, 1.79, 656), (2, 2, 2.448, 784)]
    assert [g[:2] + (g[3],) for g in got] == [e[:2] + (e[3],) for e in expected]
    assert [g[2] for g in got] == pytest.approx([e[2] for e in expected])


def test_a_round_begins_with_the_sessions_context(sessions):
    wl = TraceLabSessions(sessions)
    r0, r1 = wl.round(0, 0), wl.round(0, 1)
    context = np.concatenate([r0.prompt_ids(), r0.output_ids()])
    assert r1.prompt_len == 704 and np.array_equal(r1.prompt_ids()[:576], context)
    assert not np.array_equal(wl.round(1, 0).prompt_ids()[:400], wl.round(2, 0).prompt_ids()[:400])
    assert load_workload(str(sessions), None).description == "tracelab:sessions.csv"


@pytest.mark.parametrize("text,line", [
    ("session_id,round_idx,prefix_len,input_len,output_len\n0,0,0,5,5\n", 1),  # no tool_wait_after_ms
    ("session_id,round_idx,prefix_len,input_len,output_len,tool_wait_after_ms\n0,0,0,5,-1,0\n", 2),
    ("session_id,round_idx,prefix_len,input_len,output_len,tool_wait_after_ms\n0,0,0,5,5,0\n0,2,10,5,5,0\n", 3),
    ("session_id,round_idx,prefix_len,input_len,output_len,tool_wait_after_ms\n0,0,0,0,5,0\n", 2),
    ("session_id,round_idx,prefix_len,input_len,output_len,tool_wait_after_ms\n0,0,x,5,5,0\n", 2),
])
def test_a_malformed_csv_is_refused_with_its_line(tmp_path, text, line):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(TraceLabError) as err:
        TraceLabSessions(path)
    assert err.value.line == line


def test_a_host_tier_recovers_what_a_small_pool_evicts(sessions):
    wl = TraceLabSessions(sessions)
    base = ReplayConfig(pool_tokens=1024, page_size=16, cost=CostModel(1000.0, 100.0), check_invariants=True)
    records = {tier: replay(wl, replace(base, host_tier_tokens=tier)) for tier in (0, 4096)}
    plain, tiered = records[0], records[4096]
    assert plain["evictions"] > 0 and plain["realized_share"] < plain["ceiling_share"]
    assert tiered["tier_hit_pages"] > 0 and tiered["host_tier_tokens"] == 4096
    assert tiered["realized_share"] == pytest.approx(tiered["ceiling_share"])


def test_a_disk_level_below_a_small_host_tier_recovers_what_the_host_tier_gives_up(sessions):
    wl = TraceLabSessions(sessions)
    base = ReplayConfig(pool_tokens=1024, page_size=16, cost=CostModel(1000.0, 100.0), check_invariants=True,
                        host_tier_tokens=256)
    host, both = (replay(wl, replace(base, disk_tier_tokens=d)) for d in (0, 4096))
    assert host["disk_tier_hit_pages"] == 0 and host["realized_share"] < host["ceiling_share"]
    assert both["disk_tier_hit_pages"] > 0 and both["disk_tier_tokens"] == 4096
    assert both["tier_hit_pages"] == host["tier_hit_pages"]  # the host level gives back what it did alone
    assert both["realized_share"] == pytest.approx(both["ceiling_share"])
    with pytest.raises(InvalidRequest):
        ReplayConfig(disk_tier_tokens=-1)


def test_the_cli_replays_with_host_and_disk_tiers(sessions, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert cli_main(["replay", str(sessions), "--pool-tokens", "1024", "--page-size", "16", "--host-tier-tokens",
                     "256", "--disk-tier-tokens", "4096", "--store-at", "teardown", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert (record["host_tier_tokens"], record["disk_tier_tokens"]) == (256, 4096)
    assert record["disk_tier_hit_pages"] > 0
