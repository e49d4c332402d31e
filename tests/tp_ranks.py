"""One rank of the tensor-parallel scenarios of tests/test_tensor_parallel.py (run as a script, one process a rank).

    python tests/tp_ranks.py SCENARIO RANK PORT OUT_DIR

Rank 0 writes what it saw to OUT_DIR/result.json (the other ranks answer its queries); every rank builds the
same engines in the same order and rank 1 follows each until rank 0 stops it.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from mmcache.engine import EngineConfig, SamplingParams, tp_group
from mmcache.errors import GroupFailed
from mmcache.presets.text import engine_from_preset

WORLD = 2
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def _prompts() -> dict:
    rng = np.random.default_rng(7)
    p1 = rng.integers(5, 500, 70).tolist()  # 4 full pages of 16 and 6 tokens
    p2 = p1[:32] + rng.integers(5, 500, 30).tolist()  # shares 2 pages with p1
    many = [rng.integers(5, 500, int(n)).tolist() for n in rng.integers(40, 90, 6)]
    return {"p1": p1, "p2": p2, "many": many}


def _engine(phase: dict):
    return engine_from_preset("tiny", "float32", EngineConfig(**phase))


EXACT = dict(page_size=16, schedule="serial", prefill_chunk_tokens=16, num_pages=64, tensor_parallel_size=WORLD)
PHASES = [
    dict(EXACT),                                    # cache on, exact schedule
    dict(EXACT, cache_mode="off"),                  # cache off, same schedule
    dict(EXACT),                                    # one rank's index holds less
    dict(page_size=16, num_pages=12, max_num_seqs=6, tensor_parallel_size=WORLD),  # preemption and aborts
]


def engine_scenario(out: Path) -> dict:
    pr = _prompts()
    got: dict = {}
    # Phases 1 and 2: the same requests with the cache on and off, every rank keeping a digest of its logits.
    for name, phase in (("on", PHASES[0]), ("off", PHASES[1])):
        e = _engine(phase)
        f = e.fingerprint
        got.setdefault("fingerprints", [(f.tp_rank, f.tp_size, f.head_slice, f.model_digest)] +
                       e.leader.query("fingerprint")[1:])
        e.leader.query("record_logits")
        first, second = e.generate([pr["p1"]], GREEDY)[0], e.generate([pr["p1"]], GREEDY)[0]
        got[name] = {"tokens": [first.output_ids, second.output_ids], "matched": second.matched_tokens,
                     "digests": e.leader.query("logits_digest"), "agreements": e.leader.query("agreements")}
        got[name]["agreements"][0] = {k: a.summary() for k, a in e.leader.agreements.items()}
        e.stop_group()
    # Phase 3: rank 1 alone drops its cached pages, then learns two pages of p1 back from p2.
    e = _engine(PHASES[2])
    e.generate([pr["p1"]], GREEDY)
    cleared = e.leader.query("clear_cache")
    p2 = e.generate([pr["p2"]], GREEDY)[0]
    p1 = e.generate([pr["p1"]], GREEDY)[0]
    e.check_invariants()
    got["evicted"] = {"cleared": cleared, "p2_matched": p2.matched_tokens, "p1_matched": p1.matched_tokens,
                      "p1_tokens": p1.output_ids, "invariants": e.leader.query("invariants")}
    e.stop_group()
    # Phase 4: a pool too small for everyone (preemptions) and an abort in the middle.
    e = _engine(PHASES[3])
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ids = [e.add_request(p, sp) for p in pr["many"]]
    events, steps = [], 0
    while e.has_unfinished():
        events += e.step()
        steps += 1
        if steps == 6:
            e.abort(ids[1])
    e.check_invariants()
    reasons = {ev.request_id: ev.output.finish_reason for ev in events if ev.finished}
    e.clear_cache()  # replayed on every rank
    state = e.leader.query("state")
    state[0] = {"main": {"requests": e.managers["main"].num_requests, "free_pages": e.managers["main"].pool.num_free}}
    got["pressure"] = {"reasons": [reasons[i] for i in ids], "preemptions": e.scheduler.preemptions,
                       "state": state, "invariants": e.leader.query("invariants")}
    e.stop_group()
    # The same requests on one process (tp=1), for the tokens.
    ref = engine_from_preset("tiny", "float32", EngineConfig(**dict(EXACT, tensor_parallel_size=1)))
    got["tp1"] = {"p1": ref.generate([pr["p1"]], GREEDY)[0].output_ids,
                  "p2": ref.generate([pr["p2"]], GREEDY)[0].output_ids}
    got["p2_tokens"] = p2.output_ids
    return got


KILL = dict(page_size=16, num_pages=64, tensor_parallel_size=WORLD, tensor_parallel_timeout_s=5)


def kill_scenario(out: Path) -> dict:
    """Rank 0 decodes; the test kills or stops rank 1 once ``decoding`` appears; the request must end with the
    group's error (within the group's timeout of 5 s for a rank that stops answering), and later requests at once."""
    e = _engine(KILL)
    rid = e.add_request(_prompts()["p1"], SamplingParams(max_tokens=100000, temperature=0.0, ignore_eos=True))
    events, killed_at = [], None
    while e.has_unfinished():
        events += e.step()
        if killed_at is None and any(not ev.finished for ev in events):
            (out / "decoding").write_text("1")
            killed_at = time.monotonic()
            while not (out / "killed").exists():
                time.sleep(0.05)
    ended = time.monotonic()
    done = [ev for ev in events if ev.finished and ev.request_id == rid][0]
    after = e.generate([[1, 2, 3]], GREEDY)[0]
    e.check_invariants()
    return {"held": {label: m.num_requests for label, m in e.managers.items()},
            "free": e.managers["main"].pool.num_free + e.managers["main"].index.size,"reason": done.output.finish_reason, "error": type(done.output.error).__name__,
            "message": str(done.output.error), "seconds_after_kill": ended - killed_at,
            "tokens": len(done.output.output_ids), "after": [after.finish_reason, type(after.error).__name__],
            "fatal": type(e.fatal).__name__}


def follow_all(phases: int) -> None:
    for phase in PHASES[:phases]:
        _engine(phase).follow()


def main() -> None:
    scenario, rank, port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timeout)
    if scenario == "engine":
        tp_group.Channel.FRAME = 256  # most messages then take a second broadcast for what the frame leaves out
        if rank:
            follow_all(len(PHASES))
        else:
            (out / "result.json").write_text(json.dumps(engine_scenario(out)))
    elif scenario == "kill":
        if rank:
            _engine(KILL).follow()
        else:
            (out / "result.json").write_text(json.dumps(kill_scenario(out)))
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    tp_group.leave()


if __name__ == "__main__":
    try:
        main()
    except GroupFailed as e:
        print(f"rank failed: {e}", file=sys.stderr)
        sys.exit(3)
