"""The second tier (``mmcache.tier``) on its own and under the allocation manager.

* Budgets and LRU: a level holds at most its capacity; a full host level gives its least recent page to disk,
  a full disk drops its least recent page; a run put together leaves tail first.
* The disk file: in a directory of its own with owner-only permissions, removed by ``close``; a damaged,
  truncated or stale slot is refused (never read as KV) and counted.
* The cost rule: a small disk run is recomputed, a long one read in.
* Under the manager: an evicted cold tail moves down with its KV, a later admission reads it back in (ids and
  KV as written), and the page is then in the pool only; a read-in that raises returns every page it took and
  gives the unread pages back to their tier.
"""

import os
import stat

import numpy as np
import pytest
import torch

from mmcache import CacheConfig, Fingerprint, InvalidRequest
from mmcache.manager import AllocationManager
from mmcache.pool import KVSpec
from mmcache.tier import TierConfig, TierPage, Tiers, chain_digests, root_digest

P = 4
SHAPE = (1, 2, 1, P, 2)  # one page's KV: layers, key/value, kv heads, page size, head dim


def page(i: int) -> TierPage:
    return TierPage(name=1000 + i, digest=bytes([i]) * 32, ids=np.full(P, i, dtype=np.int32), extras=None)


def kv_of(i: int) -> torch.Tensor:
    return torch.full(SHAPE, float(i))


def make_tiers(tmp_path, host=3, disk=4, **kw) -> Tiers:
    kw.setdefault("recompute_tokens_per_s", 100.0)  # slow enough that the cost rule reads every disk hit in
    return Tiers(TierConfig(host_pages=host, disk_pages=disk, disk_dir=str(tmp_path) if disk else None, **kw),
                 P, SHAPE, torch.float32)


def put(tiers: Tiers, numbers) -> None:
    tiers.put([page(i) for i in numbers], torch.stack([kv_of(i) for i in numbers]))


def take(tiers: Tiers, i: int):
    run = tiers.take_run([bytes([i]) * 32], np.full(P, i, dtype=np.int32), {}, 0)
    return run[0] if run else None


def test_lru_order_and_budgets_host_then_disk_then_dropped(tmp_path):
    tiers = make_tiers(tmp_path)
    put(tiers, range(10))  # 0 is the least recent
    host, disk = tiers.level("host"), tiers.level("disk")
    assert [p.name - 1000 for p in host.entries.values()] == [7, 8, 9]
    assert [p.name - 1000 for p in disk.entries.values()] == [3, 4, 5, 6]
    assert all(tiers.where(bytes([i]) * 32) is None for i in range(3))
    assert host.metrics.evictions == 7 and disk.metrics.evictions == 3 and disk.metrics.dropped_pages == 3
    assert len(host.entries) <= host.capacity and len(disk.entries) <= disk.capacity
    tiers.check_invariants()
    # A page found again is the most recent of its level: the next overflow takes another page.
    put(tiers, [8])
    put(tiers, [10])
    assert [p.name - 1000 for p in host.entries.values()] == [9, 8, 10]
    assert [p.name - 1000 for p in disk.entries.values()] == [4, 5, 6, 7]
    # KV survives each move: the disk copy of 7 went host -> disk.
    for i, level in ((7, "disk"), (10, "host")):
        got = take(tiers, i)
        assert got.level.label == level
        dst = torch.zeros(SHAPE)
        assert tiers.read_into(got, dst) and torch.equal(dst, kv_of(i))
        tiers.finish(got)
    tiers.check_invariants()
    assert tiers.where(bytes([7]) * 32) is None  # read in: it left its tier
    tiers.close()


def test_a_run_leaves_tail_first(tmp_path):
    """Pages put as one run (tail first, as eviction gives them) leave the tier tail first."""
    tiers = make_tiers(tmp_path, host=2, disk=0)
    put(tiers, [3, 2, 1])  # the run 1 (head), 2, 3 (tail), put tail first
    assert [p.name - 1000 for p in tiers.level("host").entries.values()] == [2, 1]


def test_disk_file_is_private_and_removed_on_close(tmp_path):
    tiers = make_tiers(tmp_path, host=0, disk=2)
    disk = tiers.level("disk")
    assert os.path.dirname(disk.directory) == str(tmp_path)
    assert stat.S_IMODE(os.stat(disk.directory).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(disk.path).st_mode) == 0o600
    put(tiers, [1])
    assert os.path.getsize(disk.path) == disk.slot_bytes  # one whole page written
    tiers.close()
    assert not os.path.exists(disk.directory)


def _corrupt_flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


@pytest.mark.parametrize("damage", ["kv byte", "ids byte", "header byte", "truncated", "stale slot"])
def test_a_damaged_disk_page_is_refused_and_counted(tmp_path, damage):
    tiers = make_tiers(tmp_path, host=0, disk=3)
    put(tiers, [1, 2])
    disk = tiers.level("disk")
    victim = disk.entries[bytes([2]) * 32]
    base = victim.slot * disk.slot_bytes
    if damage == "kv byte":
        _corrupt_flip(disk.path, base + disk.slot_bytes - 1)
    elif damage == "ids byte":
        _corrupt_flip(disk.path, base + 128)
    elif damage == "header byte":
        _corrupt_flip(disk.path, base + 30)  # inside the write generation
    elif damage == "truncated":
        os.truncate(disk.path, base + disk.slot_bytes // 2)
    else:  # the other page's bytes where this one was: a whole, well-formed page of another slot
        other = disk.entries[bytes([1]) * 32]
        with open(disk.path, "r+b") as f:
            f.seek(other.slot * disk.slot_bytes)
            blob = f.read(disk.slot_bytes)
            f.seek(base)
            f.write(blob)
    got = take(tiers, 2)
    dst = torch.zeros(SHAPE)
    assert not tiers.read_into(got, dst)
    assert torch.equal(dst, torch.zeros(SHAPE))  # nothing was copied in
    tiers.finish(got)
    assert disk.metrics.corrupt_pages == 1 and disk.metrics.hits == 0
    good = take(tiers, 1)
    assert tiers.read_into(good, dst) and torch.equal(dst, kv_of(1))
    tiers.finish(good)
    tiers.check_invariants()
    tiers.close()


def test_cost_rule_recomputes_a_small_hit_from_disk(tmp_path):
    # 32 bytes of KV per page at 1 GB/s plus 1 ms; recomputing 4 tokens at 1,000 tokens/s takes 4 ms.
    slow = make_tiers(tmp_path, host=0, disk=4, recompute_tokens_per_s=1000.0)
    fast = make_tiers(tmp_path, host=0, disk=4, recompute_tokens_per_s=1e6)
    for tiers in (slow, fast):
        put(tiers, [1])
    assert take(slow, 1) is not None  # 1 ms read < 4 ms compute
    assert take(fast, 1) is None  # 1 ms read > 4 us compute
    assert fast.level("disk").metrics.skipped_pages == 1 and fast.where(bytes([1]) * 32) == "disk"
    # A host page is always read in.
    host_only = make_tiers(tmp_path, host=2, disk=0, recompute_tokens_per_s=1e12)
    put(host_only, [1])
    assert take(host_only, 1) is not None


def test_config_refusals(tmp_path):
    with pytest.raises(InvalidRequest):
        TierConfig(host_pages=-1)
    with pytest.raises(InvalidRequest):
        Tiers(TierConfig(disk_pages=2), P, (1, 2, 1, P, 2), torch.float32)  # KV on disk needs a directory


def test_a_metadata_only_disk_level_keeps_no_file_and_takes_the_host_levels_overflow(tmp_path):
    tiers = Tiers(TierConfig(host_pages=1, disk_pages=2, disk_dir=str(tmp_path), recompute_tokens_per_s=100.0), P)
    assert tiers.level("disk").fd is None and not list(tmp_path.iterdir())
    ids = np.arange(3 * P).reshape(3, P)
    digests = chain_digests(root_digest(b"r"), ids.reshape(-1), {}, 0, 3, P)
    tiers.put([TierPage(10 + i, digests[i], ids[i], None) for i in (2, 1, 0)])  # tail first: page 0 leaves last
    assert [tiers.where(d) for d in digests] == ["host", "disk", "disk"]
    tiers.put([TierPage(20, root_digest(b"other"), ids[0], None)])  # page 0 goes down, the disk's oldest out
    assert [tiers.where(d) for d in digests] == ["disk", "disk", None]
    assert tiers.level("disk").metrics.dropped_pages == 1
    run = tiers.take_run(digests, ids.reshape(-1), {}, 0)
    assert [p.name for p in run] == [10, 11] and all(tiers.read_into(p, None) for p in run)
    for p in run:
        tiers.finish(p)
    assert tiers.level("disk").metrics.hits == 2
    tiers.check_invariants()


# ---- under the manager -------------------------------------------------------------------------------------
def make_manager(tmp_path, num_pages=6, host=2, disk=3, **kw) -> AllocationManager:
    kw.setdefault("recompute_tokens_per_s", 100.0)
    spec = KVSpec(1, 1, 2)
    tiers = Tiers(TierConfig(host_pages=host, disk_pages=disk, disk_dir=str(tmp_path) if disk else None, **kw),
                  P, (1, 2, 1, P, 2), torch.float32)
    return AllocationManager(CacheConfig(num_pages=num_pages, page_size=P), Fingerprint.for_tests(P), spec,
                             tiers=tiers)


def write(mgr: AllocationManager, rid, prompt) -> None:
    """Admit, reserve and commit the whole prompt, writing KV = id + position / 1000 into each slot."""
    res = mgr.admit(rid, prompt)
    pages = mgr.reserve(rid, len(prompt) - res.matched_tokens)
    for pos in range(res.matched_tokens, len(prompt)):
        mgr.pool.kv[:, :, :, pages[pos // P], pos % P] = prompt[pos] + pos / 1000
    mgr.commit(rid, prompt[res.matched_tokens:])


def expected_kv(prompt, upto) -> torch.Tensor:
    return torch.tensor([prompt[i] + i / 1000 for i in range(upto)], dtype=torch.float32)


def held_kv(mgr, rid, upto) -> torch.Tensor:
    pages = mgr.state(rid).page_indices
    return torch.stack([mgr.pool.kv[0, 0, 0, pages[i // P], i % P, 0] for i in range(upto)])


def test_evicted_pages_move_down_and_are_read_back_in(tmp_path):
    mgr = make_manager(tmp_path)
    a = list(range(10, 23))  # 13 tokens: 3 full pages
    write(mgr, "a", a)
    mgr.teardown("a")
    assert mgr.clear_cache(demote=True) == 3
    assert len(mgr.tiers) == 3 and mgr.index.size == 0
    assert mgr.tiers.level("host").metrics.evictions == 1  # the tail went on to disk
    mgr.check_invariants()
    res = mgr.admit("b", a + [99])
    assert res.matched_tokens == 12
    assert torch.equal(held_kv(mgr, "b", 12), expected_kv(a, 12))
    assert len(mgr.tiers) == 0 and mgr.index.size == 3  # in the pool only, held by the index and the request
    m = mgr.tiers.metrics()
    assert m["host"]["hits"] == 2 and m["disk"]["hits"] == 1
    assert m["host"]["read_in_bytes"] == 2 * mgr.tiers.page_bytes
    mgr.check_invariants()
    mgr.teardown("b")
    mgr.check_invariants()


def test_a_page_published_again_leaves_its_tier(tmp_path):
    """A page the cost rule left on disk and the request recomputed and published is then in the pool only."""
    mgr = make_manager(tmp_path, host=0, disk=4, recompute_tokens_per_s=1e9)
    a = list(range(30, 39))  # 2 full pages
    write(mgr, "a", a)
    mgr.teardown("a")
    mgr.clear_cache(demote=True)
    assert len(mgr.tiers) == 2
    write(mgr, "b", a)
    assert mgr.state("b").matched_tokens == 0 and mgr.tiers.level("disk").metrics.skipped_pages == 2
    mgr.teardown("b")
    assert len(mgr.tiers) == 0 and mgr.index.size == 2
    mgr.check_invariants()


def test_a_read_in_that_raises_holds_nothing(tmp_path, monkeypatch):
    mgr = make_manager(tmp_path, num_pages=8, host=4, disk=0)
    a = list(range(40, 57))  # 4 full pages
    write(mgr, "a", a)
    mgr.teardown("a")
    write(mgr, "x", a[:5])  # holds the first page from the pool, keeps it there
    mgr.clear_cache(demote=True)
    assert len(mgr.tiers) == 3
    real = mgr.tiers.copy_in
    calls = []

    def failing(page, dst):
        calls.append(page)
        if len(calls) == 2:
            raise KeyboardInterrupt("the request went away mid read-in")
        return real(page, dst)

    monkeypatch.setattr(mgr.tiers, "copy_in", failing)
    free_before = mgr.pool.num_free
    with pytest.raises(KeyboardInterrupt):
        mgr.admit("b", a)
    assert "b" not in mgr and mgr.pool.num_free == free_before
    assert int(mgr.pool.refcount[mgr.state("x").page_indices[0]]) == 2  # x and the index, as before
    # The page being read when it raised and the one after it went back; the one read before is lost.
    assert len(mgr.tiers) == 2 and mgr.tiers.level("host").taken == 0
    mgr.check_invariants()
    monkeypatch.setattr(mgr.tiers, "copy_in", real)
    res = mgr.admit("c", a)
    assert res.matched_tokens == 4  # the pool's page; the next was lost with the failed read-in
    mgr.check_invariants()
    mgr.reserve("c", len(a) - 4)
    mgr.commit("c", a[4:])  # computes the lost page and the two after it, which its teardown stores:
    mgr.teardown("c")  # they are then in the pool only
    assert len(mgr.tiers) == 0 and mgr.index.size == 4
    mgr.check_invariants()


def test_a_damaged_disk_page_ends_the_hit_there(tmp_path):
    mgr = make_manager(tmp_path, host=0, disk=4)
    a = list(range(60, 73))  # 3 full pages
    write(mgr, "a", a)
    mgr.teardown("a")
    mgr.clear_cache(demote=True)
    disk = mgr.tiers.level("disk")
    digests = chain_digests(root_digest(mgr.namer.root_material(b"")), np.asarray(a, dtype=np.int32), {}, 0, 3, P)
    second = disk.entries[digests[1]]
    _corrupt_flip(disk.path, second.slot * disk.slot_bytes + disk.slot_bytes - 3)
    res = mgr.admit("b", a)
    assert res.matched_tokens == 4 and disk.metrics.corrupt_pages == 1
    assert torch.equal(held_kv(mgr, "b", 4), expected_kv(a, 4))
    assert mgr.tiers.where(digests[2]) == "disk"  # given back, found again once its parent is computed
    mgr.check_invariants()
    mgr.abort("b")
    mgr.check_invariants()


def test_a_deferred_read_in_is_copied_outside_the_lock_and_completed(tmp_path):
    import threading

    mgr = make_manager(tmp_path, num_pages=8, host=4, disk=0)
    a = list(range(80, 93))  # 3 full pages
    write(mgr, "a", a)
    mgr.teardown("a")
    mgr.clear_cache(demote=True)
    res = mgr.admit("b", a, defer_read_in=True)
    assert (res.matched_tokens, res.pending_tokens) == (0, 12)
    assert mgr.seq_len("b") == 0 and not mgr.read_in_ready("b")
    assert mgr.pool.num_free == 8 - 3 and mgr.tiers.level("host").taken == 3  # reserved, and held in the tier
    mgr.check_invariants()
    worker = threading.Thread(target=mgr.read_pending, args=("b",))
    worker.start()
    worker.join()
    assert mgr.read_in_ready("b") and mgr.complete_read_in("b") == 12
    assert mgr.state("b").matched_tokens == 12 and torch.equal(held_kv(mgr, "b", 12), expected_kv(a, 12))
    assert mgr.metrics.hit_tokens == 12 and mgr.tiers.metrics()["host"]["hits"] == 3
    assert mgr.complete_read_in("b") == 0  # nothing left to complete
    mgr.check_invariants()
    with pytest.raises(InvalidRequest):
        mgr.admit("c", a, defer_read_in=1)


@pytest.mark.parametrize("share", [0, 3])
def test_a_preempted_requests_pages_keep_their_share_of_the_tier(tmp_path, share):
    """With a share for preempted requests their pages, evicted, wait there while a flood of cold cache pages
    churns the host level; without one the flood pushes them out first (they are the least recent)."""
    spec = KVSpec(1, 1, 2)
    tiers = Tiers(TierConfig(host_pages=2 + 3 - share, preempt_pages=share), P, (1, 2, 1, P, 2), torch.float32)
    mgr = AllocationManager(CacheConfig(num_pages=6, page_size=P), Fingerprint.for_tests(P), spec, tiers=tiers)
    a = list(range(100, 113))  # 3 full pages
    write(mgr, "a", a)
    mgr.teardown("a", preempted=True)
    for i in range(6):  # the flood: 3 pages each, stored and later evicted
        write(mgr, f"f{i}", [200 + 20 * i + j for j in range(13)])
        mgr.teardown(f"f{i}")
        mgr.check_invariants()
    mgr.clear_cache(demote=True)
    res = mgr.admit("a again", a)
    assert res.matched_tokens == (12 if share else 0)
    if share:
        assert tiers.metrics()["preempted"]["hits"] == 3
        assert torch.equal(held_kv(mgr, "a again", 12), expected_kv(a, 12))
    mgr.check_invariants()
