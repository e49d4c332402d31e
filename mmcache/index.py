"""The prefix index: page name -> cached page, verified by token ids, extras and parent on every hit.

Entries live in per-page arrays (one entry per page at most: the index owns the page it names) plus an
open-addressing hash multimap from name to page id. The multimap keeps colliding names side by side, so a
lookup can try every page carrying a name; the hash only nominates.

Invariants (``check_invariants``):

* ``in_index[p]`` exactly when the multimap holds ``(name[p], p)``; the index is then one of ``p``'s owners.
* ``parent[p]`` is the index page holding the previous page of the chain, or ``-1 - root_id`` for a chain's
  first page, where ``root_id`` identifies the exact root material (fingerprint and salt bytes) in
  ``roots``. A root no entry starts from and no live request uses may be forgotten (``forget_roots``) and its
  id reused, so ``roots`` stays bounded by what is cached and running, not by every salt ever seen. Every
  entry's parent page is itself in the index (eviction removes leaves only).
* ``children[p]`` counts the entries whose parent is ``p``.
* Live plus tombstone slots fill at most 3/4 of the multimap (a rebuild before an insert could pass it drops
  the tombstones), so every probe for a missing name ends at an EMPTY slot.
* ``pool.ids[p]`` are the ids ``p`` was named over; a hit compares them, its extras and its parent.
* Recency: ``stamp`` grows with time and no two entries share one; an insert and a touch stamp a run's
  pages tail first, so along a chain a page is never staler than the page after it when both were stamped
  together, and least-recent order drops tails first.
* Cold leaves: every *evictable leaf* (in the index, owner count 1, no children) has the key
  ``stamp << 31 | page`` in the heap ``_cold``. The heap may also hold stale keys (the page changed since),
  which ``pop_cold_leaf`` skips; it is rebuilt when it passes twice the pages. Every event that can make a
  page an evictable leaf or restamp one offers it (insert, touch, a removal that leaves a parent childless,
  and the pool's ``decref`` to one owner), so taking the least recent leaf costs a heap pop, not a pass
  over the pool.

Verifying ids stay in the pool's single ``(num_pages, page_size)`` int32 array, so a run of k pages is
checked by one vectorised comparison.
"""

from __future__ import annotations

import heapq

import numpy as np

from .errors import InvalidRequest
from .names import Extras
from .pool import PagePool

EMPTY = -1
TOMBSTONE = -2
_PAGE_BITS = 31  # page ids are int32 (pool.MAX_PAGES): a cold-leaf key is stamp << 31 | page
_PAGE_MASK = (1 << _PAGE_BITS) - 1
_SCALAR_REMOVALS = 8  # up to this many pages, removals and offers go one by one (see _slots_remove)


class PrefixIndex:
    """Not thread-safe: the allocation manager's lock guards it."""

    def __init__(self, pool: PagePool):
        n = pool.num_pages
        self.pool = pool
        self.page_size = pool.page_size
        # Each entry owns a distinct page, so at most half the slots are live; tombstones are bounded by
        # rebuilding, so live + tombstone slots stay <= 3/4 of them and every probe sequence meets an EMPTY.
        self._cap = max(8, 2 * n)
        try:
            self._keys = np.zeros(self._cap, dtype=np.uint64)
            self._vals = np.full(self._cap, EMPTY, dtype=np.int32)
            self.name = np.zeros(n, dtype=np.uint64)
            self.parent = np.zeros(n, dtype=np.int32)
            self.in_index = np.zeros(n, dtype=bool)
            self.children = np.zeros(n, dtype=np.int32)
            self.stamp = np.zeros(n, dtype=np.int64)
            self.has_extras = np.zeros(n, dtype=bool)
        except (MemoryError, ValueError) as e:  # numpy's refusal of a size, or of the memory (as PagePool)
            raise InvalidRequest(f"an index over {n} pages cannot be allocated: {type(e).__name__}: {e}") from None
        self._tombstones = 0
        self._extras: dict[int, Extras] = {}
        self._clock = 0
        self.size = 0
        self.roots: dict[bytes, int] = {}
        self._free_root_ids: list[int] = []  # ids of forgotten roots, reused first
        self._root_ids_made = 0
        self._cold: list[int] = []  # heap of cold-leaf keys (see the module docstring)
        pool.on_one_owner = self.offer

    # ---- roots -------------------------------------------------------------------------------------
    def root_parent(self, root_material: bytes) -> int:
        """The parent value of a chain's first page for this exact root material (registered on first use)."""
        rid = self.roots.get(root_material)
        if rid is None:
            if self._free_root_ids:
                rid = self._free_root_ids.pop()
            else:
                rid, self._root_ids_made = self._root_ids_made, self._root_ids_made + 1
            self.roots[root_material] = rid
        return -1 - rid

    def forget_roots(self, in_use: set[int]) -> int:
        """Forget every root material that no entry's chain starts from and whose parent value is not in
        ``in_use`` (the parent values live requests hold); their ids are reused. Returns how many were
        forgotten. Without this, every distinct salt ever seen would keep its root material for good."""
        heads = self.parent[self.in_index]
        used = set(heads[heads < 0].tolist()) | in_use
        dead = [material for material, rid in self.roots.items() if -1 - rid not in used]
        for material in dead:
            self._free_root_ids.append(self.roots.pop(material))
        return len(dead)

    # ---- multimap ----------------------------------------------------------------------------------
    def _first_candidates(self, names: np.ndarray) -> np.ndarray:
        """For each name, the page of the first slot in its probe sequence holding that name, or -1."""
        cap = np.uint64(self._cap)
        start = (names % cap).astype(np.int64)
        out = np.full(len(names), -1, dtype=np.int32)
        pending = np.arange(len(names))
        step = 0
        # Vectorised steps while many names are unresolved; the few in long probe runs finish one by one,
        # since a numpy call costs more than a scalar probe once only a handful remain.
        while len(pending) > 16:
            s = (start[pending] + step) % self._cap
            keys = self._keys[s]
            vals = self._vals[s]
            hit = (keys == names[pending]) & (vals >= 0)
            out[pending[hit]] = vals[hit]
            pending = pending[~hit & (vals != EMPTY)]
            step += 1
        if len(pending):
            keys, vals, cap = self._keys, self._vals, self._cap
            for i in pending.tolist():
                name, s = names[i], (int(start[i]) + step) % cap
                while True:
                    v = vals[s]
                    if v == EMPTY:
                        break
                    if v >= 0 and keys[s] == name:
                        out[i] = v
                        break
                    s = (s + 1) % cap
        return out

    def _all_candidates(self, name: int) -> list[int]:
        s = int(np.uint64(name) % np.uint64(self._cap))
        out = []
        while True:
            v = int(self._vals[s])
            if v == EMPTY:
                return out
            if v >= 0 and int(self._keys[s]) == name:
                out.append(v)
            s = (s + 1) % self._cap

    def _slots_insert(self, names: np.ndarray, pages: np.ndarray) -> None:
        """Put each ``(names[i], pages[i])`` in the first free slot of its probe sequence, all at once.

        Each round, every pending item looks at its current slot; among those that find it free (empty or
        tombstone) the first per slot wins it, and everything else steps to the next slot.
        """
        cap = self._cap
        pos = (names % np.uint64(cap)).astype(np.int64)
        pending = np.arange(len(names))
        while len(pending):
            s = pos[pending]
            free = self._vals[s] < 0
            slots, first = np.unique(s[free], return_index=True)
            winners = pending[free][first]
            self._tombstones -= int((self._vals[slots] == TOMBSTONE).sum())
            self._keys[slots] = names[winners]
            self._vals[slots] = pages[winners]
            won = np.zeros(len(names), dtype=bool)
            won[winners] = True
            pending = pending[~won[pending]]
            pos[pending] = (pos[pending] + 1) % cap

    def _slots_remove(self, names: np.ndarray, pages: np.ndarray) -> None:
        """Turn the slot holding each ``(names[i], pages[i])`` into a tombstone, all at once (a few one by one:
        a cold tail is often a page or two, and a scalar probe costs less than a numpy round per probe step)."""
        if len(names) <= _SCALAR_REMOVALS:
            self._slots_remove_each(names, pages)
            return
        cap = self._cap
        pos = (names % np.uint64(cap)).astype(np.int64)
        pending = np.arange(len(names))
        while len(pending):
            s = pos[pending]
            vals = self._vals[s]
            if (vals == EMPTY).any():
                raise AssertionError("a page is missing from the multimap")  # an index bug
            hit = (vals == pages[pending]) & (self._keys[s] == names[pending])
            self._vals[s[hit]] = TOMBSTONE
            self._tombstones += int(hit.sum())
            pending = pending[~hit]
            pos[pending] = (pos[pending] + 1) % cap

    def _slots_remove_each(self, names: np.ndarray, pages: np.ndarray) -> None:
        keys, vals, cap = self._keys, self._vals, self._cap
        for name, page in zip(names.tolist(), pages.tolist()):
            s = name % cap
            while True:
                v = int(vals[s])
                if v == EMPTY:
                    raise AssertionError("a page is missing from the multimap")  # an index bug
                if v == page and int(keys[s]) == name:
                    break
                s = (s + 1) % cap
            vals[s] = TOMBSTONE
        self._tombstones += len(names)

    def _maybe_rebuild(self, incoming: int = 0) -> None:
        """Drop the tombstones when, with ``incoming`` more entries each taking an EMPTY slot, live plus
        tombstone slots could pass 3/4 of the table (a full table would make every probe for a missing name
        loop forever)."""
        if self.size + incoming + self._tombstones <= (3 * self._cap) // 4:
            return
        self._keys[:] = 0
        self._vals[:] = EMPTY
        self._tombstones = 0
        live = np.flatnonzero(self.in_index).astype(np.int32)
        self._slots_insert(self.name[live], live)

    # ---- lookup ------------------------------------------------------------------------------------
    def _entry_matches(self, page: int, i: int, ids: np.ndarray, extras: dict, parent: int, ids_from: int) -> bool:
        p, row = self.page_size, i - ids_from
        return (
            bool(self.in_index[page])
            and int(self.parent[page]) == parent
            and np.array_equal(self.pool.ids[page], ids[row * p : (row + 1) * p])
            and self._extras.get(page) == extras.get(i)
        )

    def match(self, names: np.ndarray, ids: np.ndarray, extras: dict[int, Extras], root_parent: int,
              limit: int | None = None, first_page: int = 0, parent: int | None = None,
              ids_from: int = 0) -> np.ndarray:
        """Longest verified run of index pages for pages ``first_page ..`` of a sequence, as page ids.

        ``names[j]`` names page ``first_page + j``; ``ids`` holds the sequence's ids from page ``ids_from``
        (at most ``first_page``) on, so a caller matching late pages need not gather the early ones. The run
        starts under ``parent`` (an index page) or at the root when ``first_page == 0``. A nominee is accepted
        only when its ids, its extras and its parent equal the request's. At most ``limit`` pages are
        returned. Read-only: counts and recency are the caller's to change.
        """
        k = len(names) if limit is None else min(len(names), limit)
        if k <= 0 or self.size == 0:
            return np.empty(0, dtype=np.int32)
        names = names[:k]
        accepted = self._verified_runs(names, ids, extras, root_parent if first_page == 0 else parent, first_page,
                                       ids_from)
        if not accepted:
            return np.empty(0, dtype=np.int32)
        return np.concatenate(accepted).astype(np.int32, copy=False)

    def _verified_runs(self, names: np.ndarray, ids: np.ndarray, extras: dict[int, Extras], expect_parent: int,
                       first_page: int, ids_from: int) -> list[np.ndarray]:
        """The longest verified run for ``names`` under ``expect_parent``, in pieces: runs of first nominees
        verified at once, and single pages found among nominees sharing a name."""
        k = len(names)
        cand = self._first_candidates(names)
        accepted: list[np.ndarray] = []
        j = 0
        while j < k:
            # Fast path: the nominees from page j up to the first page without one, verified at once.
            misses = np.flatnonzero(cand[j:] < 0)
            m = int(misses[0]) if len(misses) else k - j
            if m:
                pages = cand[j : j + m]
                good = self._verified_prefix(pages, first_page + j, ids, extras, expect_parent, ids_from)
                if good:
                    accepted.append(pages[:good])
                    expect_parent = int(pages[good - 1])
                    j += good
                if good == m:
                    continue
            # Slow path at page j: no page carries its name (the run ends there), or its first nominee failed.
            if cand[j] < 0:
                break
            found = self._colliding_match(int(names[j]), first_page + j, ids, extras, expect_parent, ids_from)
            if found < 0:
                break
            accepted.append(np.array([found], dtype=np.int32))
            expect_parent = found
            j += 1
        return accepted

    def _verified_prefix(self, pages: np.ndarray, page_no: int, ids: np.ndarray, extras: dict[int, Extras],
                         parent: int, ids_from: int) -> int:
        """How many of ``pages``, nominated for pages ``page_no ..`` of the sequence, verify from the first on.

        Ids are checked by one vectorised compare over the run and parents along the chain from ``parent``;
        extras only on the rows where the entry or the request has any, since most pages carry none.
        """
        m, p = len(pages), self.page_size
        lo = (page_no - ids_from) * p
        ok = (self.pool.ids[pages] == ids[lo : lo + m * p].reshape(m, p)).all(axis=1)
        parents = np.empty(m, dtype=np.int32)
        parents[0] = parent
        parents[1:] = pages[:-1]
        ok &= self.parent[pages] == parents
        rows = set(np.flatnonzero(self.has_extras[pages]).tolist())
        rows.update(i - page_no for i in extras if page_no <= i < page_no + m)
        for r in rows:
            if self._extras.get(int(pages[r])) != extras.get(page_no + r):
                ok[r] = False
        bad = np.flatnonzero(~ok)
        return int(bad[0]) if len(bad) else m

    def _colliding_match(self, name: int, page_no: int, ids: np.ndarray, extras: dict[int, Extras], parent: int,
                         ids_from: int) -> int:
        """The first page carrying ``name`` whose entry matches page ``page_no`` of the sequence, or -1.

        Tries every page under the name, one by one: only reached after the first nominee failed, on a true
        64-bit collision or at the end of the cached run.
        """
        for page in self._all_candidates(name):
            if self._entry_matches(page, page_no, ids, extras, parent, ids_from):
                return page
        return -1

    # ---- cold leaves -------------------------------------------------------------------------------
    def _evictable(self, pages: np.ndarray) -> np.ndarray:
        return self.in_index[pages] & (self.children[pages] == 0) & (self.pool.refcount[pages] == 1)

    def offer(self, pages: np.ndarray) -> None:
        """Add the cold-leaf keys of those of ``pages`` that are evictable leaves now (see the module docstring)."""
        pages = np.asarray(pages, dtype=np.int32)
        heap = self._cold
        if len(pages) <= _SCALAR_REMOVALS:  # the usual offer, a page or two: scalar steps cost less
            in_index, children, refcount, stamp = self.in_index, self.children, self.pool.refcount, self.stamp
            for page in pages.tolist():
                if in_index[page] and children[page] == 0 and refcount[page] == 1:
                    heapq.heappush(heap, int(stamp[page]) << _PAGE_BITS | page)
        else:
            leaves = pages[self._evictable(pages)]
            for stamp, page in zip(self.stamp[leaves].tolist(), leaves.tolist()):
                heapq.heappush(heap, stamp << _PAGE_BITS | page)
        if len(heap) > 2 * len(self.in_index) + 64:  # amortised: at least as many offers came since the last
            self._rebuild_cold()

    def _rebuild_cold(self) -> None:
        leaves = np.flatnonzero(self.in_index & (self.children == 0) & (self.pool.refcount == 1))
        self._cold = sorted(s << _PAGE_BITS | p for s, p in zip(self.stamp[leaves].tolist(), leaves.tolist()))

    def pop_cold_leaf(self) -> int:
        """The least recently stamped evictable leaf, taken off the heap; -1 when there is none."""
        heap, stamp = self._cold, self.stamp
        in_index, children, refcount = self.in_index, self.children, self.pool.refcount
        while heap:
            key = heapq.heappop(heap)
            page = key & _PAGE_MASK
            if in_index[page] and children[page] == 0 and refcount[page] == 1 and stamp[page] == key >> _PAGE_BITS:
                return page
        return -1

    # ---- mutation ----------------------------------------------------------------------------------
    def insert_run(self, names: np.ndarray, pages: np.ndarray, parent: int, extras: list) -> None:
        """Add a chain: ``pages[0]`` under ``parent``, each next page under the one before it.

        ``names``, ``pages`` and ``extras`` (an Extras or None per page) run head to tail; no page may be in the
        index already. The caller transfers or adds the index's ownership of the pages (an added owner
        before the call, so that the new leaf is not taken for evictable). The run is stamped as just used,
        tail first.
        """
        n = len(pages)
        if n == 0:
            return
        pages = np.asarray(pages, dtype=np.int32)
        if self.in_index[pages].any():
            raise AssertionError("a page is already in the index")  # a manager bug
        self._maybe_rebuild(n)
        self._slots_insert(np.asarray(names, dtype=np.uint64), pages)
        self.name[pages] = names
        self.parent[pages[0]] = parent
        self.parent[pages[1:]] = pages[:-1]
        self.in_index[pages] = True
        self.children[pages] = 0
        self.children[pages[:-1]] = 1
        if parent >= 0:
            self.children[parent] += 1
        self.has_extras[pages] = False
        for page, ex in zip(pages.tolist(), extras):
            if ex:
                self._extras[page] = ex
                self.has_extras[page] = True
        self.size += n
        self.touch(pages)

    def insert(self, name: int, page: int, parent: int, extras: Extras | None) -> None:
        """Add one ``page`` under ``name`` and ``parent`` (see ``insert_run``)."""
        self.insert_run(np.asarray([name], dtype=np.uint64), np.asarray([page], dtype=np.int32), parent, [extras])

    def remove(self, pages: np.ndarray) -> None:
        """Drop ``pages`` (each in the index) from the index; the caller releases the index's ownership."""
        pages = np.asarray(pages, dtype=np.int32)
        if len(pages) == 0:
            return
        self._slots_remove(self.name[pages], pages)
        parents = self.parent[pages]
        inner = parents[parents >= 0]
        if len(inner) <= _SCALAR_REMOVALS:  # ufunc.at costs more than a few scalar steps
            for par in inner.tolist():
                self.children[par] -= 1
        else:
            np.subtract.at(self.children, inner, 1)
        self.in_index[pages] = False
        for page in pages[self.has_extras[pages]].tolist():
            del self._extras[page]
        self.has_extras[pages] = False
        self.size -= len(pages)
        self._maybe_rebuild()
        self.offer(inner)  # a parent left without children may be an evictable leaf now

    def touch(self, pages: np.ndarray) -> None:
        """Mark a run (head first in ``pages``) as just used, tail first: the tail gets the oldest stamp."""
        k = len(pages)
        if k:
            self.stamp[pages] = self._clock + np.arange(k - 1, -1, -1, dtype=np.int64)
            self._clock += k
            self.offer(pages)

    def extras_of(self, page: int) -> Extras | None:
        return self._extras.get(page)

    def metadata_nbytes(self) -> int:
        arrays = (self._keys, self._vals, self.name, self.parent, self.in_index, self.children, self.stamp,
                  self.has_extras)
        return sum(a.nbytes for a in arrays)

    def check_invariants(self) -> None:
        tombstones = int((self._vals == TOMBSTONE).sum())
        if tombstones != self._tombstones or self.size + tombstones > (3 * self._cap) // 4:
            raise AssertionError("tombstone count wrong, or live and tombstone slots fill over 3/4 of the table")
        live = np.flatnonzero(self._vals >= 0)
        if len(live) != self.size or int(self.in_index.sum()) != self.size:
            raise AssertionError("index size, multimap and in_index disagree")
        pages = self._vals[live]
        if len(np.unique(pages)) != len(pages) or not self.in_index[pages].all():
            raise AssertionError("multimap holds a page twice or a page not marked in the index")
        if not np.array_equal(self._keys[live], self.name[pages]):
            raise AssertionError("multimap key differs from the page's name")
        entries = np.flatnonzero(self.in_index)
        par = self.parent[entries]
        inner = par[par >= 0]
        if len(inner) and not self.in_index[inner].all():
            raise AssertionError("an entry's parent page is not in the index")
        counts = np.bincount(inner, minlength=len(self.children)) if len(inner) else np.zeros_like(self.children)
        if not np.array_equal(counts[entries], self.children[entries]):
            raise AssertionError("children counts differ from the entries' parents")
        if (self.pool.refcount[entries] < 1).any():
            raise AssertionError("an index page has owner count 0")
        if set(self._extras) != set(np.flatnonzero(self.has_extras).tolist()):
            raise AssertionError("extras table and has_extras flags disagree")
        heads = par[par < 0]
        if len(heads) and not set((-1 - heads).tolist()) <= set(self.roots.values()):
            raise AssertionError("an entry's chain starts from a root the index has forgotten")
        if len(set(self.roots.values())) != len(self.roots) or set(self._free_root_ids) & set(self.roots.values()):
            raise AssertionError("a root id is given to two root materials, or is both used and free")
        leaves = entries[(self.children[entries] == 0) & (self.pool.refcount[entries] == 1)]
        keys = {s << _PAGE_BITS | p for s, p in zip(self.stamp[leaves].tolist(), leaves.tolist())}
        if not keys <= set(self._cold):
            raise AssertionError("an evictable leaf is missing from the cold-leaf heap")
