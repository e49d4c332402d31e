"""The replay ceiling against an independent brute-force count and against the real manager."""

import json

import numpy as np
import pytest

from mmcache import AllocationManager, CacheConfig
from mmcache.replay import AgentSessions, MooncakeTrace, SessionParams, ceiling_matches
from mmcache.replay.sessions import Dist
from mmcache.replay.simulate import replay_fingerprint

BLOCK = 16


def write_trace(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def random_trace(seed, n=40, block=BLOCK):
    """Conversations that extend earlier ones, share a system block, or repeat a prompt exactly."""
    rng = np.random.default_rng(seed)
    records, convs, next_id = [], [], 1
    for i in range(n):
        kind = rng.integers(3)
        if kind == 0 or not convs:
            blocks = [0] + list(range(next_id, next_id + int(rng.integers(1, 4))))
            next_id += len(blocks)
        elif kind == 1:
            base = convs[int(rng.integers(len(convs)))]
            extra = int(rng.integers(1, 3))
            blocks = base + list(range(next_id, next_id + extra))
            next_id += extra
        else:
            blocks = list(convs[int(rng.integers(len(convs)))])
        convs.append(blocks)
        # Lengths cut the last block anywhere, including exactly at a page boundary (the keep-one cap).
        length = (len(blocks) - 1) * block + int(rng.integers(1, block + 1))
        records.append({"timestamp": i * 10, "input_length": length, "output_length": int(rng.integers(0, 3 * block)),
                        "hash_ids": blocks})
    return records


def brute_force_ceiling(seqs, page_size):
    """For each request, the longest page-aligned common prefix of its prompt with any earlier final sequence,
    capped to leave one prompt token, from the token ids alone."""
    out = []
    for i, (prompt, _) in enumerate(seqs):
        best = 0
        for prev_prompt, prev_output in seqs[:i]:
            final = np.concatenate([prev_prompt, prev_output])
            n = min(len(prompt), len(final))
            diff = np.flatnonzero(prompt[:n] != final[:n])
            lcp = int(diff[0]) if len(diff) else n
            best = max(best, lcp // page_size)
        out.append(min(best, (len(prompt) - 1) // page_size) * page_size)
    return np.asarray(out)


def unlimited_pool_ceiling(specs, page_size):
    """The same bound run through the real manager over a pool no trace can fill."""
    pages = sum(-(-(s.prompt_len + s.output_len) // page_size) for s in specs)
    m = AllocationManager(CacheConfig(num_pages=pages, page_size=page_size), replay_fingerprint(page_size))
    out = []
    for i, s in enumerate(specs):
        res = m.admit(i, s.prompt_ids(), s.media())
        m.reserve(i, s.prompt_len - res.matched_tokens + s.output_len)
        m.commit(i, np.concatenate([s.prompt_ids()[res.matched_tokens:], s.output_ids()]))
        m.teardown(i)
        out.append(res.matched_tokens)
    assert m.metrics.evicted_pages == 0
    return np.asarray(out)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("page_size", [4, 8, 16])
def test_mooncake_ceiling_equals_brute_force(tmp_path, seed, page_size):
    trace = MooncakeTrace(write_trace(tmp_path / "t.jsonl", random_trace(seed)), block_tokens=BLOCK)
    specs = [s for _, s in trace.initial()]
    got = ceiling_matches(specs, page_size)
    want = brute_force_ceiling([(s.prompt_ids(), s.output_ids()) for s in specs], page_size)
    assert want.sum() > 0
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, unlimited_pool_ceiling(specs, page_size))


def small_sessions(**overrides):
    params = dict(seed=3, sessions=5, concurrency=2, system_prompt_tokens=20,
                  task_tokens=Dist("lognormal", 12, 0.5, 3, 40), turns=Dist("lognormal", 4, 0.5, 1, 8),
                  output_tokens=Dist("lognormal", 9, 0.7, 1, 30), tool_output_tokens=Dist("lognormal", 7, 1.0, 1, 30),
                  tool_latency_s=Dist("constant", 0.5))
    params.update(overrides)
    return AgentSessions(SessionParams(**params))


@pytest.mark.parametrize("page_size", [4, 16])
def test_sessions_ceiling_equals_brute_force(page_size):
    work = small_sessions()
    specs = [work.turn(s, k) for s in range(len(work.sessions)) for k in range(len(work.sessions[s].outputs))]
    got = ceiling_matches(specs, page_size)
    want = brute_force_ceiling([(s.prompt_ids(), s.output_ids()) for s in specs], page_size)
    assert want.sum() > 0
    np.testing.assert_array_equal(got, want)


def test_grouped_ceiling_only_sees_its_own_group(tmp_path):
    trace = MooncakeTrace(write_trace(tmp_path / "t.jsonl", random_trace(7)), block_tokens=BLOCK)
    specs = [s for _, s in trace.initial()]
    groups = [i % 3 for i in range(len(specs))]
    got = ceiling_matches(specs, 8, groups=groups)
    for g in range(3):
        idx = [i for i in range(len(specs)) if groups[i] == g]
        want = brute_force_ceiling([(specs[i].prompt_ids(), specs[i].output_ids()) for i in idx], 8)
        np.testing.assert_array_equal(got[idx], want)
    assert got.sum() < ceiling_matches(specs, 8).sum()
