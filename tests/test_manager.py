"""Allocation manager behaviour: salts, extras, eviction order, suspension, windowing, threads, bad input."""

import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mmcache import (AllocationFailed, AllocationManager, CacheConfig, DuplicateRequest, Fingerprint,
                     InvalidRequest, MediaItem, RequestStateError, UnknownRequest, make_manager, media_digest)
from mmcache.index import PrefixIndex
from mmcache.manager import ROOTS_KEPT
from mmcache.pool import KVSpec, PagePool

P = 4


def make(num_pages=32, **kw):
    """The manager the mode asks for (``make_manager``: a ``ShadowedManager`` for mode shadow)."""
    return make_manager(CacheConfig(num_pages=num_pages, page_size=P, **kw), Fingerprint.for_tests(P))


def run(mgr, rid, prompt, gen=(), media=(), salt=b""):
    """Admit, prefill the rest, decode ``gen``, tear down; returns the matched tokens."""
    prompt = np.asarray(prompt)
    res = mgr.admit(rid, prompt, media, salt)
    mgr.reserve(rid, len(prompt) - res.matched_tokens + len(gen))
    mgr.commit(rid, prompt[res.matched_tokens:])
    for t in gen:
        mgr.commit(rid, [t])
    mgr.teardown(rid)
    mgr.check_invariants()
    return res.matched_tokens


def test_hit_reuses_pages_and_leaves_one_token_to_compute():
    mgr = make()
    prompt = np.arange(1, 17)  # exactly 4 pages
    assert run(mgr, "a", prompt) == 0
    res = mgr.admit("b", prompt)
    assert res.matched_tokens == 12, "the last page is recomputed so the first output has logits"
    view = mgr.state("b")
    assert view.seq_len == 12 and view.position_id_start == 0
    assert (mgr.pool.refcount[view.page_indices] == 2).all()  # index + request
    assert mgr.pages_held("b") == 3 and mgr.pages_held("absent") == 0 and mgr.pages_held(["unhashable"]) == 0
    mgr.abort("b")
    mgr.check_invariants()
    assert mgr.pages_held("b") == 0


def test_generated_pages_are_stored_and_extend_the_chain():
    mgr = make()
    run(mgr, "turn1", np.arange(1, 7), gen=[50, 51, 52, 53])  # 6 + 4 = 10 written... the last is not fed
    second = np.concatenate([np.arange(1, 7), [50, 51, 52, 53], [9, 9, 9]])
    res = mgr.admit("turn2", second)
    assert res.matched_tokens == 8  # two full pages of the previous turn, one of them generated
    mgr.abort("turn2")


def test_salts_isolate_and_equal_salts_share():
    mgr = make()
    prompt = np.arange(1, 14)
    run(mgr, "a", prompt, salt=b"tenant-a")
    assert run(mgr, "b", prompt, salt=b"tenant-b") == 0
    assert run(mgr, "c", prompt) == 0
    assert run(mgr, "d", prompt, salt=b"tenant-a") == 12
    assert run(mgr, "e", prompt, salt="tenant-b") == 12


def test_media_digest_stops_matching_at_the_first_placeholder_page():
    mgr = make()
    placeholder = 7
    prompt = np.array([1, 2, 3, 4, 5, 6] + [placeholder] * 8 + [8, 9, 10, 11, 12])
    cat, dog = media_digest(b"cat.png"), media_digest(b"dog.png")
    run(mgr, "cat", prompt, media=[MediaItem(cat, 6)])
    # same tokens, another image: page 0 matches, page 1 (first placeholder at 6) does not
    assert run(mgr, "dog", prompt, media=[MediaItem(dog, 6)]) == 4
    # same image again: matches through the image
    assert run(mgr, "cat2", prompt, media=[MediaItem(cat, 6)]) == 16
    # no media at all behind the same placeholder tokens: no match past page 0
    assert run(mgr, "none", prompt) == 4


def test_live_request_never_fails_because_of_cached_data_and_cold_tails_go_first():
    mgr = make(num_pages=12)
    # Three runs of 4 full pages each fill the pool with cached pages.
    for i, rid in enumerate(["old", "mid", "new"]):
        run(mgr, rid, np.arange(100 * i, 100 * i + 16))
    assert mgr.index.size == 12 and mgr.pool.num_free == 0
    stamps_old = mgr.index.stamp.copy()
    mgr.admit("hit-mid", np.arange(100, 116))  # touches "mid": now "old" is the least recently used run
    mgr.abort("hit-mid")
    big = mgr.admit("big", np.arange(1000, 1004))
    assert big.matched_tokens == 0
    mgr.reserve("big", 4 * P)  # 4 pages: exactly one cold run must go, as one batch
    assert mgr.metrics.evicted_pages == 4 and mgr.metrics.eviction_batches == 1
    survivors = {int(p) for p in np.flatnonzero(mgr.index.in_index)}
    old_pages = set(np.argsort(stamps_old)[:4].tolist())  # the first run's pages were stamped first
    assert not old_pages & survivors and len(survivors) == 8
    # now take the whole pool for the live request: everything cached goes, nothing fails
    mgr.reserve("big", 12 * P)
    assert mgr.index.size == 0 and mgr.pool.num_free == 0
    assert mgr.metrics.alloc_failures_cache_held == 0
    with pytest.raises(AllocationFailed) as e:
        mgr.reserve("big", 13 * P)
    assert e.value.pages_short == 1 and mgr.metrics.alloc_failures_uncached == 1
    assert len(mgr.state("big").page_indices) == 12
    mgr.abort("big")
    mgr.check_invariants()
    assert mgr.pool.num_free == 12


def test_eviction_stops_at_a_page_another_owner_holds():
    mgr = make(num_pages=10)
    shared = np.arange(1, 9)  # two pages
    run(mgr, "a", np.concatenate([shared, [20, 21, 22, 23, 24, 25, 26, 27, 28]]))  # pages s0 s1 a2 a3
    mgr.admit("holder", np.concatenate([shared, [5]]))  # holds s0, s1
    before = mgr.index.size
    mgr.admit("x", [7])
    mgr.reserve("x", (mgr.pool.num_free + 1) * P)  # one page short: the cold tail a3, a2 goes as one batch
    assert mgr.metrics.eviction_batches == 1 and mgr.metrics.evicted_pages == 2
    assert mgr.index.size == before - 2
    assert mgr.state("holder").matched_tokens == 8
    held = mgr.state("holder").page_indices
    assert mgr.index.in_index[held].all()
    for rid in ("holder", "x"):
        mgr.abort(rid)
    mgr.check_invariants()


def test_suspension_keeps_shared_pages_and_resume_restores():
    mgr = make()
    prompt = np.arange(1, 18)
    run(mgr, "a", prompt)  # 4 pages cached
    mgr.admit("b", prompt)
    mgr.reserve("b", 5 + 6)
    mgr.commit("b", prompt[16:])
    mgr.commit("b", [40, 41, 42, 43, 44])
    shared = mgr.state("b").page_indices[:4]
    own = mgr.state("b").page_indices[4:]
    rc = mgr.pool.refcount.copy()
    offloaded = []
    ids = mgr.suspend("b", offload=lambda pages: offloaded.append(pages.copy()))
    assert ids.tolist() == prompt.tolist() + [40, 41, 42, 43, 44]
    assert sorted(offloaded[0].tolist()) == sorted(own.tolist())
    assert (mgr.pool.refcount[shared] == rc[shared] - 1).all() and (mgr.pool.refcount[shared] >= 1).all()
    assert (mgr.pool.refcount[own] == 0).all()
    with pytest.raises(RequestStateError):
        mgr.reserve("b", 1)
    mgr.check_invariants()
    res = mgr.resume("b")
    assert res.restored_tokens == 16 and res.pending_ids.tolist() == [17, 40, 41, 42, 43, 44]
    mgr.reserve("b", 6)
    mgr.commit("b", res.pending_ids)
    assert mgr.state("b").seq_len == 22
    mgr.teardown("b")
    mgr.check_invariants()


def test_windowed_label_stores_only_its_protected_prefix():
    mgr = make()
    prompt = np.arange(1, 26)  # 6 full pages + 1
    mgr.admit("w", prompt)
    mgr.protect_prefix("w", 8)
    mgr.reserve("w", len(prompt))
    mgr.commit("w", prompt)
    released = mgr.release_oldest("w", 2)  # pages 2 and 3
    assert released.tolist() == mgr.pool.free_pages()[-2:][::-1].tolist() or (mgr.pool.refcount[released] == 0).all()
    with pytest.raises(InvalidRequest):
        mgr.release_oldest("w", 3)  # pages 4, 5 are left; the tail page is never released
    assert mgr.teardown("w") == 2
    mgr.check_invariants()
    assert mgr.admit("again", prompt).matched_tokens == 8
    mgr.abort("again")


def test_release_oldest_decrements_shared_pages():
    mgr = make()
    prompt = np.arange(1, 18)
    run(mgr, "a", prompt)
    mgr.admit("w", prompt)  # 4 seeded pages
    mgr.protect_prefix("w", 4)
    pages = mgr.state("w").page_indices
    mgr.release_oldest("w", 1)  # page 1: shared with the index -> decremented, stays cached
    assert mgr.pool.refcount[pages[1]] == 1 and mgr.index.in_index[pages[1]]
    mgr.teardown("w")
    mgr.check_invariants()


def test_store_at_prefill_shares_pages_with_a_running_request():
    for store_at, expect_hit, expect_forfeit in (("teardown", 0, 16), ("prefill", 16, 0)):
        mgr = make(store_at=store_at)
        prompt = np.arange(1, 18)
        mgr.admit("first", prompt)
        mgr.reserve("first", len(prompt))
        mgr.commit("first", prompt)  # still running
        res = mgr.admit("second", prompt)
        assert (res.matched_tokens, res.forfeit_tokens) == (expect_hit, expect_forfeit), store_at
        mgr.check_invariants()
        for rid in ("first", "second"):
            mgr.teardown(rid)
        mgr.check_invariants()


def test_whole_match_takes_a_whole_page_prompt_to_its_end_and_opens_a_fresh_page():
    mgr = make()
    prompt = np.arange(1, 17)  # exactly 4 pages
    assert run(mgr, "a", prompt) == 0
    prepared = mgr.prepare(prompt)
    assert mgr.peek(prepared) == 12 and mgr.peek(prepared, whole=True) == 16
    assert mgr.match_cap(16) == 3 and mgr.match_cap(16, whole=True) == 4 and mgr.match_cap(17, whole=True) == 4
    res = mgr.admit("b", prepared, whole=True)
    assert res.matched_tokens == 16 and mgr.state("b").seq_len == 16
    assert (mgr.pool.refcount[mgr.state("b").page_indices] == 2).all()  # all shared: no write may go there
    mgr.check_invariants()
    pages = mgr.reserve("b", 0)  # the last token's logits: nothing to write, nothing taken
    assert len(pages) == 4 and mgr.pool.num_free == 32 - 4
    pages = mgr.reserve("b", 1)  # the first decode opens a fresh page, owned by "b" alone
    assert len(pages) == 5 and mgr.pool.refcount[pages[4]] == 1
    mgr.commit("b", [99])
    mgr.check_invariants()
    mgr.teardown("b")
    mgr.check_invariants()
    assert mgr.metrics.hit_tokens == 16 and mgr.metrics.lookup_pages == 3 + 4


def test_whole_match_of_a_prompt_that_ends_inside_a_page_is_the_usual_match():
    mgr = make()
    prompt = np.arange(1, 19)  # 4 pages and 2 tokens
    assert run(mgr, "a", prompt) == 0
    res = mgr.admit("b", prompt, whole=True)
    assert res.matched_tokens == 16 and mgr.state("b").seq_len == 16  # the last two tokens are computed
    mgr.abort("b")
    mgr.check_invariants()
    shadow = make(mode="shadow")
    run(shadow, "a", np.arange(1, 17))
    res = shadow.admit("b", np.arange(1, 17), whole=True)
    assert res.matched_tokens == 0 and shadow.shadow.metrics.hit_tokens == 16  # the mirror counts the whole match


def test_shadow_mode_counts_without_retaining():
    mgr = make(mode="shadow")
    prompt = np.arange(1, 18)
    assert run(mgr, "a", prompt) == 0
    assert run(mgr, "b", prompt) == 0
    assert mgr.index.size == 0 and mgr.pool.num_free == 32
    assert mgr.shadow.metrics.hit_tokens == 16 and mgr.metrics.hit_tokens == 0


def test_shadow_sees_one_request_s_calls_in_the_order_they_took_effect():
    # The mirror ran after the lock was released: a teardown from another thread, landing between an admit and
    # its mirror, raised UnknownRequest from the shadow (the real teardown had succeeded) and the shadow then
    # admitted the request for good.
    mgr = make(mode="shadow")
    entered, go = threading.Event(), threading.Event()
    real_admit = mgr.shadow.admit

    def slow_admit(*args, **kwargs):
        entered.set()
        go.wait(10)
        return real_admit(*args, **kwargs)

    mgr.shadow.admit = slow_admit
    admitting = threading.Thread(target=mgr.admit, args=("r", np.arange(1, 10)))
    admitting.start()
    assert entered.wait(10)
    failures = []

    def tear_down():
        try:
            mgr.teardown("r")
        except Exception as e:  # pragma: no cover - the defect
            failures.append(e)

    ending = threading.Thread(target=tear_down)
    ending.start()
    ending.join(0.3)  # time for the teardown to overtake the admit's mirror, if it can
    go.set()
    admitting.join(10)
    ending.join(10)
    assert failures == [] and mgr.num_requests == 0 and mgr.shadow.num_requests == 0
    mgr.check_invariants()
    mgr.shadow.check_invariants()


def test_off_mode_frees_everything():
    mgr = make(mode="off")
    prompt = np.arange(1, 18)
    run(mgr, "a", prompt)
    assert run(mgr, "b", prompt) == 0 and mgr.pool.num_free == 32 and mgr.metrics.lookups == 0


def _state(mgr):
    return (mgr.pool.refcount.copy(), mgr.pool.free_pages().tolist(), mgr.index.in_index.copy(),
            {rid: (mgr.state(rid).page_indices.tolist(), mgr.state(rid).seq_len) for rid in list(mgr._requests)})


def _same(a, b):
    return all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(a, b))


@pytest.mark.parametrize("call, error", [
    (lambda m: m.reserve("nobody", 1), UnknownRequest),
    (lambda m: m.commit("nobody", [1]), UnknownRequest),
    (lambda m: m.teardown("nobody"), UnknownRequest),
    (lambda m: m.abort("nobody"), UnknownRequest),
    (lambda m: m.suspend("nobody"), UnknownRequest),
    (lambda m: m.resume("live"), RequestStateError),
    (lambda m: m.admit("live", [1, 2]), DuplicateRequest),
    (lambda m: m.admit("new", []), InvalidRequest),
    (lambda m: m.admit("new", [1.5, 2.5]), InvalidRequest),
    (lambda m: m.admit("new", [[1, 2]]), InvalidRequest),
    (lambda m: m.admit("new", [-3]), InvalidRequest),
    (lambda m: m.admit("new", [1, True]), InvalidRequest),
    (lambda m: m.admit(["not", "hashable"], [1, 2]), InvalidRequest),
    (lambda m: m.state(["not", "hashable"]), UnknownRequest),  # these three raised TypeError
    (lambda m: m.reserve(["not", "hashable"], 1), UnknownRequest),
    (lambda m: m.resume(["not", "hashable"]), UnknownRequest),
    (lambda m: m.teardown(["not", "hashable"]), UnknownRequest),
    (lambda m: m.admit("new", [1, 2], media=[MediaItem(b"d" * 32, 5)]), InvalidRequest),
    (lambda m: m.admit("new", [1, 2], media=None), InvalidRequest),  # these three raised TypeError
    (lambda m: m.admit("new", [1, 2], media=MediaItem(b"d" * 32, 0)), InvalidRequest),
    (lambda m: m.suspend("live", offload=5), InvalidRequest),
    (lambda m: m.admit("new", [[1], [2, 3]]), InvalidRequest),  # a raw numpy ValueError
    (lambda m: m.admit("new", [np.True_, 3]), InvalidRequest),  # was accepted as [1, 3]
    (lambda m: m.commit("live", [[1], [2, 3]]), InvalidRequest),
    (lambda m: m.reserve("live", -1), InvalidRequest),
    (lambda m: m.reserve("live", 2.0), InvalidRequest),
    (lambda m: m.commit("live", np.arange(1, 40)), InvalidRequest),  # beyond the reserved pages
    (lambda m: m.commit("live", [5, 5]), InvalidRequest),  # differs from the prompt
    (lambda m: m.commit("live", np.array([1.0, 2.0])), InvalidRequest),
    (lambda m: m.protect_prefix("live", 999), InvalidRequest),
    (lambda m: m.release_oldest("live", 5), InvalidRequest),
    (lambda m: m.admit("new", [1, 2], whole="yes"), InvalidRequest),
    (lambda m: m.peek(m.prepare([1, 2]), whole=1), InvalidRequest),
])
def test_bad_input_raises_typed_error_and_changes_nothing(call, error):
    mgr = make()
    run(mgr, "cached", np.arange(1, 14))
    mgr.admit("live", np.arange(1, 10))
    mgr.reserve("live", 2)
    before = _state(mgr)
    with pytest.raises(error):
        call(mgr)
    assert _same(before, _state(mgr))
    mgr.check_invariants()


def test_the_index_multimap_never_fills_up_with_tombstones():
    # Evicting left tombstones that only a later removal could clear; fresh inserts took the remaining EMPTY
    # slots, and the next lookup of a missing name probed the full table forever (under the manager's lock).
    mgr = AllocationManager(CacheConfig(num_pages=4, page_size=1), Fingerprint.for_tests(page_size=1))
    index = mgr.index
    rng = np.random.default_rng(0)
    for i in range(40):
        ids = rng.integers(0, 1000, size=4)
        mgr.admit(i, ids)
        mgr.reserve(i, 4 - mgr.state(i).seq_len)
        mgr.commit(i, ids[mgr.state(i).seq_len:])
        mgr.teardown(i)
        mgr.check_invariants()  # live + tombstone slots stay within 3/4 of the table
        assert (index._vals == -1).sum() >= index._cap // 4
        if i % 3 == 0:
            mgr.clear_cache()
    assert mgr.peek(mgr.prepare([5, 6, 7])) == 0  # a miss ends


def test_roots_no_entry_or_live_request_uses_are_forgotten_and_their_ids_reused():
    # Every distinct salt kept its root material (about 365 bytes) in the index for good.
    mgr = make(num_pages=64)
    cached = np.arange(1, 14)
    run(mgr, "cached", cached, salt=b"kept")  # a root entries start from
    mgr.admit("live", np.arange(1, 10), salt=b"live")  # a root a live request uses
    for i in range(3 * ROOTS_KEPT):
        run(mgr, i, [7, 8, 9], salt=f"tenant-{i}")  # no full page: nothing is cached under these roots
    assert len(mgr.index.roots) <= 2 * ROOTS_KEPT and max(mgr.index.roots.values()) <= 2 * ROOTS_KEPT
    mgr.check_invariants()
    assert run(mgr, "again", cached, salt=b"kept") == 12  # the kept root's pages still hit
    mgr.reserve("live", 9)
    mgr.commit("live", np.arange(1, 10))
    mgr.teardown("live")
    assert run(mgr, "live-again", np.arange(1, 10), salt=b"live") == 8  # stored under the live request's root
    assert run(mgr, "other", np.arange(1, 10), salt=b"tenant-5") == 0  # a forgotten salt shares nothing
    mgr.check_invariants()


def test_double_teardown_is_an_error():
    mgr = make()
    run(mgr, "a", [1, 2, 3])
    with pytest.raises(UnknownRequest):
        mgr.teardown("a")


def test_config_validation():
    for bad in (dict(num_pages=0), dict(num_pages=4, mode="sometimes"), dict(num_pages=4, store_at="never"),
                dict(num_pages=4, page_size=-1), dict(num_pages=True), dict(num_pages=4, page_size=True)):
        with pytest.raises(InvalidRequest):
            CacheConfig(**bad)
    with pytest.raises(InvalidRequest):
        AllocationManager(CacheConfig(num_pages=4, page_size=8), Fingerprint.for_tests(4))


@pytest.mark.parametrize("make_it", [
    lambda: KVSpec(1, 1, 1, dtype="nn"),  # TypeError from torch.zeros before
    lambda: KVSpec(1, 1, 1, dtype="nope"),  # AttributeError
    lambda: KVSpec(1, 1, 1, dtype="int32"),
    lambda: KVSpec(-1, 1, 1),  # RuntimeError
    lambda: KVSpec(1, True, 1),
    lambda: KVSpec(1, 1, 1, device="bogus"),  # RuntimeError
    lambda: Fingerprint("m", "none", "none", 4, tp_rank="0"),  # TypeError
    lambda: Fingerprint(5, "none", "none", 4),
    lambda: AllocationManager(CacheConfig(num_pages=4, page_size=4), None),  # AttributeError
    lambda: AllocationManager(CacheConfig(num_pages=4, page_size=4), Fingerprint.for_tests(4), kv_spec="float32"),
    lambda: AllocationManager(CacheConfig(num_pages=10**13, page_size=4), Fingerprint.for_tests(4)),  # past int32
    lambda: AllocationManager(CacheConfig(num_pages=2**20, page_size=2**30),  # MemoryError
                              Fingerprint.for_tests(2**30)),
    lambda: AllocationManager(CacheConfig(num_pages=2**20, page_size=2**42),  # numpy ValueError
                              Fingerprint.for_tests(2**42)),
])
def test_bad_pool_settings_are_typed_errors(make_it):
    with pytest.raises(InvalidRequest):
        make_it()


def test_pools_past_int32_page_ids_or_memory_are_typed_errors():
    # 2**31 pages raised OverflowError from the int32 free stack; an index too large for memory raised numpy's
    # MemoryError unwrapped.
    assert CacheConfig(num_pages=2**31 - 1).num_pages == 2**31 - 1  # the largest (only the config is built)
    with pytest.raises(InvalidRequest, match="at most 2147483647"):
        CacheConfig(num_pages=2**31)
    with pytest.raises(InvalidRequest, match="at most 2147483647"):
        PagePool(2**31, 1)
    with pytest.raises(InvalidRequest, match="index over"):
        PrefixIndex(SimpleNamespace(num_pages=10**13, page_size=4))  # PrefixIndex reads only these


def test_a_kv_spec_names_its_dtype_by_name_or_object():
    for dtype in ("bfloat16", torch.float32):
        mgr = AllocationManager(CacheConfig(num_pages=2, page_size=4), Fingerprint.for_tests(4),
                                KVSpec(1, 1, 2, dtype=dtype, device=torch.device("cpu")))
        assert mgr.pool.kv.dtype == (torch.bfloat16 if dtype == "bfloat16" else dtype)


def test_threads_admitting_and_tearing_down_keep_invariants():
    mgr = make(num_pages=64)
    shared = np.arange(1, 13)
    errors = []

    def worker(w):
        rng = np.random.default_rng(w)
        try:
            for i in range(150):
                rid = (w, i)
                prompt = np.concatenate([shared[: rng.integers(0, 13)], rng.integers(20, 23, size=rng.integers(1, 6))])
                prep = mgr.prepare(prompt)  # names outside the lock
                res = mgr.admit(rid, prep)
                try:
                    mgr.reserve(rid, len(prompt) - res.matched_tokens + 2)
                except AllocationFailed:
                    mgr.abort(rid)
                    continue
                mgr.commit(rid, prompt[res.matched_tokens:])
                mgr.commit(rid, [int(rng.integers(0, 3))])
                (mgr.teardown if i % 3 else mgr.abort)(rid)
        except Exception as e:  # surfaced below with its thread
            errors.append((w, e))

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    mgr.check_invariants()
    assert mgr.num_requests == 0
    assert mgr.metrics.hit_tokens > 0
    mgr.clear_cache()
    assert mgr.pool.num_free == 64


def test_requeued_abort_takes_the_lookup_back_so_a_retry_counts_once():
    mgr = make(mode="shadow")
    prompt = np.arange(1, 18)
    run(mgr, "a", prompt)
    before = (mgr.metrics.as_dict(), mgr.shadow.metrics.as_dict(), list(mgr.shadow.metrics.per_request_matched))
    mgr.admit("retry", prompt)
    mgr.abort("retry", requeue=True)
    assert (mgr.metrics.as_dict(), mgr.shadow.metrics.as_dict(),
            list(mgr.shadow.metrics.per_request_matched)) == before
    assert run(mgr, "retry", prompt) == 0  # real pages: mode shadow seeds nothing
    assert mgr.shadow.metrics.lookups == 2 and mgr.shadow.metrics.hit_tokens == 16
    mgr.admit("gone", prompt)
    mgr.abort("gone")  # a plain abort keeps its lookup
    assert mgr.shadow.metrics.lookups == 3


def _frozen(mgr):
    """Everything peek must leave alone: owner counts, index entries and recency, roots, metrics, requests."""
    return (_state(mgr), mgr.index.stamp.copy(), mgr.index._clock, dict(mgr.index.roots), mgr.metrics.as_dict(),
            list(mgr.metrics.per_request_matched), dict(mgr._inflight))


def _unchanged(a, b):
    return _same(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2:] == b[2:]


def test_peek_predicts_admit_and_changes_nothing():
    mgr = make(store_at="prefill")
    shared = np.arange(1, 13)  # three pages
    media = [MediaItem(b"m" * 32, 5)]
    cases = [np.concatenate([shared, [40, 41, 42]]), shared, shared[:5], np.arange(50, 60)]
    cold = mgr.prepare(cases[0])
    before = _frozen(mgr)
    assert mgr.peek(cold) == 0  # an unseen root: nothing indexed, and the root stays unregistered
    assert _unchanged(before, _frozen(mgr))
    run(mgr, "a", np.concatenate([shared, [30, 31, 32, 33, 34]]))
    mgr.admit("live", np.arange(70, 82))  # running, its pages published at prefill as they fill
    mgr.reserve("live", 12)
    mgr.commit("live", np.arange(70, 78))
    cases += [np.arange(70, 82), mgr.prepare(shared, media)]
    for i, prompt in enumerate(cases):
        prepared = prompt if not isinstance(prompt, np.ndarray) else mgr.prepare(prompt)
        before = _frozen(mgr)
        seen = mgr.peek(prepared)
        assert _unchanged(before, _frozen(mgr)), i
        assert seen == mgr.admit(("b", i), prepared).matched_tokens, i
        mgr.abort(("b", i))
    assert [mgr.peek(mgr.prepare(p)) for p in (cases[0], shared, np.arange(70, 82))] == [12, 8, 8]
    assert mgr.peek(mgr.prepare(shared, salt=b"other")) == 0
    mgr.check_invariants()


def test_peek_is_zero_without_a_seeding_index_and_refuses_bad_input():
    prompt = np.arange(1, 18)
    for mode in ("off", "shadow"):
        mgr = make(mode=mode)
        run(mgr, "a", prompt)
        assert mgr.peek(mgr.prepare(prompt)) == 0 == mgr.admit("b", prompt).matched_tokens, mode
    mgr = make()
    run(mgr, "a", prompt)
    with pytest.raises(InvalidRequest):
        mgr.peek(prompt)  # token ids, not a prepared prompt
    with pytest.raises(InvalidRequest):
        mgr.peek(make(mode="off").prepare(prompt))  # named for another mode
    with pytest.raises(InvalidRequest):
        mgr.peek(AllocationManager(CacheConfig(num_pages=8, page_size=8), Fingerprint.for_tests(8)).prepare(prompt))


def test_a_bad_salt_is_refused_with_the_request_it_belongs_to():
    # The namer refused it without the request id that every other error of ``prepare`` carries.
    m = make()
    for salt in (7, "tenant-\ud800"):
        with pytest.raises(InvalidRequest, match="salt") as e:
            m.prepare([1, 2, 3, 4, 5], salt=salt, request_id="r1")
        assert e.value.request_id == "r1" and str(e.value).startswith("request 'r1': ")
    m.check_invariants()
