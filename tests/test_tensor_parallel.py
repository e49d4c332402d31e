"""Tensor parallelism over torch.distributed (gloo): two ranks of the tiny model, each a process
(tests/tp_ranks.py), with their own pools and the agreement on matched lengths."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mmcache.engine import EngineConfig
from mmcache.engine.attention import UnsupportedModel
from mmcache.engine.config import EngineConfigError
from mmcache.engine import tensor_parallel
from mmcache.presets.text import build_model, engine_from_preset

RANKS = Path(__file__).with_name("tp_ranks.py")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(scenario: str, out: Path) -> list[subprocess.Popen]:
    port = _port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return [subprocess.Popen([sys.executable, str(RANKS), scenario, str(rank), str(port), str(out)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(2)]


def _finish(procs: list[subprocess.Popen], timeout: float = 240) -> list[tuple[int, str]]:
    out = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError("a rank hung")
        out.append((p.returncode, text))
    return out


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp")
    ranks = _finish(_start("engine", out))
    for rank, (code, text) in enumerate(ranks):
        assert code == 0, f"rank {rank} exited {code}:\n{text[-3000:]}"
    return json.loads((out / "result.json").read_text())


def test_tp2_greedy_tokens_equal_tp1(engine_run):
    assert engine_run["on"]["tokens"][0] == engine_run["tp1"]["p1"]
    assert engine_run["p2_tokens"] == engine_run["tp1"]["p2"]


def test_cache_on_and_off_give_bit_identical_logits_on_every_rank(engine_run):
    on, off = engine_run["on"], engine_run["off"]
    assert on["matched"] == 64 and off["matched"] == 0  # the second request hit its 4 pages with the cache on
    assert on["tokens"] == off["tokens"]
    assert on["digests"] == off["digests"]  # per rank: rank 0's and rank 1's logits of both requests
    assert on["digests"][0] == on["digests"][1]  # and the ranks computed the same logits


def test_each_rank_names_its_slice_in_its_fingerprint(engine_run):
    (r0, n0, s0, d0), (r1, n1, s1, d1) = engine_run["fingerprints"]
    assert (r0, n0, list(s0)) == (0, 2, [0, 2]) and (r1, n1, list(s1)) == (1, 2, [2, 4])
    assert d0 == d1  # the whole model's digest: one model, two slices


def test_each_admission_agrees_once_on_every_rank(engine_run):
    calls = [engine_run["on"]["agreements"][r]["main"]["calls"] for r in range(2)]
    assert calls == [2, 2]
    assert all(engine_run["on"]["agreements"][r]["main"]["median_ms"] > 0 for r in range(2))
    assert engine_run["on"]["agreements"][1]["catchup_median_ms"] > 0  # the follower's way to its agreement
    assert [engine_run["off"]["agreements"][r]["main"]["calls"] for r in range(2)] == [0, 0]


def test_a_page_missing_on_one_rank_agrees_on_the_shorter_match(engine_run):
    ev = engine_run["evicted"]
    assert ev["cleared"][1] > 0  # rank 1 dropped its pages of p1
    assert ev["p2_matched"] == 0  # rank 0 held p2's first two pages, rank 1 none: the group seeded none
    assert ev["p1_matched"] == 32  # rank 0 holds 4 pages of p1, rank 1 the 2 that p2 wrote back: 2 agreed
    assert ev["p1_tokens"] == engine_run["tp1"]["p1"]  # outputs unchanged
    assert ev["invariants"] == [None, None]


def test_owner_counts_balance_after_preemption_and_abort_on_every_rank(engine_run):
    pr = engine_run["pressure"]
    assert pr["preemptions"] > 0
    assert pr["reasons"][1] == "abort" and pr["reasons"].count("length") == 5
    assert pr["invariants"] == [None, None]
    for rank in range(2):  # after the cache was cleared on every rank, every page is free again
        assert pr["state"][rank]["main"]["requests"] == 0
        assert pr["state"][rank]["main"]["free_pages"] == 12


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_rank_killed_or_stopped_mid_step_fails_the_request_instead_of_hanging(tmp_path, how):
    procs = _start("kill", tmp_path)
    deadline = time.monotonic() + 120
    while not (tmp_path / "decoding").exists():
        assert time.monotonic() < deadline and procs[0].poll() is None, procs[0].communicate()[0][-3000:]
        time.sleep(0.05)
    procs[1].send_signal(getattr(signal, how))
    if how == "SIGKILL":
        procs[1].wait()
    (tmp_path / "killed").write_text("1")
    try:
        code, text = _finish(procs[:1], timeout=90)[0]
    finally:
        procs[1].kill()
        procs[1].wait()
    assert code == 0, text[-3000:]
    got = json.loads((tmp_path / "result.json").read_text())
    assert got["reason"] == "error" and got["error"] == "GroupFailed", got
    assert got["after"] == ["error", "GroupFailed"] and got["fatal"] == "GroupFailed"
    assert got["tokens"] < 100000
    assert got["held"] == {"main": 0} and got["free"] == 64  # rank 0 holds no page for the failed request
    if how == "SIGSTOP":  # nothing closed a connection: the group's timeout (5 s) ended the wait
        assert "timeout" in got["message"].lower() or "timed out" in got["message"].lower(), got["message"]


def test_tensor_parallel_needs_a_process_group():
    with pytest.raises(EngineConfigError, match="torchrun"):
        engine_from_preset("tiny", "float32", EngineConfig(page_size=16, num_pages=8, tensor_parallel_size=2))


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_tensor_parallel_size_is_checked(bad):
    with pytest.raises(EngineConfigError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=bad)


def test_a_model_whose_heads_do_not_split_is_refused_before_anything_is_cut():
    model = build_model("tiny")[0]  # 4 heads, 2 KV heads
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UnsupportedModel, match="do not split over 4"):
        tensor_parallel.shard(model, 0, 4)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_shard_keeps_each_ranks_heads_and_columns():
    full = build_model("tiny")[0]
    parts = [build_model("tiny")[0] for _ in range(2)]
    slices = [tensor_parallel.shard(m, r, 2) for r, m in enumerate(parts)]
    assert slices == [(0, 2), (2, 4)]
    a = [m.model.layers[0].self_attn for m in parts]
    f = full.model.layers[0].self_attn
    assert torch.equal(torch.cat([x.q_proj.weight for x in a]), f.q_proj.weight)
    assert torch.equal(torch.cat([x.k_proj.weight for x in a]), f.k_proj.weight)
    assert torch.equal(torch.cat([x.o_proj.weight for x in a], dim=1), f.o_proj.weight)
    mlp = [m.model.layers[0].mlp for m in parts]
    assert torch.equal(torch.cat([x.down_proj.weight for x in mlp], dim=1), full.model.layers[0].mlp.down_proj.weight)
    tc = parts[1].config
    assert (tc.num_attention_heads, tc.num_key_value_heads, tc.head_dim) == (2, 1, 16)
