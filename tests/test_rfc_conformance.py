"""Where the core follows the RFC's lock, recency, metric and scoping rules (issue 40, item 3).

* a commit names the pages it completes outside the lock, and its in-lock work grows with those pages;
* pages are stamped when they enter the index and when a request holding them is aborted, so eviction goes
  least recent run first, tail first;
* the shadow mirror runs outside the live lock, in the order the calls took effect;
* ``hit_share`` counts first admissions only;
* a tensor-parallel manager, or one whose KV dtype has not passed the bit-exact gate, does not reuse.
"""

import threading

import numpy as np
import pytest
import torch

from mmcache import AllocationManager, CacheConfig, Fingerprint, InvalidRequest, make_manager
from mmcache.manager import REUSE_KV_DTYPES, reuse_blocker
from mmcache.pool import KVSpec

P = 4


def make(num_pages=32, fingerprint=None, kv_spec=None, **kw):
    """The manager the mode asks for (``make_manager``: a ``ShadowedManager`` for mode shadow)."""
    return make_manager(CacheConfig(num_pages=num_pages, page_size=P, **kw),
                             fingerprint or Fingerprint.for_tests(P), kv_spec)


def run(mgr, rid, prompt, gen=(), readmission=False):
    prompt = np.asarray(prompt)
    res = mgr.admit(rid, prompt, readmission=True) if readmission else mgr.admit(rid, prompt)
    mgr.reserve(rid, len(prompt) - res.matched_tokens + len(gen))
    mgr.commit(rid, prompt[res.matched_tokens:])
    for t in gen:
        mgr.commit(rid, [t])
    mgr.teardown(rid)
    mgr.check_invariants()
    return res.matched_tokens


# ---- commits: names outside the lock, work per completed page ------------------------------------------
class CountingDict(dict):
    checks = 0

    def __contains__(self, key):
        CountingDict.checks += 1
        return super().__contains__(key)


@pytest.mark.parametrize("store_at", ["teardown", "prefill"])
def test_a_commit_names_generated_pages_outside_the_lock(store_at):
    mgr = make(store_at=store_at)
    prompt, gen = np.arange(1, 10), list(range(50, 71))  # 2 full prompt pages, then 5 generated pages fill
    real_names, locked = mgr.namer.names, []

    def names(*args, **kwargs):
        locked.append(mgr._lock.locked())
        return real_names(*args, **kwargs)

    mgr.namer.names = names
    mgr.admit("r", prompt)
    mgr.reserve("r", len(prompt) + len(gen))
    mgr.commit("r", prompt)
    for t in gen:
        mgr.commit("r", [t])
    assert len(locked) >= 5 and not any(locked)
    expected = mgr.prepare(np.concatenate([prompt, gen])).names.tolist()
    assert mgr._requests["r"].names == expected
    mgr.teardown("r")
    assert run(mgr, "again", np.concatenate([prompt, gen, [1]])) == 28  # every full page was stored


def test_a_commit_s_in_lock_checks_follow_the_pages_it_completes_not_the_context():
    mgr = make(num_pages=80)
    prompt = np.arange(1, 4 * 64 + 1) % 97  # 64 full pages of context
    mgr.admit("r", prompt)
    mgr.reserve("r", len(prompt) + 16)
    mgr.commit("r", prompt)
    mgr._requests["r"].registered = CountingDict(mgr._requests["r"].registered)
    CountingDict.checks = 0
    for t in range(16):  # 16 decode commits complete 4 pages
        mgr.commit("r", [t])
    assert CountingDict.checks <= 4 * 2  # a commit looked at every unpublished page: 16 * 64 checks
    mgr.teardown("r")
    mgr.check_invariants()


def test_names_computed_ahead_for_a_state_that_moved_are_not_used():
    mgr = make()
    prompt = np.arange(1, 6)
    mgr.admit("r", prompt)
    mgr.reserve("r", 16)
    mgr.commit("r", prompt)
    stale = mgr._name_ahead("r", np.asarray([9, 9, 9], dtype=np.int32))  # completes page 1 from seq_len 5
    mgr.commit("r", [7])
    mgr._name_ahead = lambda rid, ids: stale  # as if another thread had committed in between
    mgr.commit("r", [8, 9])
    mgr._name_ahead = AllocationManager._name_ahead.__get__(mgr)
    assert mgr._requests["r"].names == mgr.prepare(np.concatenate([prompt, [7, 8, 9]])).names.tolist()
    mgr.teardown("r")
    mgr.check_invariants()


# ---- recency stamps on insert and abort ------------------------------------------------------------------
def _run_pages(mgr, prompt) -> list:
    prep = mgr.prepare(prompt)
    root = mgr.index.root_parent(prep.root_material)
    return mgr.index.match(prep.names, prep.ids, prep.extras, root).tolist()


def test_pages_published_at_prefill_are_stamped_so_an_older_run_goes_first():
    mgr = make(num_pages=9, store_at="prefill")
    old, new = np.arange(1, 14), np.arange(100, 113)  # 3 full pages and a token each
    run(mgr, "old", old)
    run(mgr, "old-again", old)  # a hit: "old" was used twice, but before "new" came
    mgr.admit("new", new)
    mgr.reserve("new", len(new))
    mgr.commit("new", new)  # publishes 3 pages, stamped now: more recent than "old"
    mgr.suspend("new")  # the request keeps nothing; its published pages stay cached, unstamped since
    new_pages = _run_pages(mgr, new)
    mgr.admit("x", [5])
    mgr.reserve("x", (mgr.pool.num_free + 1) * P)  # one page short: one cold run must go
    assert mgr.index.in_index[new_pages].all() and not _run_pages(mgr, old)
    mgr.abort("new")
    mgr.abort("x")
    mgr.check_invariants()


def test_an_aborted_request_s_pages_are_stamped_so_runs_go_least_recent_first_and_tail_first():
    mgr = make(num_pages=13, store_at="prefill")
    a, b, c = np.arange(1, 14), np.arange(100, 113), np.arange(200, 213)
    run(mgr, "a", a)  # oldest
    mgr.admit("b", b)  # publishes at prefill, then runs on while "c" ends
    mgr.reserve("b", len(b))
    mgr.commit("b", b)
    run(mgr, "c", c)
    b_pages = _run_pages(mgr, b)
    mgr.abort("b")  # "b" used its pages last
    stamps = mgr.index.stamp[b_pages]
    assert (np.diff(stamps) < 0).all()  # tail first: the tail has the oldest stamp of the run
    assert stamps.min() > mgr.index.stamp[_run_pages(mgr, c)].max()
    mgr.admit("x", [5])
    mgr.reserve("x", (mgr.pool.num_free + 4) * P)  # more than one run: "a", then "c"
    assert not _run_pages(mgr, a) and not _run_pages(mgr, c) and _run_pages(mgr, b) == b_pages
    mgr.reserve("x", (mgr.pool.num_free + len(mgr.state("x").page_indices) + 1) * P)
    assert mgr.index.size == 0
    mgr.abort("x")
    mgr.check_invariants()


def test_a_hit_run_of_a_shared_prefix_loses_its_tail_before_its_head():
    mgr = make(num_pages=8)
    run(mgr, "a", np.arange(1, 18))  # 4 pages: h0 h1 t2 t3
    mgr.admit("holder", np.arange(1, 10))  # holds h0 h1
    mgr.admit("x", [5])
    mgr.reserve("x", (mgr.pool.num_free + 1) * P)
    assert _run_pages(mgr, np.arange(1, 18)) == mgr.state("holder").page_indices.tolist()
    for rid in ("holder", "x"):
        mgr.abort(rid)
    mgr.check_invariants()


# ---- the shadow mirror ---------------------------------------------------------------------------------
def test_the_shadow_mirror_runs_outside_the_live_lock():
    mgr = make(mode="shadow")
    held = []
    for name in ("admit", "reserve", "commit", "teardown", "abort"):
        real = getattr(mgr.shadow, name)

        def spy(*args, _real=real, **kwargs):
            held.append(mgr.real._lock.locked() or mgr._order.locked())
            return _real(*args, **kwargs)

        setattr(mgr.shadow, name, spy)
    run(mgr, "a", np.arange(1, 18), gen=[3, 4])
    mgr.admit("b", np.arange(1, 18))
    mgr.abort("b")
    assert len(held) >= 7 and not any(held)
    assert mgr.shadow.metrics.hit_tokens == 16


def test_a_live_call_takes_effect_while_the_mirror_of_another_is_still_running():
    mgr = make(mode="shadow")
    entered, go = threading.Event(), threading.Event()
    real_admit = mgr.shadow.admit

    def slow_admit(request_id, *args, **kwargs):
        if request_id == "slow":
            entered.set()
            go.wait(60)
        return real_admit(request_id, *args, **kwargs)

    mgr.shadow.admit = slow_admit
    first = threading.Thread(target=mgr.admit, args=("slow", np.arange(1, 10)))
    first.start()
    assert entered.wait(30)
    second = threading.Thread(target=mgr.admit, args=("quick", np.arange(20, 30)))
    second.start()
    took_effect = False
    for _ in range(1000):  # the live lock is free: "quick" is admitted at once (waits 10 s, well below the 60)
        if "quick" in mgr:
            took_effect = True
            break
        threading.Event().wait(0.01)
    go.set()
    first.join(60)
    second.join(60)
    assert took_effect
    assert "slow" in mgr.shadow and "quick" in mgr.shadow  # both mirrored, in order, after the slow one
    for rid in ("slow", "quick"):
        mgr.abort(rid)
    mgr.check_invariants()
    assert mgr.shadow.num_requests == 0


# ---- hit_share -----------------------------------------------------------------------------------------
def test_hit_share_counts_first_admissions_only():
    mgr = make()
    prompt = np.arange(1, 18)
    assert run(mgr, "a", prompt) == 0
    assert run(mgr, "a", prompt, readmission=True) == 16  # preempted, re-admitted against its own pages
    m = mgr.metrics
    assert m.lookups == 2 and m.hit_tokens == 16 and m.readmissions == 1
    assert m.hit_share == 0.0 and m.as_dict()["hit_share"] == 0.0
    assert [r for r, _ in m.per_request_matched] == ["a"]
    assert run(mgr, "b", prompt) == 16
    assert m.hit_share == pytest.approx(16 / 34)
    mgr.admit("c", prompt, readmission=True)
    mgr.abort("c", requeue=True)  # taken back out: counts as if never admitted
    assert (m.lookups, m.readmissions, m.hit_share) == (3, 1, pytest.approx(16 / 34))
    with pytest.raises(InvalidRequest, match="readmission"):
        mgr.admit("d", prompt, readmission=1)
    assert "d" not in mgr


def test_hit_share_of_the_shadow_counts_first_admissions_only():
    mgr = make(mode="shadow")
    prompt = np.arange(1, 18)
    run(mgr, "a", prompt)
    run(mgr, "a", prompt, readmission=True)
    assert mgr.shadow.metrics.readmissions == 1 and mgr.shadow.metrics.hit_share == 0.0


def test_an_engine_s_hit_share_leaves_out_a_preempted_request_s_readmission():
    from mmcache.engine import Engine, EngineConfig, SamplingParams
    from mmcache.presets.text import build_model

    torch.set_num_threads(1)
    model, tok = build_model("tiny", "float32")
    rng = np.random.default_rng(0)
    ps = [rng.integers(2, 512, size=int(rng.integers(40, 70))).tolist() for _ in range(2)]
    eng = Engine(model, tok, EngineConfig(page_size=16, num_pages=10))
    eng.generate(ps, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    m = eng.metrics()
    assert m["engine"]["preemptions"] == 1 and m["main"]["lookups"] == 3 and m["main"]["hit_pages"] >= 3
    assert m["main"]["readmissions"] == 1 and m["main"]["hit_share"] == 0.0  # both first admissions were cold


# ---- tensor parallel and KV dtypes: reuse off until their gates exist -----------------------------------
def test_a_tensor_parallel_manager_neither_seeds_nor_stores():
    fp = Fingerprint(model_digest="m", kv_dtype="none", attention_backend="none", page_size=P, tp_rank=1, tp_size=2)
    mgr = make(fingerprint=fp)
    prompt = np.arange(1, 18)
    assert run(mgr, "a", prompt) == 0 and run(mgr, "b", prompt) == 0
    assert mgr.mode == "off" and "tensor parallel" in mgr.reuse_off
    assert mgr.index.size == 0 and mgr.pool.num_free == 32 and mgr.metrics.lookups == 0
    shadow = make(fingerprint=fp, mode="shadow")  # a mirror shares no page: it still measures
    run(shadow, "a", prompt)
    run(shadow, "b", prompt)
    assert shadow.shadow.metrics.hit_tokens == 16 and shadow.reuse_off is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn, "float8_e5m2"])
def test_a_kv_dtype_without_the_bit_exact_gate_runs_with_reuse_off(dtype):
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    fp = Fingerprint(model_digest="m", kv_dtype=name, attention_backend="none", page_size=P)
    for mgr in (make(fingerprint=fp, kv_spec=KVSpec(1, 1, 2, dtype=dtype)), make(fingerprint=fp),
                make(kv_spec=KVSpec(1, 1, 2, dtype=dtype))):
        prompt = np.arange(1, 18)
        assert run(mgr, "a", prompt) == 0 and run(mgr, "b", prompt) == 0
        assert mgr.mode == "off" and name in mgr.reuse_off and mgr.index.size == 0


@pytest.mark.parametrize("dtype", REUSE_KV_DTYPES)
def test_the_gated_kv_dtypes_reuse(dtype):
    fp = Fingerprint(model_digest="m", kv_dtype=dtype, attention_backend="none", page_size=P)
    mgr = make(fingerprint=fp, kv_spec=KVSpec(1, 1, 2, dtype=dtype))
    prompt = np.arange(1, 18)
    assert run(mgr, "a", prompt) == 0 and run(mgr, "b", prompt) == 16
    assert mgr.reuse_off is None and reuse_blocker(fp, None) is None
    assert REUSE_KV_DTYPES == ("float32", "bfloat16")  # the ones tests/test_engine_exact.py holds bit-exact
