"""Random operation sequences against the allocation manager, with every invariant checked after each step.

The checks here are independent of the manager's own bookkeeping: owners are recounted from the public
page tables and the index flags, written ids are compared with what this test wrote, and every index entry's
chain (walked through parents to the root) must spell a prefix of a sequence some request actually wrote.
Windowed labels take part (``protect_prefix``, ``release_oldest`` on seeded and published pages), and an
allocation that fails must leave no page held by the index alone (``alloc_failures_cache_held`` stays 0).
Eviction is checked against the rule it implements (the first batch starts at the least recently stamped
evictable leaf, found here by a pass over the pool), an abort stamps the pages it held as the most recent,
tail first, and ``hit_share`` is recomputed from first admissions (some admissions are re-admissions).
"""

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mmcache import AllocationFailed, CacheConfig, Fingerprint, InvalidRequest, make_manager

P = 4
NUM_PAGES = 20
_rng = np.random.default_rng(7)
BASES = [_rng.integers(0, 6, size=24) for _ in range(3)]


class ManagerMachine(RuleBasedStateMachine):
    mode = "on"
    store_at = "teardown"

    def __init__(self):
        super().__init__()
        self.mgr = make_manager(CacheConfig(num_pages=NUM_PAGES, page_size=P, mode=self.mode,
                                                 store_at=self.store_at), Fingerprint.for_tests(P))
        self.live: dict[int, dict] = {}
        self.sequences: list[tuple] = []  # every sequence a request wrote (live ones are read on the fly)
        self.next_id = 0
        self.first = [0, 0]  # looked-up and matched prompt tokens of first admissions (mode on)
        self.readmissions = 0

    # ---- helpers -----------------------------------------------------------------------------------
    def _running(self, predicate=lambda r: True):
        return sorted(rid for rid, r in self.live.items() if not r["suspended"] and predicate(r))

    def _snapshot(self, rid):
        st_ = self.mgr.state(rid)
        return st_.page_indices.tolist(), st_.seq_len

    # ---- rules -------------------------------------------------------------------------------------
    @rule(base=st.integers(0, len(BASES) - 1), cut=st.integers(0, 24),
          suffix=st.lists(st.integers(0, 5), max_size=7), readmission=st.booleans())
    def admit(self, base, cut, suffix, readmission):
        prompt = np.concatenate([BASES[base][:cut], np.asarray(suffix, dtype=np.int64)]).astype(np.int64)
        if len(prompt) == 0:
            prompt = np.asarray([1])
        rid = self.next_id
        self.next_id += 1
        res = self.mgr.admit(rid, prompt, readmission=readmission)
        self.readmissions += readmission
        if not readmission:
            self.first[0] += len(prompt)
            self.first[1] += res.matched_tokens
        view = self.mgr.state(rid)
        k = res.matched_tokens
        assert view.seq_len == k and k % P == 0 and k <= len(prompt) - 1
        if self.mode != "on":
            assert k == 0
        if k:
            got = self.mgr.pool.ids[view.page_indices[: k // P]].reshape(-1)
            assert np.array_equal(got, prompt[:k]), "a seeded page holds other ids than the prompt"
        self.live[rid] = {"prompt": prompt, "target": prompt, "written": list(prompt[:k]), "suspended": False,
                          "windowed": False, "released": False}

    @precondition(lambda self: self._running(lambda r: len(r["written"]) < len(r["target"])))
    @rule(data=st.data(), n=st.integers(1, 9))
    def prefill_chunk(self, data, n):
        rid = data.draw(st.sampled_from(self._running(lambda r: len(r["written"]) < len(r["target"]))))
        r = self.live[rid]
        w = len(r["written"])
        chunk = r["target"][w:w + n]
        before = self._snapshot(rid)
        try:
            self.mgr.reserve(rid, len(chunk))
        except AllocationFailed as e:
            assert e.pages_short > 0
            assert self._snapshot(rid) == before, "a failed reserve changed the request"
            return
        self.mgr.commit(rid, chunk)
        r["written"].extend(chunk.tolist())

    @precondition(lambda self: self._running(lambda r: len(r["written"]) >= len(r["target"])))
    @rule(data=st.data(), token=st.integers(0, 5))
    def decode_append(self, data, token):
        rid = data.draw(st.sampled_from(self._running(lambda r: len(r["written"]) >= len(r["target"]))))
        try:
            self.mgr.reserve(rid, 1)
        except AllocationFailed:
            return
        self.mgr.commit(rid, [token])
        self.live[rid]["written"].append(token)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def end_request(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        r = self.live.pop(rid)
        self.sequences.append(tuple(r["written"]))
        self.mgr.teardown(rid)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        r = self.live.pop(rid)
        self.sequences.append(tuple(r["written"]))  # published-at-prefill pages may stay indexed
        chain = list(getattr(self.mgr, "real", self.mgr)._requests[rid].chain)  # a shadow's real one: mode off
        self.mgr.abort(rid)
        idx = self.mgr.index
        if chain:  # the index pages it held: now the most recent, tail first
            others = np.setdiff1d(np.flatnonzero(idx.in_index), chain)
            stamps = idx.stamp[chain]
            assert (np.diff(stamps) < 0).all()
            assert not len(others) or stamps.min() > idx.stamp[others].max()

    @precondition(lambda self: self._running(lambda r: not r["windowed"]))
    @rule(data=st.data(), tokens=st.integers(0, 40))
    def protect_prefix(self, data, tokens):
        rid = data.draw(st.sampled_from(self._running(lambda r: not r["windowed"])))
        limit = max(len(self.live[rid]["prompt"]), self._snapshot(rid)[1])
        self.mgr.protect_prefix(rid, min(tokens, limit))
        self.live[rid]["windowed"] = True

    @precondition(lambda self: self._running())
    @rule(data=st.data(), n=st.integers(0, 3))
    def release_oldest(self, data, n):
        """Seeded and published pages included; releasing 0 pages changes nothing."""
        rid = data.draw(st.sampled_from(self._running()))
        before = self._snapshot(rid)
        rc_before = self.mgr.pool.refcount.copy()
        try:
            released = self.mgr.release_oldest(rid, n)
        except InvalidRequest:
            assert self._snapshot(rid) == before and np.array_equal(self.mgr.pool.refcount, rc_before)
            return
        assert len(released) == n
        pages, seq_len = self._snapshot(rid)
        assert seq_len == before[1] and pages == [-1 if p in released else p for p in before[0]]
        assert np.array_equal(rc_before[released] - 1, self.mgr.pool.refcount[released])
        if n:
            self.live[rid]["windowed"] = self.live[rid]["released"] = True

    @precondition(lambda self: self._running(lambda r: not r["released"]))
    @rule(data=st.data())
    def suspend(self, data):
        rid = data.draw(st.sampled_from(self._running(lambda r: not r["released"])))
        pages, _ = self._snapshot(rid)
        rc_before = self.mgr.pool.refcount.copy()
        ids = self.mgr.suspend(rid)
        r = self.live[rid]
        assert ids.tolist() == r["written"]
        rc = self.mgr.pool.refcount
        for pg in pages:
            if pg < 0:
                continue
            assert rc[pg] == rc_before[pg] - 1
            if rc_before[pg] > 1:
                assert rc[pg] >= 1, "a shared page was freed by suspension"
        r["suspended"] = True
        self.sequences.append(tuple(r["written"]))

    @precondition(lambda self: any(r["suspended"] for r in self.live.values()))
    @rule(data=st.data())
    def resume(self, data):
        rid = data.draw(st.sampled_from(sorted(k for k, r in self.live.items() if r["suspended"])))
        r = self.live[rid]
        res = self.mgr.resume(rid)
        k = res.restored_tokens
        assert k % P == 0 and k <= len(r["written"])
        assert res.pending_ids.tolist() == r["written"][k:]
        # Continue by re-writing the pending ids, then decoding on.
        longer = r["written"] if len(r["written"]) > len(r["prompt"]) else r["prompt"]
        r["target"] = np.asarray(longer, dtype=np.int64)
        r["written"] = r["written"][:k]
        r["suspended"] = False

    @precondition(lambda self: self._running())
    @rule(data=st.data(), extra=st.integers(1, 3))
    def shortfall(self, data, extra):
        """Ask for more than is free: eviction must cover it, or the call fails with nothing changed."""
        rid = data.draw(st.sampled_from(self._running()))
        before = self._snapshot(rid)
        want = (self.mgr.pool.num_free + extra) * P
        idx, rc = self.mgr.index, self.mgr.pool.refcount
        cached_only = int((idx.in_index & (rc == 1)).sum())
        leaves = np.flatnonzero(idx.in_index & (rc == 1) & (idx.children == 0))
        coldest = int(leaves[np.argmin(idx.stamp[leaves])]) if len(leaves) else -1
        batches = self.mgr.metrics.eviction_batches
        failures = self.mgr.metrics.alloc_failures_uncached
        try:
            self.mgr.reserve(rid, want)
        except AllocationFailed:
            assert self._snapshot(rid) == before
            assert self.mgr.metrics.alloc_failures_uncached == failures + 1
            assert int((self.mgr.index.in_index & (self.mgr.pool.refcount == 1)).sum()) == 0
            return
        finally:
            if self.mgr.metrics.eviction_batches > batches and coldest >= 0:
                assert not idx.in_index[coldest], "the least recent evictable leaf was not evicted first"
        assert cached_only > 0 or before[1] % P or len(before[0]) * P > before[1]

    # ---- invariants --------------------------------------------------------------------------------
    @invariant()
    def invariants_hold(self):
        mgr = self.mgr
        mgr.check_invariants()
        rc = mgr.pool.refcount
        owners = mgr.index.in_index.astype(np.int64)
        tails: dict[int, int] = {}
        for rid, r in self.live.items():
            pages, seq_len = self._snapshot(rid)
            if r["suspended"]:
                assert pages == [] and seq_len == 0
                continue
            assert seq_len == len(r["written"])
            held = [p for p in pages if p >= 0]
            np.add.at(owners, np.asarray(held, dtype=np.int64), 1)
            for i, page in enumerate(pages[: -(-seq_len // P)]):
                if page >= 0:  # -1: released by release_oldest
                    got = mgr.pool.ids[page][: seq_len - i * P].tolist()
                    assert got == r["written"][i * P:(i + 1) * P], "a live request's pages lost what it wrote"
            for p in pages[seq_len // P:]:
                assert p not in tails, "a page is two requests' tail"
                tails[p] = rid
                assert rc[p] == 1
        assert np.array_equal(owners, rc), "owner counts differ from the owners"
        assert set(np.flatnonzero(rc == 0).tolist()) == set(mgr.pool.free_pages().tolist())
        assert mgr.metrics.alloc_failures_cache_held == 0
        mirror = getattr(mgr, "shadow", None)
        if mirror is not None:
            assert mirror.metrics.alloc_failures_cache_held == 0
        counted = mirror.metrics if mirror is not None else mgr.metrics
        assert counted.readmissions == (self.readmissions if self.mode != "off" else 0)
        if self.mode == "on":
            assert mgr.metrics.hit_share == (self.first[1] / self.first[0] if self.first[0] else 0.0)
        entries = np.flatnonzero(mgr.index.in_index)
        assert len(np.unique(mgr.index.stamp[entries])) == len(entries), "two index entries share a stamp"
        written = self.sequences + [tuple(r["written"]) for r in self.live.values()]
        idx = mgr.index
        for page in np.flatnonzero(idx.in_index):
            chain, p = [], int(page)
            while p >= 0:
                chain.append(mgr.pool.ids[p].tolist())
                p = int(idx.parent[p])
            spelled = tuple(t for ids in reversed(chain) for t in ids)
            assert any(seq[:len(spelled)] == spelled for seq in written), "an index chain spells unwritten ids"

    def teardown(self):
        """End of a run: tear every request down and drop the index; then every page is free."""
        for rid in list(self.live):
            self.mgr.teardown(rid)
        self.live.clear()
        self.mgr.clear_cache()
        self.mgr.check_invariants()
        assert self.mgr.pool.num_free == NUM_PAGES, "pages leaked after every request ended"
        assert self.mgr.index.size == 0
        if self.mode == "shadow":
            assert self.mgr.shadow.pool.num_free == NUM_PAGES


class TeardownMachine(ManagerMachine):
    pass


class PrefillMachine(ManagerMachine):
    store_at = "prefill"


class ShadowMachine(ManagerMachine):
    """Drives the ``ShadowedManager`` that ``make_manager`` builds for mode ``shadow``."""

    mode = "shadow"

    @invariant()
    def mirror_follows_every_live_request(self):
        """The mirror refuses nothing the real manager took, holds exactly its live requests and has written at
        least as far (its match may run ahead of the real request's prefill), or as far once it caught up."""
        mgr = self.mgr
        assert mgr.shadow_failures == 0 and mgr.shadow.num_requests == mgr.num_requests == len(self.live)
        for rid, r in self.live.items():
            real, mirrored = mgr.seq_len(rid), mgr.shadow.seq_len(rid)
            assert mirrored >= real and (mirrored == real or real < len(r["prompt"]))
            assert mgr.shadow.state(rid).suspended == r["suspended"]


class OffMachine(ManagerMachine):
    mode = "off"


_SETTINGS = settings(max_examples=120, stateful_step_count=50, deadline=None)
for _cls in (TeardownMachine, PrefillMachine, ShadowMachine, OffMachine):
    _cls.TestCase.settings = _SETTINGS

TestTeardown = TeardownMachine.TestCase
TestPrefill = PrefillMachine.TestCase
TestShadow = ShadowMachine.TestCase
TestOff = OffMachine.TestCase
