"""The encoder-output store: encoder outputs keyed by what produced them, computed once.

``key = BLAKE2b-256(encoder fingerprint || content digest || salt)`` (``names.content_hasher``, each field
length-prefixed) where the content digest is a media digest (``names.media_digest``) for vision and audio towers,
or a digest of the token ids and max length for text encoders. A key is never verified against the content it
stands for, so it must resist collisions made on purpose (an xxh3_128 key did not). An entry holds the output
tensors and what the host needs to place them (``meta``: placeholder count, grid sizes, ...).

Invariants (``check_invariants``):

* ``bytes`` equals the sum of the entries' tensor bytes and never exceeds ``budget_bytes``.
* Every entry has a kind (``"output"`` unless the host says otherwise, e.g. ``"position_bias"``);
  ``metrics`` counts all entries and ``metrics.kinds[kind]`` each kind's, whose bytes and entries equal its
  entries' own.
* An entry is held while any lease on it is open; held entries are never evicted. Eviction is least recently
  used among unheld entries.
* An entry that cannot fit (larger than the budget, or the budget is pinned by held entries) bypasses the
  store: the caller still gets its outputs, nothing is stored, ``bypasses`` counts it.
* A key is computed at most once at a time: concurrent ``get_or_compute`` calls for one key wait for the
  first; if it fails, the next waiter computes; if its outputs bypassed the store, the waiters get those same
  outputs (each lease ``bypassed``), not a computation each.
* Different salts give different keys, so tenants share no entries.
* ``put`` copies every output tensor into memory of its own (contiguous, exactly its bytes), so the budget
  counts every byte an entry keeps alive (a view into a larger tensor or a numpy array keeps nothing of it
  alive) and the caller's tensors stay the caller's. ``meta`` holds plain values only (None, bool, int, float,
  str, bytes, numpy scalars, and lists, tuples and str-keyed dicts of them), not counted in the budget; a
  tensor or array there is refused (``StoreEntryRejected``).
* A lease hands out read-only views of the entry's ``outputs`` and ``meta`` mappings: a name cannot be pointed
  at another tensor, and meta is frozen on ``put`` (lists become tuples, nested dicts read-only mappings). The
  tensors themselves are returned as stored (no copy per hit): callers must not modify them in place.
* Each lease is one hold: releasing it again, or releasing a copy of it, does nothing more.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping

import numpy as np
import torch

from .checks import unicode_text
from .errors import InvalidRequest, StoreEntryRejected
from .names import DIGEST_BYTES, Namer, content_hasher

STORE_KEY_BYTES = DIGEST_BYTES


def store_key(encoder_fingerprint: str | bytes, content_digest: bytes, salt: bytes | str | None = b"") -> bytes:
    """32-byte key of an encoder output; every field is length-prefixed so none can bleed into another. The salt
    is checked (type, text, length) by ``Namer.salt_bytes``, as for page names."""
    if not isinstance(encoder_fingerprint, (str, bytes, bytearray)) or not encoder_fingerprint:
        raise InvalidRequest(f"encoder fingerprint must be a non-empty str or bytes, got {encoder_fingerprint!r}")
    if isinstance(encoder_fingerprint, str) and not unicode_text(encoder_fingerprint):
        raise InvalidRequest("encoder fingerprint is not valid Unicode text")
    fp = encoder_fingerprint.encode("utf-8") if isinstance(encoder_fingerprint, str) else bytes(encoder_fingerprint)
    if not isinstance(content_digest, (bytes, bytearray)) or not content_digest:
        raise InvalidRequest("content digest must be non-empty bytes")
    s = Namer.salt_bytes(salt)
    h = content_hasher(b"mmcache-store")
    for part in (fp, bytes(content_digest), s):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


@dataclass(frozen=True)
class OutputSpec:
    """What an encoder declares it produces: per output name, a shape (``None`` = any size) and a dtype."""

    tensors: Mapping[str, tuple[tuple, torch.dtype]]

    def __post_init__(self):
        items = self.tensors.items() if isinstance(self.tensors, Mapping) else [(None, self.tensors)]
        for name, declared in items:
            if not (isinstance(name, str) and _declaration(declared)):
                raise InvalidRequest(f"an output spec maps names to (shape of ints or None, torch.dtype), got "
                                     f"{name!r}: {declared!r}")

    def check(self, key: bytes, outputs: Mapping[str, torch.Tensor]) -> None:
        if set(outputs) != set(self.tensors):
            raise StoreEntryRejected(key.hex(), f"outputs {sorted(outputs)} differ from declared {sorted(self.tensors)}")
        for name, (shape, dtype) in self.tensors.items():
            t = outputs[name]
            if not isinstance(t, torch.Tensor):
                raise StoreEntryRejected(key.hex(), f"output {name!r} is {type(t).__name__}, not a tensor")
            if t.dtype != dtype:
                raise StoreEntryRejected(key.hex(), f"output {name!r} has dtype {t.dtype}, declared {dtype}")
            if len(t.shape) != len(shape) or any(w is not None and w != s for w, s in zip(shape, t.shape)):
                raise StoreEntryRejected(key.hex(), f"output {name!r} has shape {tuple(t.shape)}, declared {shape}")


def _declaration(declared) -> bool:
    """Whether ``declared`` is ``(shape, dtype)``: a tuple of sizes (ints >= 0, or None for any) and a dtype."""
    if not (isinstance(declared, tuple) and len(declared) == 2):
        return False
    shape, dtype = declared
    return isinstance(shape, tuple) and isinstance(dtype, torch.dtype) and all(
        w is None or (isinstance(w, int) and not isinstance(w, bool) and w >= 0) for w in shape)


@dataclass
class StoreMetrics:
    """Counts over every entry; ``kinds`` holds the same counts per kind of entry (``"output"``, the default, and
    whatever else a host stores, such as ``"position_bias"``), so a hit rate can be read for prompt outputs
    alone."""

    lookups: int = 0
    hits: int = 0
    computes: int = 0  # encoder runs made through get_or_compute
    inserts: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    bypasses: int = 0
    bytes: int = 0
    peak_bytes: int = 0
    entries: int = 0
    kinds: dict = field(default_factory=dict)  # kind -> StoreMetrics of that kind (whose own kinds stay empty)

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "kinds"}
        if self.kinds:
            out["kinds"] = {kind: m.as_dict() for kind, m in self.kinds.items()}
        return out

    def kind(self, kind: str) -> "StoreMetrics":
        """The counts of one kind of entry (all zero for a kind never seen)."""
        return self.kinds.get(kind) or StoreMetrics()


@dataclass
class _Entry:
    outputs: Mapping  # read-only views, handed to every lease
    meta: Mapping
    nbytes: int
    kind: str
    holders: set = field(default_factory=set)  # the hold tokens of the open leases

    @property
    def holds(self) -> int:
        return len(self.holders)


_HOLD_TOKENS = itertools.count(1)


@dataclass
class Lease:
    """A handle on stored outputs; the entry stays resident until ``release`` (or the ``with`` block ends).
    ``outputs`` and ``meta`` are read-only mappings; release is idempotent, for a copy of the lease too."""

    key: bytes
    outputs: Mapping[str, torch.Tensor]
    meta: Mapping
    hit: bool
    bypassed: bool = False
    _store: "EncoderOutputStore | None" = field(default=None, repr=False)
    _hold: int = field(default=0, repr=False)  # this lease's token in the entry's holders

    def __post_init__(self):
        if not isinstance(self.outputs, MappingProxyType):
            self.outputs = MappingProxyType(dict(self.outputs))
        if not isinstance(self.meta, MappingProxyType):
            self.meta = MappingProxyType(dict(self.meta))

    def release(self) -> None:
        if self._store is not None:
            store, self._store = self._store, None
            store._release(self.key, self._hold)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@dataclass
class _Flight:
    """One computation of a key in progress: waiters wait on ``done``; ``bypassed`` holds its outputs and meta
    when they did not fit the store, so the waiters take those instead of computing them again, one by one."""

    done: threading.Event = field(default_factory=threading.Event)
    bypassed: tuple | None = None


def _key(key) -> bytes | None:
    """``key`` as bytes when it has a store key's size (``store_key``'s, or the same bytes in a bytearray)."""
    if isinstance(key, (bytes, bytearray)) and len(key) == STORE_KEY_BYTES:
        return bytes(key)
    return None


def _check_spec(spec) -> None:
    if spec is not None and not isinstance(spec, OutputSpec):
        raise InvalidRequest(f"spec must be an OutputSpec or None, got {type(spec).__name__}")


def _check_key(key) -> bytes:
    k = _key(key)
    if k is None:
        raise InvalidRequest(f"store keys are the {STORE_KEY_BYTES}-byte digests made by store_key")
    return k


def _own(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` in memory of its own. Always a copy: a tensor over a numpy array, or over a
    slice of one, reports only its own bytes as its storage, yet keeps the whole array alive."""
    return t.detach().clone(memory_format=torch.contiguous_format)


_PLAIN = (type(None), bool, int, float, str, bytes, np.bool_, np.integer, np.floating)  # all immutable


def _frozen(value: object) -> object:
    """A plain meta value (``_plain``) that nobody can change: lists become tuples, dicts read-only mappings, so
    neither the caller's later edits nor a lease's reach the entry."""
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return MappingProxyType({k: _frozen(v) for k, v in value.items()})
    return value


def _plain(value: object, depth: int = 0) -> bool:
    """Whether ``value`` is a plain meta value: None, bool, int, float, str, bytes, a numpy scalar, or lists,
    tuples and str-keyed dicts of them (nested at most 8 deep)."""
    if isinstance(value, _PLAIN):
        return True
    if depth >= 8:
        return False
    if isinstance(value, (list, tuple)):
        return all(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v, depth + 1) for k, v in value.items())
    return False


def _check_kind(kind) -> str:
    if not isinstance(kind, str) or not kind:
        raise InvalidRequest(f"an entry kind must be a non-empty str, got {kind!r}")
    return kind


def _check_outputs(key: bytes, outputs, spec: OutputSpec | None) -> None:
    """``StoreEntryRejected`` unless ``outputs`` is a non-empty mapping of str to strided tensors that ``spec``
    (an ``OutputSpec`` or None, else ``InvalidRequest``) accepts."""
    if not isinstance(outputs, Mapping) or not outputs:
        raise StoreEntryRejected(key.hex(), "outputs must be a non-empty mapping of name to tensor")
    if not all(isinstance(name, str) for name in outputs):
        raise StoreEntryRejected(key.hex(), f"output names must be str, got {list(outputs)!r}")
    _check_spec(spec)
    for name, t in outputs.items():
        if not isinstance(t, torch.Tensor):
            raise StoreEntryRejected(key.hex(), f"output {name!r} is {type(t).__name__}, not a tensor")
        if t.layout != torch.strided or t.is_nested:  # no single storage to count (sparse, nested)
            what = "nested" if t.is_nested else str(t.layout)
            raise StoreEntryRejected(key.hex(), f"output {name!r} is a {what} tensor, not a strided one")
    if spec is not None:
        spec.check(key, outputs)


def _check_meta(key: bytes, meta) -> None:
    """``StoreEntryRejected`` unless ``meta`` is None or a str-keyed mapping of plain values (``_plain``)."""
    if meta is not None and not isinstance(meta, Mapping):
        raise StoreEntryRejected(key.hex(), f"meta must be a mapping, got {type(meta).__name__}")
    if not all(isinstance(k, str) for k in (meta or {})) or not _plain(list((meta or {}).values())):
        raise StoreEntryRejected(key.hex(), "meta holds plain values only (None, bool, int, float, str, bytes, "
                                            "and lists, tuples and str-keyed dicts of them)")


def _nbytes(outputs: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in outputs.values())


class EncoderOutputStore:
    def __init__(self, budget_bytes: int):
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise InvalidRequest(f"budget_bytes must be a non-negative int, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self.metrics = StoreMetrics()
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        # Reentrant: the garbage collector may finalise an abandoned request inside an allocation made under it,
        # on this thread, and that request's leases are released (``_release`` takes it again)
        self._lock = threading.RLock()
        self._computing: dict[bytes, _Flight] = {}

    def __contains__(self, key: bytes) -> bool:
        return _key(key) in self._entries  # a malformed key names no entry

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[bytes]:
        """The keys of the entries stored now, least recently used first (a snapshot)."""
        with self._lock:
            return list(self._entries)

    def _count(self, kind: str, **deltas: int) -> None:
        """Add ``deltas`` to the total counts and to ``kind``'s (under the lock)."""
        per_kind = self.metrics.kinds.get(kind)
        if per_kind is None:
            per_kind = self.metrics.kinds[kind] = StoreMetrics()
        for counts in (self.metrics.__dict__, per_kind.__dict__):  # on every lookup: no attribute protocol
            for name, delta in deltas.items():
                counts[name] += delta
            if "bytes" in deltas:
                counts["peak_bytes"] = max(counts["peak_bytes"], counts["bytes"])

    def acquire(self, key: bytes, kind: str = "output") -> Lease | None:
        """A held lease on the entry for ``key``, or None on a miss. Counts a lookup of ``kind``."""
        key = _check_key(key)
        _check_kind(kind)
        with self._lock:
            self._count(kind, lookups=1)
            return self._hold(key)

    def _hold(self, key: bytes) -> Lease | None:
        e = self._entries.get(key)
        if e is None:
            return None
        token = next(_HOLD_TOKENS)
        e.holders.add(token)
        self._entries.move_to_end(key)
        self._count(e.kind, hits=1)
        return Lease(key, e.outputs, e.meta, hit=True, _store=self, _hold=token)

    def put(self, key: bytes, outputs: Mapping[str, torch.Tensor], meta: Mapping | None = None,
            spec: OutputSpec | None = None, kind: str = "output") -> Lease:
        """Store outputs under ``key`` (validated against ``spec``) as an entry of ``kind`` (what the metrics
        count it as) and return a held lease on them.

        If an entry already exists it is kept and returned. If the outputs cannot fit, the lease carries
        them with ``bypassed=True`` and nothing is stored.
        """
        key = _check_key(key)
        _check_kind(kind)
        _check_outputs(key, outputs, spec)
        _check_meta(key, meta)
        outs = MappingProxyType({k: _own(v) for k, v in outputs.items()})
        meta = _frozen(dict(meta or {}))
        size = _nbytes(outs)
        with self._lock:
            lease = self._hold(key)
            if lease is not None:
                self._count(self._entries[key].kind, hits=-1)  # not a lookup hit: a racing insert of the same key
                return lease
            if size > self.budget_bytes or not self._make_room(size):
                self._count(kind, bypasses=1)
                return Lease(key, outs, meta, hit=False, bypassed=True)
            token = next(_HOLD_TOKENS)
            self._entries[key] = _Entry(outs, meta, size, kind, {token})
            self._count(kind, inserts=1, bytes=size, entries=1)
            return Lease(key, outs, meta, hit=False, _store=self, _hold=token)

    def _make_room(self, size: int) -> bool:
        free = self.budget_bytes - self.metrics.bytes
        if free >= size:
            return True
        unheld = sum(e.nbytes for e in self._entries.values() if e.holds == 0)
        if free + unheld < size:
            return False
        for k in [k for k, e in self._entries.items() if e.holds == 0]:
            if self.budget_bytes - self.metrics.bytes >= size:
                break
            e = self._entries.pop(k)
            self._count(e.kind, bytes=-e.nbytes, entries=-1, evictions=1, evicted_bytes=e.nbytes)
        return True

    def get_or_compute(self, key: bytes, compute: Callable[[], tuple[Mapping[str, torch.Tensor], Mapping]],
                       spec: OutputSpec | None = None, kind: str = "output") -> Lease:
        """The held entry for ``key``, running ``compute() -> (outputs, meta)`` on a miss and storing the result
        as an entry of ``kind``.

        Concurrent callers with the same key wait for one computation. An exception from ``compute``
        propagates to its caller and stores nothing. A malformed key or spec is refused before anything is
        computed.
        """
        key = _check_key(key)
        _check_spec(spec)
        _check_kind(kind)
        lease, flight = self._found_or_leading(key, kind)
        if lease is not None:
            return lease
        try:
            result = compute()
            if not (isinstance(result, tuple) and len(result) == 2):
                raise StoreEntryRejected(key.hex(), f"compute must return (outputs, meta), got {type(result).__name__}")
            outputs, meta = result
            with self._lock:
                self._count(kind, computes=1)
            lease = self.put(key, outputs, meta, spec, kind)
            if lease.bypassed:
                flight.bypassed = (lease.outputs, lease.meta)
            return lease
        finally:
            with self._lock:
                self._computing.pop(key, None)
            flight.done.set()

    def _found_or_leading(self, key: bytes, kind: str) -> tuple[Lease | None, _Flight | None]:
        """A lease on ``key``'s entry (after waiting for a computation of it already running), or the outputs
        that computation could not store; else ``(None, flight)``: this caller computes ``key``, under ``flight``."""
        while True:
            with self._lock:
                self._count(kind, lookups=1)
                lease = self._hold(key)
                if lease is not None:
                    return lease, None
                waiting = self._computing.get(key)
                if waiting is None:
                    flight = self._computing[key] = _Flight()
                    return None, flight
            waiting.done.wait()
            with self._lock:
                if waiting.bypassed is not None:  # computed but not stored: the same outputs, not a second run
                    self._count(kind, bypasses=1)
                    return Lease(key, *waiting.bypassed, hit=False, bypassed=True), None
                self._count(kind, lookups=-1)  # the retry counts as one lookup, not two

    def _release(self, key: bytes, token: int) -> None:
        with self._lock:
            e = self._entries.get(key)
            if e is not None:
                e.holders.discard(token)  # a copy of a released lease holds nothing any more

    def held(self, key: bytes) -> int:
        e = self._entries.get(_key(key))
        return e.holds if e else 0

    def check_invariants(self) -> None:
        with self._lock:
            total = sum(e.nbytes for e in self._entries.values())
            if total != self.metrics.bytes:
                raise AssertionError(f"bytes counter {self.metrics.bytes} differs from entries {total}")
            if total > self.budget_bytes:
                raise AssertionError(f"store holds {total} bytes over its budget {self.budget_bytes}")
            if any(not isinstance(e.outputs, MappingProxyType) for e in self._entries.values()):
                raise AssertionError("an entry's outputs are not a read-only mapping")
            if self.metrics.entries != len(self._entries):
                raise AssertionError(f"entries counter {self.metrics.entries} differs from {len(self._entries)}")
            for kind, m in self.metrics.kinds.items():
                held = [e for e in self._entries.values() if e.kind == kind]
                if (m.bytes, m.entries) != (sum(e.nbytes for e in held), len(held)):
                    raise AssertionError(f"kind {kind!r} counts {m.bytes} bytes in {m.entries} entries, its "
                                         f"entries hold {sum(e.nbytes for e in held)} in {len(held)}")
            if any(e.kind not in self.metrics.kinds for e in self._entries.values()):
                raise AssertionError("an entry's kind has no counts")
