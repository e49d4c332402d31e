"""The second tier: host memory and, below it, a file on local disk, for cached pages that eviction drops.

When eviction frees a cold tail (``eviction``), the manager moves each freed page down: its KV, its name, its
verifying token ids and extras, and its *chain digest*. A later admission that stops matching in the pool walks
on through the tiers; a page found there is read back into a fresh pool page and re-enters the index.

Identity. A pool page's parent is a page id; a tier page has none, so its place in a chain is named by a digest:
``d(i) = BLAKE2b-256(d(i-1) ‖ ids of page i ‖ extras of page i)``, ``d(-1)`` over the root material (fingerprint
and salt). A tier hit needs the request's own digest of that page (so the same root, every earlier id and
extra) and equal token ids and extras, compared as the index compares them; what the ids do not cover (the
chain above) is covered by a digest that resists crafted collisions (docs/DESIGN.md, "Digests and salts"). A page
whose parent has left every level is still found once the parent is back in the pool: digests name content,
not places.

Write policy: write on eviction. A page is copied to host memory when the pool evicts it, and to disk when host
memory evicts it, never before. Writing through (a copy of every published page as prefill writes it) would put
a copy on the prefill path of every request for pages that mostly never leave the pool, and would hold each page
in two places; writing on eviction costs a copy only for pages that would otherwise be lost, made on the
allocation path that frees them (under the manager's lock: a synchronous copy).

Read-in cost rule: host pages are always read in (a copy at memory bandwidth beats recomputing any page). A run
whose part from its first disk page on would take longer to read (``disk_read_latency_s`` plus its bytes at
``disk_read_bytes_per_s``) than to recompute (its tokens at ``recompute_tokens_per_s``) stops before that page,
so a small hit from disk is recomputed instead. The rule reads its constants from ``TierConfig``.

The split of the offload budget: ``preempt_pages`` is host memory kept for the pages of preempted requests,
beside the cache's ``host_pages`` (the engine's ``preempt_tier_bytes`` and ``host_tier_bytes``). A suspended
request's pages go there two ways (``AllocationManager.suspend``): the written pages it owns alone are copied
into the ``preempted`` level at once (``put(preempted=True)``), and the index pages it held are marked (as are
those a ``teardown(preempted=True)`` stored), so that eviction moves them into that level. The level sits above
the host level, so cold cache pages cannot push them out before the request resumes; its least recent page
joins the host level as any other page. Without it, preempted requests' pages share the host level's LRU with
the cache.

Invariants (``check_invariants``):

* A page (its chain digest) is in one level at most; the manager checks that no pool index page is also in a
  level (``AllocationManager.check_invariants``).
* A level holds at most ``capacity`` pages; its slots in use (entries and pages taken for a read-in) and its
  free slots partition ``range(capacity)``.
* Each level is an LRU: entries in recency order, least recent first. A full level gives its least recent
  entry to the level below (host to disk) or drops it (disk, or host without disk); a run put in together
  goes in tail first, so a chain's tail leaves before its head.
* A disk slot is read as KV only when its header (magic, this file's random token, the slot's write generation,
  the digest, the name) and the checksum over header, ids and KV all agree with what memory says was written
  there; otherwise the page is discarded and counted (``corrupt_pages``), and the caller computes it. The file
  lives in a directory created for it with owner-only permissions and is removed by ``close``.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
import xxhash

from .errors import InvalidRequest
from .names import TOKEN_DTYPE, Extras, content_hasher

_CHAIN_DOMAIN = b"mmcache-tier"
_MAGIC = b"MMCTIER1"
_HEADER = struct.Struct("<8s16sQQ32sQ")  # magic, file token, generation, slot, digest, name; then the checksum
_HEADER_BYTES = 128  # header, checksum and padding: ids and KV start here


@dataclass(frozen=True)
class TierConfig:
    """Budgets in pages (the engine converts its byte budgets) and the read-in cost rule's constants (see the
    module docstring). ``disk_dir`` is where the private directory holding the disk file is created: a disk
    tier below a KV pool needs one; below a metadata-only pool (replay) the disk level keeps no file."""

    host_pages: int = 0
    disk_pages: int = 0
    disk_dir: str | None = None
    preempt_pages: int = 0  # host memory kept for the pages of preempted requests, beside host_pages
    disk_read_bytes_per_s: float = 1e9
    disk_read_latency_s: float = 1e-3
    recompute_tokens_per_s: float = 1e4

    def __post_init__(self):
        for name in ("host_pages", "disk_pages", "preempt_pages"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise InvalidRequest(f"TierConfig.{name} must be a non-negative int, got {v!r}")
        for name in ("disk_read_bytes_per_s", "recompute_tokens_per_s"):
            if not getattr(self, name) > 0:
                raise InvalidRequest(f"TierConfig.{name} must be positive, got {getattr(self, name)!r}")
        if not self.disk_read_latency_s >= 0:
            raise InvalidRequest(f"TierConfig.disk_read_latency_s must be >= 0, got {self.disk_read_latency_s!r}")

    @property
    def enabled(self) -> bool:
        return self.host_pages > 0 or self.disk_pages > 0 or self.preempt_pages > 0


@dataclass
class TierMetrics:
    """Counters of one level. ``hits``: pages read back into the pool; ``evictions``: pages the level gave up
    (to the level below or dropped); ``skipped_pages``: pages found but recomputed by the cost rule."""

    stored_pages: int = 0
    hits: int = 0
    read_in_bytes: int = 0
    read_in_seconds: float = 0.0
    evictions: int = 0
    dropped_pages: int = 0  # evictions that left no copy anywhere
    skipped_pages: int = 0
    corrupt_pages: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(eq=False)
class TierPage:
    """What a level keeps of a page besides its KV: enough to verify a hit and to put it back in the index."""

    name: int
    digest: bytes
    ids: np.ndarray
    extras: Extras | None
    slot: int = -1
    generation: int = 0  # disk: the slot's write count when this page was written there
    level: "_Level | None" = None


def root_digest(root_material: bytes) -> bytes:
    """``d(-1)``: the chain digest a first page's digest is chained on."""
    h = content_hasher(_CHAIN_DOMAIN)
    h.update(b"root")
    h.update(root_material)
    return h.digest()


def chain_digests(parent: bytes, ids: np.ndarray, extras: Mapping[int, Extras], first: int, count: int,
                  page_size: int) -> list[bytes]:
    """Digests of pages ``first .. first + count - 1``, whose ids are ``ids[0 : count * page_size]``, chained on
    ``parent`` (the digest of page ``first - 1``, or ``root_digest``)."""
    ids = np.ascontiguousarray(ids, dtype=TOKEN_DTYPE)
    out = []
    for i in range(count):
        h = content_hasher(_CHAIN_DOMAIN)
        h.update(parent)
        h.update(ids[i * page_size:(i + 1) * page_size].tobytes())
        ex = extras.get(first + i)
        if ex:
            h.update(_encode_extras(ex))
        parent = h.digest()
        out.append(parent)
    return out


def _encode_extras(extras: Extras) -> bytes:
    return b"".join(len(d).to_bytes(2, "little") + d + int(off).to_bytes(4, "little") for d, off in extras)


class _Level:
    """One level's slots and LRU; subclasses keep the KV."""

    label = ""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.entries: OrderedDict[bytes, TierPage] = OrderedDict()  # least recent first
        self._free = list(range(capacity - 1, -1, -1))
        self.taken = 0  # pages removed for a read-in whose slots are not yet given back
        self.metrics = TierMetrics()

    @property
    def full(self) -> bool:
        return not self._free

    def _slot(self) -> int:
        return self._free.pop()

    def release_slot(self, page: TierPage) -> None:
        self._free.append(page.slot)
        page.slot, page.level = -1, None

    def check_invariants(self) -> None:
        used = [p.slot for p in self.entries.values()]
        if len(self.entries) + self.taken + len(self._free) != self.capacity:
            raise AssertionError(f"{self.label}: entries, taken and free slots do not add up to the capacity")
        if len(set(used) | set(self._free)) != len(used) + len(self._free) or len(used) > self.capacity:
            raise AssertionError(f"{self.label}: a slot is both used and free, or used twice")
        for digest, page in self.entries.items():
            if page.digest != digest or page.level is not self:
                raise AssertionError(f"{self.label}: an entry is filed under another digest or level")


class _HostLevel(_Level):
    label = "host"

    def __init__(self, capacity: int, page_shape: tuple | None, dtype, pin: bool, label: str = "host"):
        super().__init__(capacity)
        self.label = label
        self.kv = None
        if page_shape is not None:
            import torch

            try:
                self.kv = torch.empty((capacity, *page_shape), dtype=dtype, pin_memory=pin)
            except (MemoryError, RuntimeError) as e:
                raise InvalidRequest(f"a host tier of {capacity} pages cannot be allocated: "
                                     f"{type(e).__name__}: {e}") from None


class _DiskLevel(_Level):
    """The disk level; with no ``page_shape`` (a metadata-only pool) it keeps no file: its pages are names, ids
    and digests in memory, as the host level's are, and read back as empty KV."""

    label = "disk"

    def __init__(self, capacity: int, directory: str | None, page_shape: tuple | None, dtype, page_size: int):
        super().__init__(capacity)
        self.fd = None
        if page_shape is None:
            return
        import torch

        self.dtype = dtype
        self.page_shape = page_shape
        self.kv_bytes = int(np.prod(page_shape)) * torch.empty(0, dtype=dtype).element_size()
        self.ids_bytes = page_size * np.dtype(TOKEN_DTYPE).itemsize
        self.slot_bytes = _HEADER_BYTES + self.ids_bytes + self.kv_bytes
        self.token = os.urandom(16)
        self.generations = np.zeros(capacity, dtype=np.int64)
        os.makedirs(directory, exist_ok=True)
        self.directory = tempfile.mkdtemp(prefix="mmcache-tier-", dir=directory)  # mode 0700
        self.path = os.path.join(self.directory, "pages.bin")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._closer = weakref.finalize(self, _remove_file, self.fd, self.directory)

    def close(self) -> None:
        if self.fd is not None:
            self._closer()

    def _header(self, page: TierPage) -> bytes:
        return _HEADER.pack(_MAGIC, self.token, page.generation, page.slot, page.digest, page.name)

    def write(self, page: TierPage, kv) -> None:
        """Write the page whole into its slot: header, checksum, ids and KV (a tensor or bytes) in one ``pwrite``;
        nothing without a file."""
        if self.fd is None:
            return
        kv_bytes = kv if isinstance(kv, (bytes, bytearray)) else _tensor_bytes(kv)
        self.generations[page.slot] += 1
        page.generation = int(self.generations[page.slot])
        header = self._header(page)
        ids = np.ascontiguousarray(page.ids, dtype=TOKEN_DTYPE).tobytes()
        check = xxhash.xxh3_64()
        for part in (header, ids, kv_bytes):
            check.update(part)
        head = header + check.intdigest().to_bytes(8, "little")
        blob = head + bytes(_HEADER_BYTES - len(head)) + ids + kv_bytes
        written = os.pwrite(self.fd, blob, page.slot * self.slot_bytes)
        if written != len(blob):
            raise OSError(f"short write to the disk tier ({written} of {len(blob)} bytes)")

    def read(self, page: TierPage) -> bytes | None:
        """The page's KV bytes, or None when the slot does not hold what was written there (see the module
        docstring): torn, truncated, overwritten or from another file. Without a file: empty bytes."""
        if self.fd is None:
            return b""
        try:
            blob = os.pread(self.fd, self.slot_bytes, page.slot * self.slot_bytes)
        except OSError:
            return None
        if len(blob) != self.slot_bytes:
            return None
        header = self._header(page)
        if blob[:len(header)] != header:
            return None
        ids = np.ascontiguousarray(page.ids, dtype=TOKEN_DTYPE).tobytes()
        body = blob[_HEADER_BYTES:]
        if body[:self.ids_bytes] != ids:
            return None
        check = xxhash.xxh3_64()
        for part in (header, ids, body[self.ids_bytes:]):
            check.update(part)
        stored = int.from_bytes(blob[len(header):len(header) + 8], "little")
        return body[self.ids_bytes:] if check.intdigest() == stored else None


def _remove_file(fd: int, directory: str) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
    shutil.rmtree(directory, ignore_errors=True)


class Tiers:
    """The levels below one pool: host memory, then disk (either may be absent). Not thread-safe: the owning
    manager's lock guards it. ``page_shape`` is one page's KV shape ``(layers, 2, kv_heads, page_size,
    head_dim)`` (None for a metadata-only pool); ``pin`` pins host memory (a pool on an accelerator)."""

    def __init__(self, config: TierConfig, page_size: int, page_shape: tuple | None = None, dtype=None,
                 pin: bool = False):
        if not isinstance(config, TierConfig):
            raise InvalidRequest(f"Tiers needs a TierConfig, got {type(config).__name__}")
        if config.disk_pages and page_shape is not None and not config.disk_dir:
            raise InvalidRequest("a disk tier below a KV pool needs TierConfig.disk_dir")
        self.config = config
        self.page_size = page_size
        self.page_shape = page_shape
        self.dtype = dtype
        self.levels: list[_Level] = []
        if config.preempt_pages:  # above the host level: its overflow goes on into it (the module docstring)
            self.levels.append(_HostLevel(config.preempt_pages, page_shape, dtype, pin, label="preempted"))
        self._entry = len(self.levels)  # where a page that no preempted request left comes in
        if config.host_pages:
            self.levels.append(_HostLevel(config.host_pages, page_shape, dtype, pin))
        if config.disk_pages:
            self.levels.append(_DiskLevel(config.disk_pages, config.disk_dir, page_shape, dtype, page_size))
        self._names: dict[int, int] = {}  # name -> pages under it in any level (the cheap test before digests)
        self.page_bytes = 0
        if page_shape is not None:
            import torch

            self.page_bytes = int(np.prod(page_shape)) * torch.empty(0, dtype=dtype).element_size()

    # ---- queries -----------------------------------------------------------------------------------
    def __len__(self) -> int:
        return sum(len(lv.entries) for lv in self.levels)

    def has_name(self, name: int) -> bool:
        return name in self._names

    def level(self, label: str) -> _Level | None:
        return next((lv for lv in self.levels if lv.label == label), None)

    def where(self, digest: bytes) -> str | None:
        """The label of the level holding ``digest``, or None."""
        return next((lv.label for lv in self.levels if digest in lv.entries), None)

    def metrics(self) -> dict:
        """Per level its counters and its pages in use and capacity."""
        return {lv.label: dict(lv.metrics.as_dict(), pages=len(lv.entries), capacity_pages=lv.capacity,
                               page_bytes=self.page_bytes) for lv in self.levels}

    # ---- putting -----------------------------------------------------------------------------------
    def put(self, pages: list[TierPage], kv=None, preempted: bool = False) -> None:
        """File ``pages`` (a run, tail first, so the head is the most recent) in the top level; ``kv`` holds
        their KV as ``(n, *page_shape)`` on the CPU (None for a metadata-only pool). A page whose digest is
        already filed replaces nothing: the copy there is kept and made the most recent. ``preempted`` pages
        (a preempted request's, which it will look up again) go into the ``preempted`` level where there is one."""
        depth = 0 if preempted else self._entry
        for i, page in enumerate(pages):
            if self._find(page.digest) is not None:
                continue
            self._names[page.name] = self._names.get(page.name, 0) + 1
            self._file(depth, page, None if kv is None else kv[i])

    def _find(self, digest: bytes) -> TierPage | None:
        for lv in self.levels:
            page = lv.entries.get(digest)
            if page is not None:
                lv.entries.move_to_end(digest)
                return page
        return None

    def _file(self, depth: int, page: TierPage, kv) -> None:
        """Put ``page`` (KV ``kv``: a tensor, bytes, or None) in level ``depth``, making room by moving that
        level's least recent page down; past the last level the page is dropped."""
        if depth >= len(self.levels):
            self.levels[-1].metrics.dropped_pages += 1
            self._unname(page)
            return
        lv = self.levels[depth]
        if lv.full and not lv.entries:  # every slot is held by a read-in in progress: the page goes down
            self._file(depth + 1, page, kv)
            return
        if lv.full:
            _, old = lv.entries.popitem(last=False)
            old_kv = self._kv_of(lv, old) if depth + 1 < len(self.levels) else None
            lv.metrics.evictions += 1
            lv.release_slot(old)
            self._file(depth + 1, old, old_kv)
        page.slot, page.level = lv._slot(), lv
        if isinstance(lv, _HostLevel):
            if lv.kv is not None and kv is not None:
                lv.kv[page.slot].copy_(self._tensor(kv) if isinstance(kv, (bytes, bytearray)) else kv)
        else:
            try:
                lv.write(page, kv)
            except OSError:  # a full or failing disk: the page is lost, as without a tier
                lv.release_slot(page)
                lv.metrics.dropped_pages += 1
                self._unname(page)
                return
        lv.entries[page.digest] = page
        lv.metrics.stored_pages += 1

    def _kv_of(self, lv: _Level, page: TierPage):
        if isinstance(lv, _HostLevel):
            return None if lv.kv is None else lv.kv[page.slot].clone()
        return lv.read(page)

    def _tensor(self, blob: bytes):
        import torch

        return torch.frombuffer(bytearray(blob), dtype=torch.uint8).view(self.dtype).reshape(self.page_shape)

    def _unname(self, page: TierPage) -> None:
        c = self._names.get(page.name, 0)
        if c <= 1:
            self._names.pop(page.name, None)
        else:
            self._names[page.name] = c - 1

    # ---- taking ------------------------------------------------------------------------------------
    def take_run(self, digests: list[bytes], ids: np.ndarray, extras: Mapping[int, Extras], first: int
                 ) -> list[TierPage]:
        """Remove and return the longest run of pages ``first ..`` found here, verified as the index verifies:
        equal digest (chain), ids (``ids[j * page_size ..]`` for page ``first + j``) and extras. The cost rule
        (module docstring) may cut the run before its first disk page. The pages' slots stay held until
        ``finish`` (read in) or ``give_back``."""
        p = self.page_size
        run: list[TierPage] = []
        for j, digest in enumerate(digests):
            page = next((lv.entries.get(digest) for lv in self.levels if digest in lv.entries), None)
            if page is None or not np.array_equal(page.ids, ids[j * p:(j + 1) * p]) \
                    or page.extras != (extras.get(first + j) or None):
                break
            run.append(page)
        cut = self._cost_cut(run)
        for page in run[cut:]:
            page.level.metrics.skipped_pages += 1
        run = run[:cut]
        for page in run:
            del page.level.entries[page.digest]
            page.level.taken += 1
            self._unname(page)
        return run

    def _cost_cut(self, run: list[TierPage]) -> int:
        """Where the cost rule cuts ``run``: before its first disk page when reading from there on would take
        longer than recomputing those pages (module docstring); else its length."""
        first_disk = next((i for i, page in enumerate(run) if isinstance(page.level, _DiskLevel)), None)
        if first_disk is None:
            return len(run)
        c = self.config
        rest = len(run) - first_disk
        read_s = c.disk_read_latency_s + rest * self.page_bytes / c.disk_read_bytes_per_s
        compute_s = rest * self.page_size / c.recompute_tokens_per_s
        return len(run) if read_s < compute_s else first_disk

    def read_into(self, page: TierPage, dst) -> bool:
        """Copy a taken page's KV into ``dst`` (a tensor of ``page_shape``) and count it (``copy_in``, then
        ``count_read``); False when a disk slot fails its checks."""
        seconds = self.copy_in(page, dst)
        self.count_read(page, seconds)
        return seconds is not None

    def copy_in(self, page: TierPage, dst) -> float | None:
        """Copy a taken page's KV into ``dst``; the seconds it took, or None when a disk slot fails its checks
        (nothing is copied then). Changes nothing here: it may run without the owner's lock while the page is
        taken (its slot is neither reused nor moved until ``finish`` or ``give_back``)."""
        lv = page.level
        t0 = time.perf_counter()
        if isinstance(lv, _HostLevel):
            if lv.kv is not None and dst is not None:
                dst.copy_(lv.kv[page.slot])
        else:
            blob = lv.read(page)
            if blob is None:
                return None
            if dst is not None:
                dst.copy_(self._tensor(blob))
        return time.perf_counter() - t0

    def count_read(self, page: TierPage, seconds: float | None) -> None:
        """Count what ``copy_in`` gave for a taken page: a hit with its bytes and seconds, or a damaged page."""
        m = page.level.metrics
        if seconds is None:
            m.corrupt_pages += 1
            return
        m.hits += 1
        m.read_in_bytes += self.page_bytes
        m.read_in_seconds += seconds

    def finish(self, page: TierPage) -> None:
        """Give up a taken page's slot: it was read in, or found damaged."""
        lv = page.level
        lv.taken -= 1
        lv.release_slot(page)

    def give_back(self, page: TierPage) -> None:
        """Put a taken page back where it was, as the most recent entry of its level (it was not read in)."""
        lv = page.level
        lv.taken -= 1
        lv.entries[page.digest] = page
        self._names[page.name] = self._names.get(page.name, 0) + 1

    def discard(self, digests) -> int:
        """Drop the pages filed under ``digests`` (a page that re-entered the pool by another way); returns how
        many were dropped."""
        n = 0
        for digest in digests:
            for lv in self.levels:
                page = lv.entries.pop(digest, None)
                if page is not None:
                    lv.release_slot(page)
                    self._unname(page)
                    n += 1
        return n

    def clear(self) -> int:
        """Drop every page (a taken page's slot stays held until it is finished or given back)."""
        n = 0
        for lv in self.levels:
            n += self.discard(list(lv.entries))
        return n

    def close(self) -> None:
        """Remove the disk file and its directory (also done when the tiers are collected)."""
        for lv in self.levels:
            if isinstance(lv, _DiskLevel):
                lv.close()

    def check_invariants(self) -> None:
        seen: set = set()
        names: dict[int, int] = {}
        for lv in self.levels:
            lv.check_invariants()
            if seen & lv.entries.keys():
                raise AssertionError("a page is in two levels")
            seen |= lv.entries.keys()
            for page in lv.entries.values():
                names[page.name] = names.get(page.name, 0) + 1
        if names != self._names:
            raise AssertionError("the name counts differ from the pages filed")


def _tensor_bytes(kv) -> bytes:
    import torch

    return kv.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
