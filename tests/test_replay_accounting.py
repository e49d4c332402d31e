"""Replay accounting: realized share, in-flight forfeit, queueing, rejections, stalls, and the shadow path."""

import heapq
from dataclasses import replace

import numpy as np
import pytest

from mmcache import AllocationManager, CacheConfig, InvalidRequest, ShadowedManager
from mmcache.replay import CostModel, MooncakeTrace, ReplayConfig, run_sweep, simulate, sweep_configs
from mmcache.replay.ceiling import ceiling_matches
from mmcache.replay.report import CeilingCache, build_record
from mmcache.replay.sessions import Dist
from mmcache.replay.simulate import ReplayStalled, replay_fingerprint
from mmcache.router import RouterConfig
from test_replay_ceiling import BLOCK, random_trace, small_sessions, write_trace

BIG = 1 << 16


def mooncake(tmp_path, records, name="t.jsonl"):
    return MooncakeTrace(write_trace(tmp_path / name, records), block_tokens=BLOCK)


def rec(t_ms, blocks, length, output):
    return {"timestamp": t_ms, "input_length": length, "output_length": output, "hash_ids": blocks}


# A: long-running, holds blocks 1-3. B arrives while A runs and wants blocks 1-4. C comes after both.
# D holds blocks 1,2,6 (1,2 already stored); E arrives while D runs and wants 1,2,6,7.
OVERLAP = [rec(0, [1, 2, 3], 48, 400), rec(1, [1, 2, 3, 4], 64, 4), rec(100_000, [1, 2, 3, 4, 5], 80, 0),
           rec(200_000, [1, 2, 6], 48, 400), rec(200_001, [1, 2, 6, 7], 64, 4)]


def test_known_in_flight_overlap_gives_the_exact_forfeit(tmp_path):
    trace = mooncake(tmp_path, OVERLAP)
    log = simulate(trace, ReplayConfig(pool_tokens=4096, page_size=4, store_at="teardown", check_invariants=True))
    assert log.matched == [0, 0, 64, 32, 32]
    assert log.forfeit == [0, 48, 0, 0, 16]
    np.testing.assert_array_equal(ceiling_matches(log.specs, 4), [0, 48, 64, 32, 48])
    eager = simulate(trace, ReplayConfig(pool_tokens=4096, page_size=4, store_at="prefill", check_invariants=True))
    assert eager.matched == [0, 48, 64, 32, 48]
    assert eager.forfeit == [0, 0, 0, 0, 0]


def workloads(tmp_path):
    yield mooncake(tmp_path, random_trace(11, n=60))
    yield small_sessions(sessions=8, concurrency=4)


@pytest.mark.parametrize("page_size", [4, 8])
def test_pool_holding_the_working_set_loses_only_the_forfeit(tmp_path, page_size):
    for work in workloads(tmp_path):
        # Fast prefill, slow decode: many requests overlap in flight.
        cost = CostModel(prefill_tps=1e6, decode_tps=5)
        late = simulate(work, ReplayConfig(pool_tokens=BIG, page_size=page_size, store_at="teardown", cost=cost,
                                           check_invariants=True))
        ceiling = ceiling_matches(late.specs, page_size)
        np.testing.assert_array_equal(CeilingCache().get(late), ceiling)  # the names the replay kept
        matched, forfeit = np.asarray(late.matched), np.asarray(late.forfeit)
        assert forfeit.sum() > 0 and late.managers[0].metrics.evicted_pages == 0
        np.testing.assert_array_equal(matched + forfeit, ceiling)
        eager = simulate(work, ReplayConfig(pool_tokens=BIG, page_size=page_size, store_at="prefill", cost=cost,
                                            check_invariants=True))
        assert sum(eager.forfeit) == 0
        np.testing.assert_array_equal(eager.matched, ceiling_matches(eager.specs, page_size))
        record = build_record(late, ceiling, "w")
        assert record["ceiling_share"] == pytest.approx(record["realized_share"] + record["forfeit_share"])
        assert record["residual_share"] == pytest.approx(0, abs=1e-12)


def test_stalls_from_cached_data_are_zero_at_every_pool_in_a_sweep(tmp_path):
    trace = mooncake(tmp_path, random_trace(12, n=60))
    base = ReplayConfig(page_size=4, replicas=3, cost=CostModel(prefill_tps=1e5, decode_tps=20), check_invariants=True)
    records = run_sweep(trace, sweep_configs(base, [256, 512, 1024, 4096], ["teardown", "prefill"]))
    assert len(records) == 4 * 3 * 2
    assert all(r["stalls"] == 0 for r in records)
    assert sum(r["evictions"] for r in records) > 0
    assert sum(r["queue"]["waited_requests"] for r in records) > 0
    assert all(r["requests"] == 60 for r in records)


def test_stall_counter_sees_cached_pages_that_eviction_left(tmp_path, monkeypatch):
    """The stall check above is live: with eviction disabled, cached pages block live requests."""
    import mmcache.manager

    monkeypatch.setattr(mmcache.manager, "evict", lambda index, pool, wanted, **_: (0, 0))
    trace = mooncake(tmp_path, random_trace(12, n=60))
    with pytest.raises(ReplayStalled) as stalled:
        simulate(trace, ReplayConfig(pool_tokens=256, page_size=4, cost=CostModel(1e5, 20)))
    assert stalled.value.stalls > 0


def test_live_requests_filling_the_pool_wait_in_order(tmp_path):
    # Each request needs 24 of the pool's 32 pages: only one runs at a time.
    records = [rec(i, [10 * i + 1, 10 * i + 2, 10 * i + 3], 48, 48) for i in range(4)]
    log = simulate(mooncake(tmp_path, records), ReplayConfig(pool_tokens=128, page_size=4, check_invariants=True))
    assert log.waited == [False, True, True, True]
    assert not any(log.rejected)
    for i in range(1, 4):
        assert log.admit_s[i] == log.end_s[i - 1]
    m = log.managers[0].metrics
    assert m.alloc_failures_cache_held == 0 and m.alloc_failures_uncached >= 3
    record = build_record(log, ceiling_matches(log.specs, 4), "w")
    assert record["queue"]["waited_requests"] == 3 and record["stalls"] == 0


def test_request_larger_than_the_pool_is_rejected_and_counted(tmp_path):
    records = [rec(0, [1, 2], 32, 8), rec(10, [1, 2, 3, 4, 5, 6, 7, 8, 9], 144, 8), rec(5000, [1, 2, 3], 40, 8)]
    log = simulate(mooncake(tmp_path, records), ReplayConfig(pool_tokens=128, page_size=4))
    assert log.rejected == [False, True, False]
    assert log.matched == [0, 0, 32]
    record = build_record(log, ceiling_matches(log.specs, 4), "w")
    assert record["rejected"] == 1 and record["prompt_tokens"] == 32 + 144 + 40
    assert record["realized_share"] == pytest.approx(32 / 216)


def test_hot_prefix_spreads_past_the_threshold(tmp_path):
    # Every request shares its first two blocks, so affinity at that depth prefers one replica.
    records = [rec(i, [1, 2, 100 + i], 40, 40) for i in range(24)]
    trace = mooncake(tmp_path, records)
    base = ReplayConfig(pool_tokens=160, page_size=4, replicas=4, route_depth_tokens=32, check_invariants=True)
    pinned = simulate(trace, replace(base, route_min_load=1000))
    assert len(set(pinned.replica)) == 1
    spread = simulate(trace, replace(base, route_min_load=2))
    counts = np.bincount(spread.replica, minlength=4)
    assert (counts > 0).sum() == 4
    assert sum(spread.waited) < sum(pinned.waited)
    ttft = lambda log: np.asarray(log.admit_s) - np.asarray(log.arrival_s) + np.asarray(log.prefill_s)
    assert ttft(spread).max() < ttft(pinned).max()


def test_affinity_keeps_the_single_replica_share_and_random_routing_loses_it():
    work = small_sessions(sessions=16, concurrency=8, turns=Dist("constant", 6))
    share, dilution = {}, {}
    for replicas, routing in [(1, "affinity"), (4, "affinity"), (4, "random")]:
        log = simulate(work, ReplayConfig(pool_tokens=BIG, page_size=4, replicas=replicas, routing=routing,
                                          route_depth_tokens=40))
        record = build_record(log, ceiling_matches(log.specs, 4), "w")
        share[replicas, routing] = record["realized_share"]
        dilution[replicas, routing] = record["dilution_share"]
    assert dilution[1, "affinity"] == 0
    # Affinity only misses the shared system prompt once per replica (and a session whose first prompt is
    # shorter than the routing depth once); random routing scatters every session's turns.
    assert dilution[4, "affinity"] < 0.05 < 0.25 < dilution[4, "random"]
    assert share[4, "affinity"] >= 0.95 * share[1, "affinity"]
    assert share[4, "random"] < 0.95 * share[1, "affinity"]


def test_replay_is_the_shadow_modes_code_path(tmp_path):
    """Driving an engine-side manager in mode 'shadow' with the replay's schedule gives the replay's counts."""
    trace = mooncake(tmp_path, random_trace(13, n=50))
    config = ReplayConfig(pool_tokens=512, page_size=4, cost=CostModel(1e4, 1000))
    log = simulate(trace, config)
    assert not any(log.waited) and sum(log.forfeit) > 0 and log.managers[0].metrics.evicted_pages > 0
    # The replay's schedule: admissions and ends in time order, ends first at equal times.
    events = []
    for i, spec in enumerate(log.specs):
        heapq.heappush(events, (log.admit_s[i], 1, i, spec))
        heapq.heappush(events, (log.end_s[i], 0, i, spec))
    # The engine's own pages behave as mode 'off' (no sharing), so they need a larger pool than the shadow,
    # which must have the replay's size.
    engine = ShadowedManager(AllocationManager(CacheConfig(num_pages=4 * config.num_pages, page_size=4, mode="off"),
                                               replay_fingerprint(4)),
                             AllocationManager(CacheConfig(num_pages=config.num_pages, page_size=4, mode="on"),
                                               replay_fingerprint(4), reuse_gates=False))
    while events:
        _, kind, i, spec = heapq.heappop(events)
        if kind == 1:
            engine.admit(spec.request_id, spec.prompt_ids())
            engine.reserve(spec.request_id, spec.prompt_len + spec.output_len)
            engine.commit(spec.request_id, spec.prompt_ids())
        else:
            engine.commit(spec.request_id, spec.output_ids())
            engine.teardown(spec.request_id)
    shadow = engine.shadow.metrics
    assert engine.shadow_failures == 0
    assert [t for _, t in shadow.per_request_matched] == log.matched
    assert shadow.forfeit_tokens == sum(log.forfeit)
    assert shadow.evicted_pages == log.managers[0].metrics.evicted_pages


def test_the_managers_count_each_served_request_once_as_the_run_log_does(tmp_path):
    # A head that waited for pages was aborted without requeue=True, so each failed admission stayed in its
    # manager's lookups and per-request records: 571 lookups for 288 served requests on a Mooncake prefix.
    trace = mooncake(tmp_path, random_trace(12, n=60))
    log = simulate(trace, ReplayConfig(pool_tokens=256, page_size=4, replicas=2, cost=CostModel(1e5, 20),
                                       check_invariants=True))
    assert sum(log.waited) > 0 and not any(log.rejected)
    replica = np.asarray(log.replica)
    for r, manager in enumerate(log.managers):
        m, mine = manager.metrics, np.flatnonzero(replica == r)
        assert m.lookups == len(mine) == len(m.per_request_matched)
        assert sorted(m.per_request_matched) == sorted((log.specs[i].request_id, log.matched[i]) for i in mine)
        assert m.lookup_tokens == sum(log.specs[i].prompt_len for i in mine)
        assert m.hit_tokens == sum(log.matched[i] for i in mine)
        assert m.forfeit_tokens == sum(log.forfeit[i] for i in mine)
    record = build_record(log, ceiling_matches(log.specs, 4), "w")
    hits = sum(m.metrics.hit_tokens for m in log.managers)
    assert hits / sum(m.metrics.lookup_tokens for m in log.managers) == pytest.approx(record["realized_share"])


def test_residual_is_the_gap_past_the_forfeit_and_holds_the_dilution(tmp_path):
    # The docstring called residual "the rest of the gap to the ceiling (pool size: ...)" after listing
    # dilution: with an unlimited pool and random routing nothing is lost to pool size, yet residual equals
    # the dilution. The figure keeps its definition (RESULTS.md quotes it); the docstring now says so.
    import mmcache.replay.report as report

    trace = mooncake(tmp_path, random_trace(11, n=60))
    log = simulate(trace, ReplayConfig(pool_tokens=BIG, page_size=4, replicas=3, routing="random",
                                       store_at="prefill"))
    record = build_record(log, ceiling_matches(log.specs, 4), "w")
    assert record["evictions"] == 0 and record["queue"]["waited_requests"] == 0 and record["rejected"] == 0
    assert record["residual_share"] == pytest.approx(
        record["ceiling_share"] - record["realized_share"] - record["forfeit_share"])
    assert record["dilution_share"] > 0 and record["residual_share"] == pytest.approx(record["dilution_share"])
    documented = report.__doc__.split("``residual_share")[1].split("\n* ")[0].split("\n\n")[0]
    assert "ceiling_share - realized_share - forfeit_share" in documented and "dilution_share" in documented


def test_the_routers_fallback_is_configured_seeded_and_recorded(tmp_path):
    """Past the threshold affinity follows the router's default fallback (``deeper``: the overflow spreads by
    each request's deeper page, the same in every replay), or the runtime's random choice (seeded by ``seed``:
    the same replay twice routes alike), or the least-loaded replica; the record names which."""
    records = [rec(i, [1, 2, 100 + i], 40, 40) for i in range(24)]
    trace = mooncake(tmp_path, records)
    base = ReplayConfig(pool_tokens=160, page_size=4, replicas=4, route_depth_tokens=32, route_min_load=2,
                        check_invariants=True)
    assert base.route_fallback == RouterConfig.fallback == "deeper" and base.router().config.fallback == "deeper"
    assert (base.route_load_factor, base.route_min_load) == (2, 2) and ReplayConfig().route_min_load == 3
    deeper = simulate(trace, base)
    assert (np.bincount(deeper.replica, minlength=4) > 0).sum() == 4
    assert simulate(trace, replace(base, seed=1)).replica == deeper.replica  # no draw: the seed plays no part
    drawn_config = replace(base, route_fallback="random")
    drawn = simulate(trace, drawn_config)
    assert simulate(trace, drawn_config).replica == drawn.replica
    assert simulate(trace, replace(drawn_config, seed=1)).replica != drawn.replica
    least = simulate(trace, replace(base, route_fallback="least_loaded"))
    assert (np.bincount(least.replica, minlength=4) > 0).sum() == 4
    record = build_record(least, ceiling_matches(least.specs, 4), "w")
    assert record["router"]["fallback"] == "least_loaded"
    assert build_record(deeper, ceiling_matches(deeper.specs, 4), "w")["router"]["fallback"] == "deeper"
    with pytest.raises(InvalidRequest, match="route_fallback"):
        ReplayConfig(route_fallback="nearest")
