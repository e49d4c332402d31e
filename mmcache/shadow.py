"""Shadow mode: a real manager in mode ``off`` with a metadata-only mirror in mode ``on`` that counts what
reuse would have given, without changing a page or an output.

``make_manager`` builds the manager a ``CacheConfig`` asks for: an ``AllocationManager`` for modes ``on`` and
``off``, a ``ShadowedManager`` for ``shadow``. Invariants of a ``ShadowedManager``:

* Every call is the real manager's: its result, its errors and its pages are those of mode ``off``.
* Each call that took effect on the real manager reaches the mirror once, and the mirror sees the calls in the
  order they took effect on the real one (they are queued under the wrapper's lock, which each changing call
  holds around its real call), whichever threads made them.
* The mirror runs outside every lock a real call holds, one thread at a time (``_turn``): a thread that
  waited for the turn finds its own call already applied. A slow mirror never delays a real call's effect.
* The mirror never fails the real request: a typed error from it (it ran out of pages, or its state refused
  the call) counts in ``shadow_failures`` and drops that request from the mirror until its end call (teardown
  or abort) reaches the mirror. Any other exception is a bug and propagates.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import replace
from typing import Callable, Sequence

import numpy as np

from .errors import InvalidRequest, MmcacheError
from .manager import AdmitResult, AllocationManager, CacheConfig, PreparedPrompt, RequestView, ResumeResult
from .names import Fingerprint, HashFn, MediaItem, as_token_array
from .pool import KVSpec

Mirrored = Callable[[AllocationManager], object]


def make_manager(config: CacheConfig, fingerprint: Fingerprint, kv_spec: KVSpec | None = None,
                 hash_fn: HashFn | None = None) -> "AllocationManager | ShadowedManager":
    """The manager ``config.mode`` asks for: mode ``shadow`` gets a real manager in mode ``off`` (with
    ``kv_spec``) wrapped with a metadata-only mirror of the same size in mode ``on``."""
    if not isinstance(config, CacheConfig):
        raise InvalidRequest(f"make_manager needs a CacheConfig, got {type(config).__name__}")
    if config.mode != "shadow":
        return AllocationManager(config, fingerprint, kv_spec, hash_fn)
    real = AllocationManager(replace(config, mode="off"), fingerprint, kv_spec, hash_fn)
    mirror = AllocationManager(replace(config, mode="on"), fingerprint, None, hash_fn, reuse_gates=False)
    return ShadowedManager(real, mirror)


class ShadowedManager:
    """A real manager in mode ``off`` and its mirror, with the manager's public surface; see the module
    docstring. ``real`` holds the pages; ``shadow`` (mode ``on``, no KV) counts what would have matched."""

    def __init__(self, real: AllocationManager, shadow: AllocationManager):
        if not isinstance(real, AllocationManager) or not isinstance(shadow, AllocationManager):
            raise InvalidRequest("ShadowedManager wraps two AllocationManagers")
        if real.config.mode != "off" or shadow.mode != "on":
            raise InvalidRequest(f"a shadow needs a real manager in mode off and a mirror in mode on, got "
                                 f"{real.config.mode!r} and {shadow.mode!r}")
        if real.page_size != shadow.page_size:
            raise InvalidRequest(f"real and mirror page sizes differ ({real.page_size}, {shadow.page_size})")
        self.real, self.shadow = real, shadow
        self.config = replace(real.config, mode="shadow")
        self.mode = "shadow"
        self.shadow_failures = 0
        self._order = threading.Lock()  # held around a changing real call and the queueing of its mirror
        self._turn = threading.Lock()  # held by the one thread applying queued calls to the mirror
        self._queue: deque = deque()  # (request id, mirrored call, ending), in the order the calls took effect
        self._dropped: set = set()  # requests the mirror failed, until their end call

    # ---- what the real manager answers -------------------------------------------------------------
    page_size = property(lambda self: self.real.page_size)
    reuse_off = property(lambda self: self.real.reuse_off)
    pool = property(lambda self: self.real.pool)
    index = property(lambda self: self.real.index)
    metrics = property(lambda self: self.real.metrics)
    num_requests = property(lambda self: self.real.num_requests)

    def __contains__(self, request_id) -> bool:
        return request_id in self.real

    def state(self, request_id) -> RequestView:
        return self.real.state(request_id)

    def pages_held(self, request_id) -> int:
        return self.real.pages_held(request_id)

    def seq_len(self, request_id) -> int:
        return self.real.seq_len(request_id)

    def page_table(self, request_id) -> np.ndarray:
        return self.real.page_table(request_id)

    def match_cap(self, num_tokens: int, whole: bool = False) -> int:
        return self.real.match_cap(num_tokens, whole)

    def peek(self, prepared: PreparedPrompt, whole: bool = False) -> int:
        return self.real.peek(prepared, whole)

    def metadata_nbytes(self) -> int:
        return self.real.metadata_nbytes()

    # ---- calls, mirrored ---------------------------------------------------------------------------
    def prepare(self, token_ids, media: Sequence[MediaItem] = (), salt: bytes | str | None = b"",
                request_id: object = None) -> PreparedPrompt:
        """Named by the mirror (mode ``on``), so one ``PreparedPrompt`` serves both managers."""
        return self.shadow.prepare(token_ids, media, salt, request_id)

    def admit(self, request_id, prompt, media: Sequence[MediaItem] = (), salt: bytes | str | None = b"",
              whole: bool = False, readmission: bool = False) -> AdmitResult:
        if not isinstance(prompt, PreparedPrompt):
            prompt = self.prepare(prompt, media, salt, request_id)
        elif len(prompt.names) != len(prompt.ids) // self.page_size:
            raise InvalidRequest("prepared prompt was named for another page size or mode", request_id)
        return self._call(request_id, lambda m: m.admit(request_id, prompt, whole=whole, readmission=readmission))

    def reserve(self, request_id, num_tokens: int) -> np.ndarray:
        """The mirror reserves up to the same end: its request may have been seeded further than the real one."""
        with self._order:
            pages = self.real.reserve(request_id, num_tokens)
            end = self.real.seq_len(request_id) + int(num_tokens)
            self._queue.append((request_id, lambda s: s.reserve(request_id, max(0, end - s.seq_len(request_id))),
                                False))
        self._drain()
        return pages

    def commit(self, request_id, token_ids) -> None:
        """The mirror commits what it has not written already (positions its match covered are written)."""
        ids = as_token_array(token_ids, request_id)  # once, for both managers
        with self._order:
            self.real.commit(request_id, ids)
            end = self.real.seq_len(request_id)
            self._queue.append((request_id, lambda s: _commit_after(s, request_id, ids, end), False))
        self._drain()

    def teardown(self, request_id) -> int:
        return self._call(request_id, lambda m: m.teardown(request_id), ending=True)

    def abort(self, request_id, requeue: bool = False) -> None:
        self._call(request_id, lambda m: m.abort(request_id, requeue), ending=True)

    def suspend(self, request_id, offload: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
        with self._order:
            ids = self.real.suspend(request_id, offload)
            self._queue.append((request_id, lambda s: s.suspend(request_id), False))
        self._drain()
        return ids

    def resume(self, request_id, readmission: bool = False) -> ResumeResult:
        return self._call(request_id, lambda m: m.resume(request_id, readmission=readmission))

    def protect_prefix(self, request_id, num_tokens: int) -> None:
        self._call(request_id, lambda m: m.protect_prefix(request_id, num_tokens))

    def release_oldest(self, request_id, num_pages: int) -> np.ndarray:
        return self._call(request_id, lambda m: m.release_oldest(request_id, num_pages))

    def clear_cache(self) -> int:
        """The pages both managers freed (the real one, in mode ``off``, caches none)."""
        freed = self.real.clear_cache()
        self._drain()
        return freed + self.shadow.clear_cache()

    def check_invariants(self) -> None:
        self.real.check_invariants()
        self.shadow.check_invariants()

    # ---- the mirror --------------------------------------------------------------------------------
    def _call(self, request_id, call: Mirrored, ending: bool = False):
        """``call`` on the real manager; once it took effect, the same call queued for the mirror."""
        with self._order:
            result = call(self.real)
            self._queue.append((request_id, call, ending))
        self._drain()
        return result

    def _drain(self) -> None:
        """Apply the queued calls to the mirror, oldest first, outside the real manager's locks."""
        with self._turn:
            while self._queue:
                self._apply(*self._queue.popleft())

    def _apply(self, request_id, call: Mirrored, ending: bool) -> None:
        if request_id in self._dropped:
            if ending:
                self._dropped.discard(request_id)
            return
        try:
            call(self.shadow)
        except MmcacheError:  # the real call took effect: the mirror stops counting this request instead
            self.shadow_failures += 1
            if request_id in self.shadow:
                self.shadow.abort(request_id)
            if not ending:
                self._dropped.add(request_id)


def _commit_after(mirror: AllocationManager, request_id, ids: np.ndarray, end: int) -> None:
    """Commit on the mirror the part of ``ids`` (written up to ``end`` on the real manager) it lacks."""
    have = mirror.seq_len(request_id)
    if end > have:
        mirror.commit(request_id, ids[max(0, have - (end - len(ids))):])
