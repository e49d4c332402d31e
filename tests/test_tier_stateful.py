"""Random operation sequences over a pool with a host and a disk tier below it, every invariant checked after each.

Requests write KV that encodes each slot's token id and position; every admission checks that the pages it was
seeded with (from the pool or read in from a tier) hold exactly the KV written for those ids at those
positions. After every step: the manager's invariants (owner counts equal owners, and no page both in the
pool's index and in a tier), each level within its budget and its LRU consistent, no page left taken by a
read-in, and the pool's pages either free, cached or held by a live request. Disk pages are damaged at random
(a flipped byte anywhere in their slot) and must never seed a request. Requests grow past their prompt (decoded
pages), are suspended (their own pages offloaded to the tiers, a suspended request holding none) and resumed:
the pages a resume seeds, from the pool or read back from a tier, hold the KV written there.
"""

import shutil
import tempfile

import numpy as np
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mmcache import AllocationFailed, CacheConfig, Fingerprint
from mmcache.manager import AllocationManager
from mmcache.pool import KVSpec
from mmcache.tier import TierConfig, Tiers

P = 4
NUM_PAGES = 12
HOST, DISK, PREEMPT = 2, 6, 2
_rng = np.random.default_rng(11)
BASES = [_rng.integers(0, 5, size=20) for _ in range(3)]


def kv_value(token, pos):
    return torch.tensor(float(token) + pos / 1000, dtype=torch.float32)


class TierMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp()
        # recompute_tokens_per_s: slow, so the cost rule reads every disk hit in and disk pages take part
        tiers = Tiers(TierConfig(host_pages=HOST, disk_pages=DISK, disk_dir=self.dir, preempt_pages=PREEMPT,
                                 recompute_tokens_per_s=10.0), P, (1, 2, 1, P, 1), torch.float32)
        self.mgr = AllocationManager(CacheConfig(num_pages=NUM_PAGES, page_size=P), Fingerprint.for_tests(P),
                                     KVSpec(1, 1, 1), tiers=tiers)
        self.live: dict[int, np.ndarray] = {}  # written ids of each running request
        self.suspended: dict[int, np.ndarray] = {}
        self.next_id = 0
        self.hit_tokens = 0  # what the admissions were seeded with, read-ins included (the manager's hit_tokens)
        self.resumed_tokens = 0  # what the resumes were seeded with (counted as re-admissions)

    def teardown(self):
        self.mgr.tiers.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(base=st.integers(0, len(BASES) - 1), cut=st.integers(5, 20), suffix=st.lists(st.integers(0, 4), max_size=3),
          defer=st.booleans(), copy=st.booleans())
    def admit(self, base, cut, suffix, defer, copy):
        """Admit and write a prompt; with ``defer`` a tier hit is read in by ``read_pending`` (or, without
        ``copy``, cancelled by the completion) before the KV check."""
        prompt = np.concatenate([BASES[base][:cut], np.asarray(suffix, dtype=np.int64)])
        rid = self.next_id
        self.next_id += 1
        res = self.mgr.admit(rid, prompt, defer_read_in=defer)
        matched = res.matched_tokens
        if res.pending_tokens:
            self.mgr.check_invariants()  # the read-in's pages are held by the request meanwhile
            if copy:
                self.mgr.read_pending(rid)
            matched += self.mgr.complete_read_in(rid)
            assert matched == self.mgr.seq_len(rid) and (copy or matched == res.matched_tokens)
        self.hit_tokens += matched
        self._check_seeded(rid, prompt, matched)
        if self._write(rid, prompt, matched):
            self.live[rid] = prompt

    def _check_seeded(self, rid, ids, matched):
        pages = self.mgr.state(rid).page_indices
        kv = self.mgr.pool.kv
        for pos in range(matched):  # seeded from the pool or a tier: the KV written for these ids
            assert torch.equal(kv[0, 0, 0, pages[pos // P], pos % P, 0], kv_value(ids[pos], pos)), (rid, pos)

    def _write(self, rid, ids, start) -> bool:
        """Reserve, write and commit ``ids[start:]``; False (the request aborted) when the pool has no room."""
        try:
            pages = self.mgr.reserve(rid, len(ids) - start)
        except AllocationFailed:
            self.mgr.abort(rid)
            return False
        kv = self.mgr.pool.kv
        for pos in range(start, len(ids)):
            kv[:, :, :, pages[pos // P], pos % P] = kv_value(ids[pos], pos)
        self.mgr.commit(rid, ids[start:])
        return True

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 10**6), more=st.lists(st.integers(0, 4), min_size=1, max_size=6))
    def decode(self, pick, more):
        rid = sorted(self.live)[pick % len(self.live)]
        ids = np.concatenate([self.live.pop(rid), np.asarray(more, dtype=np.int64)])
        if self._write(rid, ids, len(ids) - len(more)):
            self.live[rid] = ids

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 10**6))
    def suspend(self, pick):
        rid = sorted(self.live)[pick % len(self.live)]
        ids = self.mgr.suspend(rid)
        assert np.array_equal(ids, self.live[rid]) and self.mgr.pages_held(rid) == 0
        self.suspended[rid] = self.live.pop(rid)

    @precondition(lambda self: self.suspended)
    @rule(pick=st.integers(0, 10**6), defer=st.booleans(), copy=st.booleans())
    def resume(self, pick, defer, copy):
        rid = sorted(self.suspended)[pick % len(self.suspended)]
        ids = self.suspended.pop(rid)
        res = self.mgr.resume(rid, readmission=True, defer_read_in=defer)
        assert np.array_equal(res.pending_ids, ids[res.restored_tokens:])
        restored = res.restored_tokens
        if res.reading_tokens:
            self.mgr.check_invariants()
            if copy:
                self.mgr.read_pending(rid)
            restored += self.mgr.complete_read_in(rid)
        assert restored == self.mgr.seq_len(rid) and restored % P == 0
        self.resumed_tokens += restored
        self._check_seeded(rid, ids, restored)
        if self._write(rid, ids, restored):
            self.live[rid] = ids

    @precondition(lambda self: self.live or self.suspended)
    @rule(pick=st.integers(0, 10**6), store=st.booleans(), preempted=st.booleans())
    def end(self, pick, store, preempted):
        rids = sorted(self.live) + sorted(self.suspended)
        rid = rids[pick % len(rids)]
        self.live.pop(rid, None)
        self.suspended.pop(rid, None)
        if store:
            self.mgr.teardown(rid, preempted=preempted)
        else:
            self.mgr.abort(rid)

    @rule()
    def demote_everything(self):
        self.mgr.clear_cache(demote=True)

    @precondition(lambda self: self.mgr.tiers.level("disk").entries)
    @rule(pick=st.integers(0, 10**6), offset=st.integers(0, 10**6))
    def damage_a_disk_page(self, pick, offset):
        """Flip a byte of a disk page: it must be refused when met (the KV check at admission would see it)."""
        disk = self.mgr.tiers.level("disk")
        pages = list(disk.entries.values())
        page = pages[pick % len(pages)]
        with open(disk.path, "r+b") as f:
            f.seek(page.slot * disk.slot_bytes + offset % disk.slot_bytes)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x10]))

    @rule()
    def clear_everything(self):
        self.mgr.clear_cache()
        assert len(self.mgr.tiers) == 0

    @invariant()
    def invariants_hold(self):
        mgr = self.mgr
        mgr.check_invariants()
        assert mgr.metrics.hit_tokens == self.hit_tokens + self.resumed_tokens
        assert mgr.metrics.readmission_hit_tokens == self.resumed_tokens
        assert sum(t for _, t in mgr.metrics.per_request_matched) == self.hit_tokens
        for level in mgr.tiers.levels:
            assert len(level.entries) <= level.capacity and level.taken == 0
        assert [lv.label for lv in mgr.tiers.levels] == ["preempted", "host", "disk"]
        assert mgr.num_requests == len(self.live) + len(self.suspended)
        assert all(mgr.pages_held(rid) == 0 for rid in self.suspended)
        owned = mgr.pool.refcount > 0
        held = set()
        for rid in self.live:
            held.update(mgr.state(rid).page_indices.tolist())
        assert set(np.flatnonzero(owned).tolist()) == held | set(np.flatnonzero(mgr.index.in_index).tolist())


TierMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestTierMachine = TierMachine.TestCase
