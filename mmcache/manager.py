"""The allocation manager of one pool: seeding, allocation, storing, suspension, windowing, eviction.

One manager serves one (node, label, rank) pool and holds one lock; every method that touches pages takes
it. Names are computed outside the lock (``prepare`` for a prompt, ``commit`` for the pages it fills, checked
under the lock against what they were computed from); the lock covers probe, compare and increment, and a
commit's work there grows with the pages it completes, not with the context.

Per request it keeps ``page_indices`` (the request's pages in sequence order, ``-1`` where a windowed label
released a page), ``seq_len`` (tokens whose KV is written) and ``position_id_start`` (0: positions are
absolute).

Invariants (``check_invariants``):

* Every page's owner count equals the number of live requests holding it plus one if the index holds it.
* A page is free exactly when its count is 0.
* Only full pages are shared: a request's tail page (the page holding position ``seq_len`` and every
  reserved page after it) has owner count 1.
* Seeding matches whole pages and leaves at least one prompt token to compute (the first output needs
  logits), so the write frontier opens a fresh page and nothing is copied. A host whose forward gives each
  row the same bits whatever else it computes may ask for ``whole`` matches (``match_cap``): a prompt that
  ends on a page boundary may then be matched to its end (``seq_len`` = its length), and the host computes
  its last token's logits again from the matched pages without writing that token's KV; the next write still
  opens a fresh page.
* A failed call leaves the manager as it was, except that cached pages may have been evicted; a live request
  never fails to allocate while the index alone holds a page (``alloc_failures_cache_held`` stays 0). This
  holds for windowed labels too: a page ``release_oldest`` gave back to the index while the request keeps
  later pages of its chain is reclaimed by detaching those later pages from the index (``eviction``).

Second tier (``tier``, optional, mode ``on`` only): a cold tail that eviction frees moves down to host memory
and disk instead of being lost. Admission walks the pool's index, then the tiers; a tier hit takes fresh pool
pages, reads their KV in (synchronously, under the lock), and puts them back in the index, held by the request
as a pool hit is. A page is in one place: a page read in leaves its tier, and a page published while a tier
holds its copy drops that copy. A read-in that fails (a damaged disk page, an exception) keeps what was read
before it and returns every other page it took. With ``admit(defer_read_in=True)`` the copy is the host's to
run outside the lock (``read_pending``, on any thread) while the request waits: its pages are reserved and held
by it (``AdmitResult.pending_tokens``), and ``complete_read_in`` puts what was read in the index and advances
``seq_len``. Any other call on the request (and its end) first waits for the copy and completes it, and a copy
not yet started is cancelled, so an aborted request returns every page.

Modes: ``on`` (seed and store) and ``off`` (every page freed at teardown, no names). Mode ``shadow`` is not
this class's: ``shadow.make_manager`` builds a ``ShadowedManager`` (a manager in mode ``off`` and its
metadata-only mirror) for it.

Reuse gates: mode ``on`` runs as ``off`` (``reuse_off`` says why) where reuse could change outputs before the
gate that covers it exists: a tensor-parallel fingerprint (``tp_size > 1``) without an ``agreement`` (the ranks'
matched lengths must be equal: ``mmcache.agreement``; with one, every admission seeds the group's shortest match,
trimmed before any page is counted, and the manager keeps no tiers) or a KV dtype outside ``REUSE_KV_DTYPES``
(the RFC's dtype scoping). A manager built with
``reuse_gates=False`` holds no KV a forward reads (a measurement, such as a shadow's mirror), so the gates do not
apply to it and it counts what reuse would give.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import numpy as np

from .errors import AllocationFailed, DuplicateRequest, GroupFailed, InvalidRequest, RequestStateError, UnknownRequest
from .checks import positive_int
from .eviction import evict
from .index import PrefixIndex
from .metrics import CacheMetrics
from .names import Fingerprint, HashFn, MediaItem, Namer, as_token_array, page_extras
from .pool import MAX_PAGES, KVSpec, PagePool
from .tier import TierPage, Tiers, chain_digests, root_digest

MODES = ("on", "off", "shadow")
REUSE_KV_DTYPES = ("float32", "bfloat16")
"""The KV dtypes that passed the bit-exact gate (cache on equals cache off bit for bit under the same schedule,
tests/test_engine_exact.py); a pool of any other dtype runs with reuse off. The one list of them."""
NO_KV = "none"  # a fingerprint's kv_dtype for a manager that names pages but keeps no KV (replay, tests)
ROOTS_KEPT = 1024  # root materials (fingerprint + salt) kept before unused ones are forgotten (index.forget_roots)
STORE_AT = ("teardown", "prefill")


@dataclass(frozen=True)
class CacheConfig:
    """One pool's settings. ``store_at`` says when a request's full prompt pages enter the index: at
    ``"teardown"`` (the default), when the request ends, which is the RFC's rule and the one a host adopting the
    core gets without asking; or at ``"prefill"``, as ``commit`` fills them, so that requests running at the same
    time share a prefix at once. The reference engine, which batches such requests together, asks for
    ``"prefill"`` (``EngineConfig.store_at``). Generated pages enter at teardown either way."""

    num_pages: int
    page_size: int = 128
    mode: str = "on"
    store_at: str = "teardown"

    def __post_init__(self):
        if not positive_int(self.num_pages):
            raise InvalidRequest(f"num_pages must be a positive int, got {self.num_pages!r}")
        if self.num_pages > MAX_PAGES:
            raise InvalidRequest(f"num_pages must be at most {MAX_PAGES} (page ids are int32), got {self.num_pages}")
        if not positive_int(self.page_size):
            raise InvalidRequest(f"page_size must be a positive int, got {self.page_size!r}")
        if self.mode not in MODES:
            raise InvalidRequest(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.store_at not in STORE_AT:
            raise InvalidRequest(f"store_at must be one of {STORE_AT}, got {self.store_at!r}")


@dataclass(frozen=True)
class PreparedPrompt:
    """A prompt with its page names, computed outside the lock by ``AllocationManager.prepare``."""

    ids: np.ndarray
    names: np.ndarray  # names of the prompt's full pages (empty in mode off)
    extras: dict
    root: int
    root_material: bytes
    media: tuple = ()  # what the names were computed from besides ``ids``, so that another rank of a
    salt: bytes | str | None = b""  # tensor-parallel group can name the same prompt under its own fingerprint


@dataclass(frozen=True)
class AdmitResult:
    matched_tokens: int  # tokens seeded from the index; prefill starts here
    matched_pages: int
    forfeit_tokens: int  # tokens after the match that a live request held but had not published
    pending_tokens: int = 0  # tokens after the match a deferred read-in brings in (``complete_read_in``)


@dataclass(frozen=True)
class ResumeResult:
    restored_tokens: int  # tokens re-seeded from the index (and read in from the tiers); seq_len is now this
    pending_ids: np.ndarray  # written ids after that, which the host restores or recomputes
    reading_tokens: int = 0  # of those, the first ones a deferred read-in brings in (``complete_read_in``)


@dataclass(frozen=True)
class RequestView:
    """A snapshot of one request's allocation, for the host."""

    request_id: object
    page_indices: np.ndarray
    seq_len: int
    position_id_start: int
    matched_tokens: int
    suspended: bool


@dataclass(frozen=True)
class _Lookup:
    """What one admission's lookup added to the metrics, so that a requeued abort can take exactly that back."""

    tokens: int  # prompt tokens looked up
    cap_pages: int  # pages that could have matched (``match_cap``)
    hit_pages: int
    forfeit_pages: int  # pages after the hit that a live request held but had not published
    readmission: bool


@dataclass(frozen=True)
class _NamesAhead:
    """Names a commit computed outside the lock, with the request's state they were computed from, which
    ``_ahead_holds`` compares under the lock."""

    start: int  # the request's seq_len
    named: int  # how many pages had names
    last: int | None  # the last of those names
    written: np.ndarray  # ids written after the named pages, before ``start``
    names: list  # names of the pages the commit completes, after the ``named`` ones


@dataclass(eq=False)
class _ReadIn:
    """A deferred read-in: tier pages ``run`` (taken) for the request's pages ``first ..``, into pool pages
    ``pages`` (held by the request, not yet in its page list). ``claim`` is taken by whoever runs the copy or
    cancels it; ``seconds`` has one entry per page copied (None: damaged), ``read`` counts the good prefix."""

    run: list
    pages: np.ndarray
    first: int
    claim: threading.Lock = field(default_factory=threading.Lock)
    done: threading.Event = field(default_factory=threading.Event)
    seconds: list = field(default_factory=list)
    read: int = 0


@dataclass
class _Window:
    """A windowed label's state: its protected prefix (never released, the only part its teardown stores) and
    the page positions ``release_oldest`` gave back."""

    protected_tokens: int = 0
    released: set = field(default_factory=set)

    def storable_pages(self, full: int, page_size: int) -> int:
        """Of ``full`` leading full pages, those a teardown may store: up to the protected prefix's end and the
        first released page."""
        full = min(full, self.protected_tokens // page_size)
        return min(full, min(self.released)) if self.released else full


@dataclass
class _Request:
    """One live request. ``names`` covers its leading full pages; of those, the first ``len(chain)`` are held
    from the index, and the written ones after them, unless released, are listed in flight (``registered``)."""

    # the prompt and what its names are rooted in
    request_id: object
    prompt: np.ndarray
    extras: dict
    root: int
    root_parent: int
    names: list  # names of the leading full pages (Python ints), extended as pages fill
    root_material: bytes = b""  # what ``root`` was computed from: the tiers' chain digests start there
    # its allocation (``RequestView``)
    pages: list = field(default_factory=list)  # page_indices; -1 where a windowed label released a page
    seq_len: int = 0
    position_id_start: int = 0
    matched_tokens: int = 0
    # what it shares with the index
    chain: list = field(default_factory=list)  # index pages this request holds for its leading pages
    publish_blocked: bool = False  # an equal entry appeared while running: publishing waits for teardown
    registered: dict = field(default_factory=dict)  # page position -> name, listed in the in-flight table
    # windowing, suspension, accounting
    window: _Window | None = None  # set by protect_prefix or the first release_oldest: the label is windowed
    suspended_ids: np.ndarray | None = None  # written ids while suspended
    reading: _ReadIn | None = None  # a deferred read-in not completed yet
    lookup: _Lookup | None = None  # what its admission added to the metrics (None: nothing, or taken back)

    @property
    def released_any(self) -> bool:
        """Whether ``release_oldest`` gave back a page (only such a request can strand index pages)."""
        return self.window is not None and bool(self.window.released)

    @property
    def chain_parent(self) -> int:
        return self.chain[-1] if self.chain else self.root_parent


class AllocationManager:
    """Seeding, allocation, storing and release for one pool, under one lock. See the module docstring.

    ``reuse_gates=False`` is for a manager whose pages no forward reads (a measurement): mode ``on`` then
    seeds and stores whatever the fingerprint (see the reuse gates above)."""

    def __init__(self, config: CacheConfig, fingerprint: Fingerprint, kv_spec: KVSpec | None = None,
                 hash_fn: HashFn | None = None, *, reuse_gates: bool = True, tiers: Tiers | None = None,
                 agreement: Callable[[int], int] | None = None):
        if not isinstance(config, CacheConfig) or not isinstance(fingerprint, Fingerprint):
            raise InvalidRequest(f"AllocationManager needs a CacheConfig and a Fingerprint, got "
                                 f"{type(config).__name__} and {type(fingerprint).__name__}")
        if kv_spec is not None and not isinstance(kv_spec, KVSpec):
            raise InvalidRequest(f"kv_spec must be a KVSpec or None, got {type(kv_spec).__name__}")
        if fingerprint.page_size != config.page_size:
            raise InvalidRequest(
                f"fingerprint page_size {fingerprint.page_size} differs from config {config.page_size}")
        if config.mode == "shadow":
            raise InvalidRequest("mode 'shadow' wraps two managers: build it with mmcache.shadow.make_manager")
        self.config = config
        if agreement is not None and not callable(agreement):
            raise InvalidRequest(f"agreement must be callable, got {type(agreement).__name__}")
        if agreement is not None and tiers is not None:
            raise InvalidRequest("a manager under a tensor-parallel agreement keeps no tiers (a tier hit would "
                                 "lengthen one rank's match after the group agreed on it)")
        #: ``agreement(pages) -> pages``: the tensor-parallel group's matched length (``mmcache.agreement``), or None.
        self.agreement = agreement
        #: Why mode ``on`` runs as ``off`` here (see the module docstring's reuse gates), or None.
        self.reuse_off = (reuse_blocker(fingerprint, kv_spec, agreement is not None)
                          if config.mode == "on" and reuse_gates else None)
        self.mode = "off" if self.reuse_off else config.mode
        self.page_size = config.page_size
        self.namer = Namer(fingerprint, hash_fn)
        self.pool = PagePool(config.num_pages, config.page_size, kv_spec)
        self.index = PrefixIndex(self.pool)
        self._roots_limit = ROOTS_KEPT
        self.metrics = CacheMetrics()
        self._lock = threading.Lock()
        self._requests: dict[object, _Request] = {}
        self._inflight: dict[int, int] = {}  # page name -> live requests holding it full and unpublished
        self._windowed = 0  # live requests with released pages: only they can strand index pages (eviction)
        self._preempted: set = set()  # index pages a preempted request stored or held (``teardown``)
        if tiers is not None and (not isinstance(tiers, Tiers) or tiers.page_size != self.page_size):
            raise InvalidRequest("tiers must be a Tiers of this pool's page size")
        #: The levels below the pool (``tier``), or None; a manager whose mode is not ``on`` keeps none.
        self.tiers = tiers if self.mode == "on" else None

    # ---- queries -----------------------------------------------------------------------------------
    def __contains__(self, request_id) -> bool:
        return request_id in self._requests

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def state(self, request_id) -> RequestView:
        with self._lock:
            req = _lookup(self._requests, request_id)
            if req is None:
                raise UnknownRequest(request_id, "state")
            return RequestView(request_id, np.asarray(req.pages, dtype=np.int32), req.seq_len,
                               req.position_id_start, req.matched_tokens, req.suspended_ids is not None)

    def pages_held(self, request_id) -> int:
        """How many pages the request holds (0 for one this manager does not know); no copy is made."""
        with self._lock:
            req = _lookup(self._requests, request_id)
            return 0 if req is None else len(req.pages)

    def seq_len(self, request_id) -> int:
        """Tokens whose KV the request has written (``UnknownRequest`` for one this manager does not know)."""
        with self._lock:
            req = _lookup(self._requests, request_id)
            if req is None:
                raise UnknownRequest(request_id, "seq_len")
            return req.seq_len

    def page_table(self, request_id) -> np.ndarray:
        """The request's page indices (a copy), for building a forward's slot mapping."""
        return self.state(request_id).page_indices

    # ---- naming (no lock) --------------------------------------------------------------------------
    def prepare(self, token_ids, media: Sequence[MediaItem] = (), salt: bytes | str | None = b"",
                request_id: object = None) -> PreparedPrompt:
        """Validate a prompt and name its full pages. Touches no shared state: call it outside any lock."""
        ids = as_token_array(token_ids, request_id)
        if len(ids) == 0:
            raise InvalidRequest("empty prompt", request_id)
        if not isinstance(media, (list, tuple)):
            raise InvalidRequest(f"media must be a list of MediaItem, got {type(media).__name__}", request_id)
        for item in media:
            if not isinstance(item, MediaItem):
                raise InvalidRequest(f"media items must be MediaItem, got {type(item).__name__}", request_id)
            if item.position >= len(ids):
                raise InvalidRequest(f"media position {item.position} outside the prompt ({len(ids)} tokens)",
                                     request_id)
        extras = page_extras(media, self.page_size)
        try:
            material = self.namer.root_material(salt)
        except InvalidRequest as e:  # a bad salt, named like every other error of this request
            raise InvalidRequest(str(e), request_id) from None
        root = self.namer.root_of(material)
        if self.mode == "off":
            names = np.empty(0, dtype=np.uint64)
        else:
            names = self.namer.names(ids, root, extras)
        return PreparedPrompt(ids, names, extras, root, material, tuple(media), salt)

    # ---- admission ---------------------------------------------------------------------------------
    def match_cap(self, num_tokens: int, whole: bool = False) -> int:
        """The most pages a prompt of ``num_tokens`` tokens may be seeded with: every full page but one that
        would hold its last token, so at least one token is left to compute; with ``whole``, every full page
        (see the module docstring)."""
        return (num_tokens if whole else num_tokens - 1) // self.page_size

    def peek(self, prepared: PreparedPrompt, whole: bool = False) -> int:
        """Tokens ``admit(prepared, whole=whole)`` would seed now. Read-only: no counts, recency, metrics or
        roots change."""
        if not isinstance(prepared, PreparedPrompt):
            raise InvalidRequest(f"peek needs a PreparedPrompt, got {type(prepared).__name__}")
        _check_whole(whole)
        if self.mode != "on":
            return 0
        if len(prepared.names) != len(prepared.ids) // self.page_size:
            raise InvalidRequest("prepared prompt was named for another page size or mode")
        cap = self.match_cap(len(prepared.ids), whole)
        with self._lock:
            if prepared.root_material not in self.index.roots:
                return 0  # nothing is indexed under an unseen root, and root_parent would register it
            root_parent = self.index.root_parent(prepared.root_material)
            pages = self.index.match(prepared.names[:cap], prepared.ids, prepared.extras, root_parent)
            return len(pages) * self.page_size

    def admit(self, request_id, prompt, media: Sequence[MediaItem] = (),
              salt: bytes | str | None = b"", whole: bool = False, readmission: bool = False,
              defer_read_in: bool = False) -> AdmitResult:
        """Register a request and seed it from the index.

        ``prompt`` is a ``PreparedPrompt`` (names computed outside the lock) or token ids with ``media`` and
        ``salt``. Matches whole pages, at most ``match_cap(len(prompt), whole)`` of them: without ``whole``
        one prompt token is left to compute; with it a prompt of whole pages may be matched to its end (the
        host then computes its last token's logits without writing that token's KV). Afterwards
        ``seq_len == matched_tokens`` and ``position_id_start == 0``.

        ``readmission=True`` says the host admits again a request it tore down earlier (a preemption): its
        lookup is counted, and also as a re-admission, which ``hit_share`` leaves out (it would mostly match
        the request's own pages) and ``per_request_matched`` does not list again.

        ``defer_read_in=True`` leaves a tier hit's copy to the host (see the module docstring): the result's
        ``pending_tokens`` are reserved, counted as hits, and join ``seq_len`` at ``complete_read_in``.
        """
        try:
            hash(request_id)
        except TypeError:
            raise InvalidRequest(f"request_id must be hashable, got {type(request_id).__name__}") from None
        _check_whole(whole, request_id)
        if not isinstance(readmission, bool) or not isinstance(defer_read_in, bool):
            raise InvalidRequest(f"readmission and defer_read_in must be bools, got {readmission!r}, "
                                 f"{defer_read_in!r}", request_id)
        if not isinstance(prompt, PreparedPrompt):
            prompt = self.prepare(prompt, media, salt, request_id)
        elif self.mode == "on" and len(prompt.names) != len(prompt.ids) // self.page_size:
            raise InvalidRequest("prepared prompt was named for another page size or mode", request_id)
        with self._lock:
            if request_id in self._requests:
                raise DuplicateRequest(request_id)
            root_parent = self.index.root_parent(prompt.root_material) if self.mode == "on" else -1
            req = _Request(request_id, prompt.ids, prompt.extras, prompt.root, root_parent,
                           prompt.names.tolist(), prompt.root_material)
            result = (self._seed(req, prompt.names, whole, readmission, prompt.root_material, defer_read_in)
                      if self.mode == "on" else AdmitResult(0, 0, 0))
            self._requests[request_id] = req
            if len(self.index.roots) > self._roots_limit:  # amortised: the limit doubles past what is in use
                self.index.forget_roots({r.root_parent for r in self._requests.values()})
                self._roots_limit = max(ROOTS_KEPT, 2 * len(self.index.roots))
        return result

    def _seed(self, req: _Request, names: np.ndarray, whole: bool, readmission: bool,
              root_material: bytes, defer: bool = False) -> AdmitResult:
        p = self.page_size
        cap = self.match_cap(len(req.prompt), whole)
        pages = self.index.match(names[:cap], req.prompt, req.extras, req.root_parent)
        if self.agreement is not None:  # before any page is counted: the group seeds the shortest match
            pages = pages[:self._agreed(len(pages), req.request_id)]
        k = len(pages)
        if k:
            self.pool.incref(pages)
            req.pages = pages.tolist()
            req.chain = pages.tolist()
        pending = 0
        if self.tiers is not None and k < cap and self.tiers.has_name(req.names[k]):
            try:
                if defer:
                    run, taken = self._take_run(req, root_material, k, cap)
                    if run:
                        req.reading = _ReadIn(run, taken, k)
                        pending = len(run)
                else:
                    k += self._read_in(req, root_material, k, cap)
            except BaseException:
                self._release(req)
                raise
        forfeit = 0
        while k + pending + forfeit < cap and self._inflight.get(req.names[k + pending + forfeit], 0) > 0:
            forfeit += 1
        if k:
            self.index.touch(np.asarray(req.chain, dtype=np.int32))  # after a read-in: one run, tail first
            req.seq_len = req.matched_tokens = k * p
        req.lookup = _Lookup(len(req.prompt), cap, k + pending, forfeit, readmission)
        self._count_lookup(req.lookup, 1)
        if not readmission:
            self.metrics.record_match(req.request_id, (k + pending) * p)
        return AdmitResult(k * p, k, forfeit * p, pending * p)

    def _agreed(self, k: int, request_id) -> int:
        agreed = self.agreement(k)
        if isinstance(agreed, bool) or not isinstance(agreed, (int, np.integer)) or not 0 <= agreed <= k:
            raise GroupFailed(f"request {request_id!r}: the tensor-parallel agreement answered {agreed!r} for a "
                              f"match of {k} pages (it must be between 0 and the match)")
        return int(agreed)

    def _read_in(self, req: _Request, root_material: bytes, k: int, cap: int, ids: np.ndarray | None = None) -> int:
        """Under the lock: continue ``req``'s match of ``k`` pool pages through the tiers, up to ``cap`` pages,
        reading the run found there in now (``_take_run``, copies, ``_settle``). Returns the pages read in. On an
        exception every pool page taken here is returned and every page not yet read is given back."""
        run, pages = self._take_run(req, root_material, k, cap, ids)
        read, seconds = 0, []
        try:
            for page, pg in zip(run, pages.tolist()):
                seconds.append(self.tiers.copy_in(page, self._page_kv(pg)))
                if seconds[-1] is None:
                    break
                read += 1
        except BaseException:
            read = 0
            raise
        finally:
            self._settle(req, k, run, pages, read, seconds)
        return read

    def _take_run(self, req: _Request, root_material: bytes, k: int, cap: int, ids: np.ndarray | None = None
                  ) -> tuple[list, np.ndarray]:
        """Under the lock: the run of tier pages after ``req``'s ``k`` pool pages (up to ``cap``), taken out of
        its tiers, and as many fresh pool pages for it as the pool can give (evicting cold tails: they move
        down); tier pages past those go back to their tier. ``ids``: the sequence the pages hold (the prompt
        unless given: a resumed request's written ids)."""
        tiers, p = self.tiers, self.page_size
        ids = req.prompt if ids is None else ids
        digests = chain_digests(root_digest(root_material), ids, req.extras, 0, cap, p)
        run = tiers.take_run(digests[k:], ids[k * p:cap * p], req.extras, k)
        try:
            if len(run) > self.pool.num_free:
                self._evict(len(run) - self.pool.num_free)
            pages = self.pool.take(min(len(run), self.pool.num_free))
        except BaseException:
            for page in run:
                tiers.give_back(page)
            raise
        for page in run[len(pages):]:
            tiers.give_back(page)
        return run[:len(pages)], pages

    def _settle(self, req: _Request, k: int, run: list, pages: np.ndarray, read: int, seconds: list) -> None:
        """Under the lock: end a read-in of ``run`` into ``pages`` (for the request's pages ``k ..``) whose first
        ``read`` pages were copied in (``seconds``: what ``copy_in`` gave for each page it was called for).
        Those pages leave their tier and join the request and the index, as a pool hit's; a damaged page is
        discarded; the pages after are given back to their tier and their pool pages freed."""
        tiers = self.tiers
        for i, (page, sec) in enumerate(zip(run, seconds)):
            if i < read or sec is None:  # a page copied for a read-in that raised is not counted
                tiers.count_read(page, sec)
            tiers.finish(page)
        for page in run[len(seconds):]:
            tiers.give_back(page)
        self.pool.decref(pages[read:])
        if read:
            new = pages[:read]
            self.pool.ids[new] = np.stack([page.ids for page in run[:read]])
            self.pool.incref(new)  # the index's ownership, before the insert: the new tail is not index-only
            self.index.insert_run(np.asarray(req.names[k:k + read], dtype=np.uint64), new, req.chain_parent,
                                  [req.extras.get(i) for i in range(k, k + read)])
            req.pages.extend(new.tolist())
            req.chain.extend(new.tolist())

    def _page_kv(self, page: int):
        """The KV of pool page ``page`` as one tier page (a view), or None for a metadata-only pool."""
        return None if self.pool.kv is None else self.pool.kv[:, :, :, page]

    # ---- deferred read-in --------------------------------------------------------------------------
    def read_pending(self, request_id) -> None:
        """Copy a deferred read-in's KV into its pool pages (see the module docstring). Takes the lock only to
        find it: call it from any thread, once; a read-in already completed or cancelled is left alone."""
        with self._lock:
            req = _lookup(self._requests, request_id)
            job = None if req is None else req.reading
        if job is None or not job.claim.acquire(blocking=False):
            return
        try:
            for page, pg in zip(job.run, job.pages.tolist()):
                job.seconds.append(self.tiers.copy_in(page, self._page_kv(pg)))
                if job.seconds[-1] is None:
                    break
                job.read += 1
        finally:
            job.done.set()

    def complete_read_in(self, request_id) -> int:
        """Put what a deferred read-in copied into the index and the request's pages (waiting for the copy if it
        runs; cancelling it if it has not started); returns the tokens it added to ``seq_len`` (0 without one)."""
        with self._lock:
            req = _lookup(self._requests, request_id)
            if req is None:
                raise UnknownRequest(request_id, "complete_read_in")
            return self._complete_read_in(req)

    def read_in_ready(self, request_id) -> bool:
        """Whether the request has no deferred read-in, or its copy has ended."""
        req = _lookup(self._requests, request_id)
        job = None if req is None else req.reading
        return job is None or job.done.is_set()

    def _complete_read_in(self, req: _Request) -> int:
        job = req.reading
        if job is None:
            return 0
        if job.claim.acquire(blocking=False):  # never started: cancelled, nothing was copied
            job.done.set()
        job.done.wait()
        req.reading = None
        self._settle(req, job.first, job.run, job.pages, job.read, job.seconds)
        missed = len(job.run) - job.read
        if missed and req.lookup is not None:  # counted as hits at admission
            self._count_lookup(req.lookup, -1)
            req.lookup = replace(req.lookup, hit_pages=req.lookup.hit_pages - missed)
            self._count_lookup(req.lookup, 1)
            if not req.lookup.readmission:
                self._fix_match_record(req.request_id, -missed * self.page_size)
        req.seq_len += job.read * self.page_size
        req.matched_tokens = req.seq_len
        return job.read * self.page_size

    def _fix_match_record(self, request_id, delta: int) -> None:
        records = self.metrics.per_request_matched
        for back, (rid, tokens) in enumerate(reversed(records)):
            if rid == request_id:
                records[len(records) - 1 - back] = (rid, tokens + delta)
                break

    def _evict(self, pages_wanted: int) -> None:
        """Evict cold tails (down to the tiers when there are some) and count it."""
        freed, batches = evict(self.index, self.pool, pages_wanted, detach=self._windowed > 0,
                               on_evict=self._demote if self.tiers is not None else None)
        self.metrics.evicted_pages += freed
        self.metrics.eviction_batches += batches
        self._forget_unindexed_marks()

    def _forget_unindexed_marks(self) -> None:
        """Drop the preempted marks of pages that left the index without moving down (a detachment, a clear)."""
        if self._preempted:
            self._preempted = {pg for pg in self._preempted if self.index.in_index[pg]}

    def _demote(self, batch: np.ndarray) -> None:
        """Copy a cold tail (tail first, index pages held by the index alone) down to the tiers, a preempted
        request's pages into their share (``teardown``)."""
        digests = self._index_digests(batch[::-1].tolist())[::-1]
        kv = None
        if self.pool.kv is not None:
            import torch

            idx = torch.as_tensor(batch, dtype=torch.long, device=self.pool.kv.device)
            kv = self.pool.kv.index_select(3, idx).movedim(3, 0).cpu()
        pages = [TierPage(int(self.index.name[pg]), d, self.pool.ids[pg].copy(), self.index.extras_of(pg))
                 for pg, d in zip(batch.tolist(), digests)]
        marked = [pg in self._preempted for pg in batch.tolist()]
        for preempted in (False, True):
            rows = [i for i, m in enumerate(marked) if m == preempted]
            if rows:
                self.tiers.put([pages[i] for i in rows], None if kv is None else kv[rows], preempted=preempted)
        self._preempted.difference_update(batch.tolist())

    def _index_digests(self, run: list) -> list:
        """Chain digests (``tier``) of ``run``, index pages head first, each the parent of the next: the chain
        above ``run[0]`` is walked up to its root and hashed down."""
        index, p = self.index, self.page_size
        above = []
        par = int(index.parent[run[0]])
        while par >= 0:
            above.append(par)
            par = int(index.parent[par])
        material = next(m for m, rid in index.roots.items() if -1 - rid == par)
        chain = above[::-1] + list(run)
        ids = self.pool.ids[np.asarray(chain, dtype=np.int32)].reshape(-1)
        extras = {i: index.extras_of(pg) for i, pg in enumerate(chain) if index.has_extras[pg]}
        return chain_digests(root_digest(material), ids, extras, 0, len(chain), p)[len(above):]

    def _count_lookup(self, look: _Lookup, sign: int) -> None:
        """Add (``sign`` 1) or take back (-1) one admission's lookup in the counters; the per-request record of a
        first admission is kept apart (``_seed``, ``_uncount_lookup``)."""
        p, m = self.page_size, self.metrics
        m.lookups += sign
        m.lookup_pages += sign * look.cap_pages
        m.lookup_tokens += sign * look.tokens
        m.hit_pages += sign * look.hit_pages
        m.hit_tokens += sign * look.hit_pages * p
        m.forfeit_pages += sign * look.forfeit_pages
        m.forfeit_tokens += sign * look.forfeit_pages * p
        if look.readmission:
            m.readmissions += sign
            m.readmission_lookup_tokens += sign * look.tokens
            m.readmission_hit_tokens += sign * look.hit_pages * p

    # ---- allocation --------------------------------------------------------------------------------
    def reserve(self, request_id, num_tokens: int) -> np.ndarray:
        """Make room for ``num_tokens`` more tokens after ``seq_len``; returns the request's page indices.

        Takes free pages, then evicts cold tails, then raises ``AllocationFailed`` with the request's
        allocation unchanged.
        """
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)) or num_tokens < 0:
            raise InvalidRequest(f"num_tokens must be a non-negative int, got {num_tokens!r}", request_id)
        num_tokens = int(num_tokens)
        with self._lock:
            req = self._live(request_id, "reserve")
            need = -(-(req.seq_len + num_tokens) // self.page_size) - len(req.pages)
            if need > 0:
                self._ensure_free(request_id, need)
                req.pages.extend(self.pool.take(need).tolist())
            held = req.pages[:]  # a list copy here; the array (per page of the context) after the lock
        return np.asarray(held, dtype=np.int32)

    def _ensure_free(self, request_id, need: int) -> None:
        short = need - self.pool.num_free
        if short <= 0:
            return
        if self.mode == "on":
            self._evict(short)
            short = need - self.pool.num_free
        if short > 0:
            index_only = self.index.in_index & (self.pool.refcount == 1)
            if index_only.any():
                self.metrics.alloc_failures_cache_held += 1
            else:
                self.metrics.alloc_failures_uncached += 1
            raise AllocationFailed(request_id, need, short)

    def commit(self, request_id, token_ids) -> None:
        """Record that the KV of ``token_ids`` is written at positions ``seq_len ..``; advances ``seq_len``.

        Positions inside the prompt must carry the prompt's ids (its names were computed from them). With
        ``store_at='prefill'``, prompt pages that became full enter the index now, shared with the request.
        Names of the pages the commit completes are computed before the lock is taken.
        """
        ids = as_token_array(token_ids, request_id)
        ahead = self._name_ahead(request_id, ids)
        with self._lock:
            req = self._live(request_id, "commit")
            n, p = len(ids), self.page_size
            start, end = req.seq_len, req.seq_len + n
            if end > len(req.pages) * p:
                raise InvalidRequest(f"commit of {n} tokens at {start} exceeds the reserved {len(req.pages) * p}",
                                     request_id)
            overlap = min(end, len(req.prompt)) - start
            if overlap > 0 and not np.array_equal(ids[:overlap], req.prompt[start:start + overlap]):
                raise InvalidRequest(f"committed ids differ from the prompt at positions {start}..{start + overlap}",
                                     request_id)
            if n:
                first = start // p
                rows = np.asarray(req.pages[first:(end - 1) // p + 1], dtype=np.int32)
                pos = np.arange(start, end)
                self.pool.ids[rows[pos // p - first], pos % p] = ids
                if self.mode == "on" and ahead is not None and self._ahead_holds(req, ahead):
                    req.names.extend(ahead.names)
                req.seq_len = end
                if self.mode == "on":
                    self._on_pages_filled(req, first)

    def _name_ahead(self, request_id, ids: np.ndarray) -> _NamesAhead | None:
        """Outside the lock: names of the pages a commit of ``ids`` would complete beyond those named, with
        what they were computed from. None when there is nothing to name or the request is windowed (its names
        stop at what it may store).

        It reads the request's state without the lock; ``_ahead_holds`` checks that state under the lock."""
        if self.mode != "on":
            return None
        req = _lookup(self._requests, request_id)
        if req is None or req.window is not None or req.suspended_ids is not None:
            return None
        p = self.page_size
        start, have = req.seq_len, len(req.names)
        full = (start + len(ids)) // p
        if full <= have:
            return None
        last = req.names[have - 1] if have else None
        written = self._written_unnamed(req, start, have)
        span = np.concatenate([written, ids[max(0, have * p - start):full * p - start]])
        if len(span) != (full - have) * p:
            return None  # the state moved under us; the lock's path names these pages
        return _NamesAhead(start, have, last, written, self._chain_names(req, have, span, last).tolist())

    def _written_unnamed(self, req: _Request, start: int, have: int) -> np.ndarray:
        """The ids written at positions ``have * page_size .. start`` (pages written but not yet named)."""
        p = self.page_size
        if start <= have * p:
            return np.empty(0, dtype=self.pool.ids.dtype)
        rows = np.asarray(req.pages[have:-(-start // p)], dtype=np.int32)
        return self.pool.ids[rows].reshape(-1)[:start - have * p].copy()

    def _ahead_holds(self, req: _Request, ahead: _NamesAhead) -> bool:
        """Under the lock: whether names from ``_name_ahead`` still extend ``req.names`` (same position, same
        last name, same written ids); the commit's own ids were checked against the same start."""
        have = ahead.named
        return (req.seq_len == ahead.start and len(req.names) == have and req.window is None
                and (have == 0 or req.names[have - 1] == ahead.last)
                and np.array_equal(self._written_unnamed(req, ahead.start, have), ahead.written))

    def _chain_names(self, req: _Request, first: int, ids: np.ndarray, last: int | None) -> np.ndarray:
        """Names of the pages ``first ..`` whose ids ``ids`` holds, chained on ``last`` (the name of page
        ``first - 1``; the request's root when ``first`` is 0)."""
        n = len(ids) // self.page_size
        extras = {i - first: req.extras[i] for i in req.extras if first <= i < first + n}
        return self.namer.names(ids, req.root if first == 0 else last, extras)

    def _on_pages_filled(self, req: _Request, first: int) -> None:
        """After a commit that started in page ``first``: name, list in flight and (at prefill) publish the
        pages it completed. Earlier pages were handled by earlier commits, so the work is per page completed."""
        full = self._storable_pages(req)
        self._name_pages(req, full)
        self._register(req, max(first, len(req.chain)), full)
        if self.config.store_at == "prefill" and not req.publish_blocked:
            self._publish(req, min(full, len(req.prompt) // self.page_size), transfer=False)

    def _register(self, req: _Request, lo: int, hi: int) -> None:
        """List the full pages ``lo .. hi`` (unpublished, not released) in the in-flight table."""
        for i in range(lo, hi):
            if i not in req.registered and not (req.window and i in req.window.released):
                name = req.registered[i] = req.names[i]
                self._inflight[name] = self._inflight.get(name, 0) + 1

    def _storable_pages(self, req: _Request) -> int:
        """Leading full pages a teardown may store: up to the first released page and the protected prefix."""
        full = req.seq_len // self.page_size
        return full if req.window is None else req.window.storable_pages(full, self.page_size)

    def _name_pages(self, req: _Request, upto: int) -> None:
        """Extend ``req.names`` over written full pages up to ``upto``; generated pages chain on. Under the
        lock, for what ``_name_ahead`` did not name (a windowed request, a teardown)."""
        have = len(req.names)
        if upto <= have:
            return
        ids = self.pool.ids[np.asarray(req.pages[have:upto], dtype=np.int32)].reshape(-1)
        req.names.extend(self._chain_names(req, have, ids, req.names[have - 1] if have else None).tolist())

    def _publish(self, req: _Request, upto: int, transfer: bool) -> list:
        """Put the request's pages ``len(req.chain) .. upto`` into the index.

        With ``transfer`` (teardown) the request's ownership moves to the index; an equal entry that
        already exists is kept and the request's copy stays with the request (released after). Without
        ``transfer`` (publish at prefill) the index becomes a second owner; if an equal entry already
        exists, publishing stops for this request until teardown, so the chain only ever holds pages the
        request itself holds. Returns the pages whose ownership was transferred.
        """
        lo = len(req.chain)
        if upto <= lo:
            return []
        ids = self.pool.ids[np.asarray(req.pages[lo:upto], dtype=np.int32)].reshape(-1)
        existing = self.index.match(np.asarray(req.names[lo:upto], dtype=np.uint64), ids, req.extras,
                                    req.root_parent, first_page=lo, parent=req.chain_parent, ids_from=lo)
        m = len(existing)
        if m and not transfer:
            req.publish_blocked = True
            return []
        parent = int(existing[-1]) if m else req.chain_parent
        inserted = list(req.pages[lo + m:upto])
        if inserted and not transfer:
            self.pool.incref(np.asarray(inserted, dtype=np.int32))  # first: the new tail is not index-only
        self.index.insert_run(np.asarray(req.names[lo + m:upto], dtype=np.uint64), inserted, parent,
                              [req.extras.get(i) for i in range(lo + m, upto)])
        if self.tiers is not None and inserted and any(self.tiers.has_name(n) for n in req.names[lo + m:upto]):
            self.tiers.discard(self._index_digests(inserted))  # one place per page (see the module docstring)
        # Published pages stop counting as in flight: from now on they are hits, not forfeits.
        for i in range(lo, upto):
            if i in req.registered:
                self._inflight_drop(req.registered.pop(i))
        self.metrics.stored_pages += len(inserted)
        self.metrics.duplicate_pages += m
        if not transfer:
            req.chain.extend(inserted)
        return inserted

    def _inflight_drop(self, name: int) -> None:
        c = self._inflight.get(name, 0)
        if c <= 1:
            self._inflight.pop(name, None)
        else:
            self._inflight[name] = c - 1

    # ---- release -----------------------------------------------------------------------------------
    def teardown(self, request_id, preempted: bool = False) -> int:
        """End a request. In mode ``on`` every full written page moves to the index (an equal entry that
        already exists is kept and the request's copy released) and the tail is freed; a windowed label
        stores only its protected-prefix run. Returns how many pages entered the index.

        ``preempted=True`` says the host will admit the request again: with tiers, its stored run is marked so
        that eviction moves it into the tiers' share for preempted requests (``tier``); the marks stay through
        admissions given up for lack of pages (``abort(requeue=True)``) and go when a request holding the pages
        ends otherwise."""
        if not isinstance(preempted, bool):
            raise InvalidRequest(f"preempted must be a bool, got {preempted!r}", request_id)
        with self._lock:
            req = self._pop(request_id, "teardown")
            if req.suspended_ids is not None and self._preempted:  # over while suspended (it stores nothing)
                self._preempted.difference_update(self._suspended_run(req))
            before = self.metrics.stored_pages
            transferred: list = []
            if self.mode == "on" and req.suspended_ids is None:
                full = self._storable_pages(req)
                self._name_pages(req, full)
                lo = len(req.chain)
                transferred = self._publish(req, full, transfer=True)
                run = req.chain[:full]
                if full > lo:
                    ids = self.pool.ids[np.asarray(req.pages[lo:full], dtype=np.int32)].reshape(-1)
                    run = run + self.index.match(np.asarray(req.names[lo:full], dtype=np.uint64), ids, req.extras,
                                                 req.root_parent, first_page=lo, parent=req.chain_parent,
                                                 ids_from=lo).tolist()
                self.index.touch(np.asarray(run, dtype=np.int32))
                if preempted and self.tiers is not None:
                    self._preempted.update(run)
                elif self._preempted:  # the request is over: its pages are ordinary cached pages again
                    self._preempted.difference_update(run)
            self._release(req, exclude=set(transferred))
            stored = self.metrics.stored_pages - before
        return stored

    def abort(self, request_id, requeue: bool = False) -> None:
        """End a request without storing what it computed (pages it published at prefill stay indexed).

        ``requeue=True`` says the host will admit the request again (for example its first allocation failed
        and it waits for pages): its admission's lookup is taken back out of the metrics, so a retried request
        is counted once.

        The index pages the request held are stamped as just used, tail first, as a teardown stamps its run: a
        request's end, stored or not, is its pages' last use."""
        with self._lock:
            req = self._pop(request_id, "abort")
            if requeue:
                self._uncount_lookup(req)
            elif self._preempted:  # over for good: its pages stop counting as a preempted request's
                self._preempted.difference_update(req.chain if req.suspended_ids is None else self._suspended_run(req))
            self.index.touch(np.asarray(req.chain, dtype=np.int32))
            self._release(req)

    def _uncount_lookup(self, req: _Request) -> None:
        look, req.lookup = req.lookup, None
        if look is None:
            return
        self._count_lookup(look, -1)
        if look.readmission:  # listed once, at the first admission: that record stays
            return
        # Newest first: the record of a request being requeued was appended at its admission, moments ago, so
        # the scan stops after the few requests admitted since (not across up to 100k older records).
        records = self.metrics.per_request_matched
        for back, (rid, _) in enumerate(reversed(records)):
            if rid == req.request_id:
                del records[len(records) - 1 - back]
                break

    def _pop(self, request_id, op: str) -> _Request:
        req = _lookup(self._requests, request_id)
        if req is None:
            raise UnknownRequest(request_id, op)
        self._complete_read_in(req)
        if req.released_any:
            self._windowed -= 1
        return self._requests.pop(request_id)

    def _release(self, req: _Request, exclude: set = frozenset()) -> None:
        """Drop the request's ownership of every page it holds (except ``exclude``) and its in-flight names."""
        for name in req.registered.values():
            self._inflight_drop(name)
        req.registered = {}
        held = [pg for pg in req.pages if pg >= 0 and pg not in exclude]
        self.pool.decref(np.asarray(held, dtype=np.int32))
        req.pages, req.chain = [], []

    # ---- suspension --------------------------------------------------------------------------------
    def suspend(self, request_id, offload: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
        """Offload a request: pages it owns alone are released (after ``offload(pages)`` copied them out,
        under the lock), pages it shares are decremented and stay resident. Returns the written ids, which
        ``resume`` re-seeds from.

        With tiers the manager offloads too (``_offload_to_tiers``): the written full pages the request owns
        alone (its generated pages, prompt pages not yet published) are copied into the tiers' share for
        preempted requests (``tier``; the host level where that share is 0), and the index pages it held are
        marked as a preempted request's, so that eviction moves them into that share. ``resume`` reads both
        back. Without tiers the pages it owns alone are freed, and ``resume`` leaves them to recompute."""
        if offload is not None and not callable(offload):
            raise InvalidRequest(f"offload must be a callable or None, got {type(offload).__name__}", request_id)
        with self._lock:
            req = self._live(request_id, "suspend")
            if req.released_any:
                raise RequestStateError("a windowed request with released pages cannot be suspended", request_id)
            p = self.page_size
            written_pages = -(-req.seq_len // p)
            ids = self.pool.ids[np.asarray(req.pages[:written_pages], dtype=np.int32)].reshape(-1)[:req.seq_len].copy()
            if self.tiers is not None:
                self._offload_to_tiers(req, ids)
            if offload is not None:
                mine = np.asarray([pg for pg in req.pages if self.pool.refcount[pg] == 1], dtype=np.int32)
                offload(mine)
            self._release(req)
            req.suspended_ids = ids
            req.seq_len = 0
            req.publish_blocked = False
        return ids

    def _offload_to_tiers(self, req: _Request, ids: np.ndarray) -> None:
        """Under the lock, as ``req`` (written ids ``ids``) is suspended: copy its written full pages that neither
        the index nor another request holds into the tiers' share for preempted requests, tail first (a chain's
        tail leaves before its head), and mark the index pages it matches as a preempted request's. A page the
        index already holds an equal copy of stays with the index (one place per page)."""
        p = self.page_size
        full = self._storable_pages(req)
        self._name_pages(req, full)
        lo = len(req.chain)
        existing = np.empty(0, dtype=np.int32)
        if full > lo:
            existing = self.index.match(np.asarray(req.names[lo:full], dtype=np.uint64), ids[lo * p:full * p],
                                        req.extras, req.root_parent, first_page=lo, parent=req.chain_parent,
                                        ids_from=lo)
        self._preempted.update(req.chain)
        self._preempted.update(existing.tolist())
        first = lo + len(existing)
        if full <= first:
            return
        digests = chain_digests(root_digest(req.root_material), ids, req.extras, 0, full, p)
        order = list(range(full - 1, first - 1, -1))  # tail first
        rows = [req.pages[i] for i in order]
        kv = None
        if self.pool.kv is not None:
            import torch

            idx = torch.as_tensor(rows, dtype=torch.long, device=self.pool.kv.device)
            kv = self.pool.kv.index_select(3, idx).movedim(3, 0).cpu()
        pages = [TierPage(int(req.names[i]), digests[i], self.pool.ids[pg].copy(), req.extras.get(i) or None)
                 for i, pg in zip(order, rows)]
        self.tiers.put(pages, kv, preempted=True)

    def resume(self, request_id, readmission: bool = False, defer_read_in: bool = False) -> ResumeResult:
        """Re-seed a suspended request over all its written full pages: from the index, then, with tiers, from
        the tiers as an admission walks them (what ``suspend`` offloaded, and its index pages evicted since).

        ``readmission=True`` counts the re-seed as a re-admission's lookup (``admit``'s flag: the host resumes a
        request it preempted). ``defer_read_in=True`` leaves the tier pages' copy to the host, as ``admit``
        does: ``ResumeResult.reading_tokens`` of the pending ids are reserved and join ``seq_len`` at
        ``complete_read_in``."""
        if not isinstance(readmission, bool) or not isinstance(defer_read_in, bool):
            raise InvalidRequest(f"readmission and defer_read_in must be bools, got {readmission!r}, "
                                 f"{defer_read_in!r}", request_id)
        with self._lock:
            req = _lookup(self._requests, request_id)
            if req is None:
                raise UnknownRequest(request_id, "resume")
            if req.suspended_ids is None:
                raise RequestStateError("resume of a request that is not suspended", request_id)
            ids, p = req.suspended_ids, self.page_size
            k = reading = 0
            if self.mode == "on":
                full = min(len(ids) // p, len(req.names))
                pages = self.index.match(np.asarray(req.names[:full], dtype=np.uint64), ids, req.extras,
                                         req.root_parent)
                if self.agreement is not None:  # a re-seed is a match: the group agrees on it as on an admission
                    pages = pages[:self._agreed(len(pages), request_id)]
                k = len(pages)
                if k:
                    self.pool.incref(pages)
                    req.pages = pages.tolist()
                    req.chain = pages.tolist()
                if self.tiers is not None and k < full and self.tiers.has_name(req.names[k]):
                    try:
                        if defer_read_in:
                            run, taken = self._take_run(req, req.root_material, k, full, ids)
                            if run:
                                req.reading = _ReadIn(run, taken, k)
                                reading = len(run)
                        else:
                            k += self._read_in(req, req.root_material, k, full, ids)
                    except BaseException:
                        self._release(req)
                        raise
                if k:
                    self.index.touch(np.asarray(req.chain, dtype=np.int32))
                if readmission:
                    req.lookup = _Lookup(len(ids), full, k + reading, 0, True)
                    self._count_lookup(req.lookup, 1)
            req.seq_len = req.matched_tokens = k * p
            req.suspended_ids = None
            pending = ids[req.seq_len:].copy()
        return ResumeResult(req.seq_len, pending, reading * p)

    def _suspended_run(self, req: _Request) -> list:
        """The index pages a suspended request would be re-seeded with now."""
        ids = req.suspended_ids
        full = min(len(ids) // self.page_size, len(req.names))
        return self.index.match(np.asarray(req.names[:full], dtype=np.uint64), ids, req.extras,
                                req.root_parent).tolist()

    # ---- windowed labels ---------------------------------------------------------------------------
    def protect_prefix(self, request_id, num_tokens: int) -> None:
        """Make the label windowed: its first ``num_tokens`` tokens are its stable conditioning, never
        released by ``release_oldest``, and the only part its teardown stores."""
        with self._lock:
            req = self._live(request_id, "protect_prefix")
            limit = max(len(req.prompt), req.seq_len)
            if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)) \
                    or not 0 <= num_tokens <= limit:
                raise InvalidRequest(f"protected prefix must be an int in [0, {limit}], got {num_tokens!r}",
                                     request_id)
            if req.window is None:
                req.window = _Window()
            req.window.protected_tokens = int(num_tokens)
            if self.mode == "on":  # pages a raised bound makes storable are in flight from now on
                full = self._storable_pages(req)
                self._name_pages(req, full)
                self._register(req, len(req.chain), full)

    def release_oldest(self, request_id, num_pages: int) -> np.ndarray:
        """Release the ``num_pages`` oldest full pages after the protected prefix, through the counted free
        (a shared page is decremented, not freed). Returns the released page ids.

        The first release makes the label windowed (protected prefix 0 unless ``protect_prefix`` set one).
        Releasing 0 pages changes nothing: the label does not become windowed and an empty array is returned.
        A released page the index also holds stays cached; if the request still holds later pages of its
        chain, eviction reaches it by first dropping those later pages from the index (``eviction``)."""
        with self._lock:
            req = self._live(request_id, "release_oldest")
            p = self.page_size
            first = -(-(req.window.protected_tokens if req.window else 0) // p)
            candidates = [i for i in range(first, req.seq_len // p) if req.pages[i] >= 0]
            if isinstance(num_pages, bool) or not isinstance(num_pages, (int, np.integer)) \
                    or not 0 <= num_pages <= len(candidates):
                raise InvalidRequest(f"can release 0..{len(candidates)} pages, asked {num_pages!r}", request_id)
            if num_pages == 0:
                return np.empty(0, dtype=np.int32)
            if req.window is None:
                req.window = _Window()
            if not req.window.released:
                self._windowed += 1
            out = []
            for i in candidates[:num_pages]:
                if i in req.registered:
                    self._inflight_drop(req.registered.pop(i))
                out.append(req.pages[i])
                req.pages[i] = -1
                req.window.released.add(i)
            released = np.asarray(out, dtype=np.int32)
            self.pool.decref(released)
            # The chain holds only pages the request holds: it ends before the first released position.
            del req.chain[min(req.window.released):]
        return released

    def clear_cache(self, demote: bool = False) -> int:
        """Evict every cached page no request holds (cold tails, as on shortfall; pages a windowed request
        still holds leave the index if that is what reaches one it released). Returns the pool pages freed.
        With tiers, ``demote`` moves the pages down as a shortfall does; otherwise the tiers are emptied too."""
        with self._lock:
            if self.mode != "on":
                return 0
            before = self.metrics.evicted_pages
            if self.tiers is not None and not demote:
                self.tiers.clear()
                freed, batches = evict(self.index, self.pool, self.pool.num_pages, detach=self._windowed > 0)
                self.metrics.evicted_pages += freed
                self.metrics.eviction_batches += batches
                self._forget_unindexed_marks()
            else:
                self._evict(self.pool.num_pages)
            return self.metrics.evicted_pages - before

    # ---- internals ---------------------------------------------------------------------------------
    def _live(self, request_id, op: str) -> _Request:
        req = _lookup(self._requests, request_id)
        if req is None:
            raise UnknownRequest(request_id, op)
        if req.suspended_ids is not None:
            raise RequestStateError(f"{op} while suspended", request_id)
        self._complete_read_in(req)
        return req

    def check_invariants(self) -> None:
        """Raise AssertionError if any invariant of the module docstring is broken."""
        with self._lock:
            self.pool.check_invariants()
            self.index.check_invariants()
            owners = self.index.in_index.astype(np.int64)
            p = self.page_size
            inflight: dict = {}
            for req in self._requests.values():
                held = [pg for pg in req.pages if pg >= 0] + ([] if req.reading is None else req.reading.pages.tolist())
                if len(set(held)) != len(held):
                    raise AssertionError(f"request {req.request_id!r} holds a page twice")
                np.add.at(owners, np.asarray(held, dtype=np.int64), 1)
                tail = [pg for pg in req.pages[req.seq_len // p:] if pg >= 0]
                if tail and (self.pool.refcount[tail] != 1).any():
                    raise AssertionError(f"request {req.request_id!r} shares a tail page")
                if req.seq_len > len(req.pages) * p:
                    raise AssertionError(f"request {req.request_id!r} wrote past its pages")
                for i, pg in enumerate(req.chain):
                    if req.pages[i] != pg or not self.index.in_index[pg]:
                        raise AssertionError(f"request {req.request_id!r} chain page {pg} not held and indexed")
                for name in req.registered.values():
                    inflight[name] = inflight.get(name, 0) + 1
            if not np.array_equal(owners, self.pool.refcount):
                bad = np.flatnonzero(owners != self.pool.refcount)
                raise AssertionError(f"owner counts differ from owners on pages {bad[:10].tolist()}")
            if inflight != self._inflight:
                raise AssertionError("in-flight table differs from the live requests' unpublished pages")
            if self._preempted and not self.index.in_index[list(self._preempted)].all():
                raise AssertionError("a page marked as a preempted request's is not in the index")
            if self.tiers is not None:
                self.tiers.check_invariants()
                if len(self.tiers):
                    self._check_one_place()

    def _check_one_place(self) -> None:
        """No index page is also in a tier (digests of every index page, each chain hashed once)."""
        index, p = self.index, self.page_size
        materials = {-1 - rid: m for m, rid in index.roots.items()}
        memo: dict[int, bytes] = {}

        def digest(pg: int) -> bytes:
            path = []
            while pg >= 0 and pg not in memo:
                path.append(pg)
                pg = int(index.parent[pg])
            parent = memo[pg] if pg >= 0 else root_digest(materials[pg])
            for q in reversed(path):
                ex = index.extras_of(q)
                parent = memo[q] = chain_digests(parent, self.pool.ids[q], {0: ex} if ex else {}, 0, 1, p)[0]
            return parent

        for pg in np.flatnonzero(index.in_index).tolist():
            if self.tiers.where(digest(pg)) is not None:
                raise AssertionError(f"page {pg} is in the pool's index and in a tier")

    def metadata_nbytes(self) -> int:
        """Per-page metadata of pool and index (not the KV tensor)."""
        return self.pool.metadata_nbytes() + self.index.metadata_nbytes()


def reuse_blocker(fingerprint: Fingerprint, kv_spec: KVSpec | None, agreed: bool = False) -> str | None:
    """Why reuse must stay off for this fingerprint and pool (see the module docstring), or None. ``agreed``: the
    manager takes its matched lengths from a tensor-parallel agreement."""
    if fingerprint.tp_size > 1 and not agreed:
        return (f"tensor parallel (tp_size={fingerprint.tp_size}) without an agreement on one matched length "
                f"(mmcache.agreement): ranks could match different lengths")
    dtypes = [fingerprint.kv_dtype] if kv_spec is None else [fingerprint.kv_dtype, _dtype_name(kv_spec.dtype)]
    for dtype in dtypes:
        if dtype not in REUSE_KV_DTYPES and dtype != NO_KV:
            return (f"KV dtype {dtype} has not passed the bit-exact gate (reuse is on for "
                    f"{', '.join(REUSE_KV_DTYPES)})")
    return None


def _dtype_name(dtype) -> str:
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def _lookup(requests: dict, request_id) -> "_Request | None":
    """The request under ``request_id``, or None (also for an id that cannot be hashed: no request has one)."""
    try:
        return requests.get(request_id)
    except TypeError:
        return None


def _check_whole(whole, request_id=None) -> None:
    if not isinstance(whole, bool):
        raise InvalidRequest(f"whole must be a bool, got {whole!r}", request_id)
