"""The page pool: owner counts, a free stack, the verifying token ids and (optionally) the KV tensor.

Invariants (``check_invariants``):

* A page is on the free stack exactly when its owner count is 0, and at most once.
* An owner is a live request state holding the page in its ``page_indices`` or the prefix index; the
  allocation manager checks that counts equal owners (the pool alone cannot see who the owners are).
* ``ids[page]`` holds the token ids written into the page (valid up to the page's fill); for a page in
  the prefix index they are the ids the page was named over, compared on every hit.
* ``decref`` reports every page its call left with exactly one owner to ``on_one_owner`` (when set): the
  prefix index listens, since an index page whose last other owner left may have become evictable.

The KV tensor, when present, is allocated once at construction and never grows. One pool serves one
(node, label, rank). Layout::

    kv[layer, 0 | 1, kv_head, page, slot, head_dim]      # 0 = key, 1 = value

so ``kv[layer, 0].index_select(1, pages)`` gathers a request's keys as ``(kv_heads, n_pages, page_size,
head_dim)``, which views as ``(kv_heads, n_pages * page_size, head_dim)`` without a further copy. Keys are
stored after rotary embedding: positions are absolute and baked in, which is why names are rooted at
position 0. The tensor is zero-initialised, so unwritten slots never hold NaN.

Without a KV spec the pool is metadata only (replay, shadow mode): every rule runs unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .checks import positive_int
from .errors import InvalidRequest
from .names import TOKEN_DTYPE

MAX_PAGES = 2**31 - 1
"""The most pages one pool may have: page ids are int32 everywhere (free stack, page tables, index links)."""


@dataclass(frozen=True)
class KVSpec:
    """Shape of the KV tensor of one pool. ``dtype`` and ``device`` are torch objects or their names."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: object = "float32"
    device: object = "cpu"

    def __post_init__(self):
        import torch  # local: a metadata-only pool does not pay torch's import

        for name in ("num_layers", "num_kv_heads", "head_dim"):
            if not positive_int(getattr(self, name)):
                raise InvalidRequest(f"KVSpec.{name} must be a positive int, got {getattr(self, name)!r}")
        dtype = getattr(torch, self.dtype, None) if isinstance(self.dtype, str) else self.dtype
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise InvalidRequest(f"KVSpec.dtype must name a floating torch dtype, got {self.dtype!r}")
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError, ValueError) as e:
            raise InvalidRequest(f"KVSpec.device is not a torch device: {self.device!r} ({e})") from None


class PagePool:
    """Fixed set of pages with owner counts. Not thread-safe: the allocation manager's lock guards it."""

    def __init__(self, num_pages: int, page_size: int, kv_spec: KVSpec | None = None):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages and page_size must be positive, got {num_pages}, {page_size}")
        if num_pages > MAX_PAGES:
            raise InvalidRequest(f"a pool holds at most {MAX_PAGES} pages (int32 page ids), got {num_pages}")
        self.num_pages = int(num_pages)
        self.page_size = int(page_size)
        try:
            self.refcount = np.zeros(self.num_pages, dtype=np.int32)
            self.ids = np.zeros((self.num_pages, self.page_size), dtype=TOKEN_DTYPE)
            # Free stack: _free[:_free_top] are free; popping from the top reuses recently freed pages first.
            self._free = np.arange(self.num_pages - 1, -1, -1, dtype=np.int32)
        except (MemoryError, ValueError) as e:  # numpy's refusal of a size, or of the memory
            raise InvalidRequest(f"a pool of {num_pages} pages of {page_size} tokens cannot be allocated: "
                                 f"{type(e).__name__}: {e}") from None
        self._free_top = self.num_pages
        #: Called with the pages a ``decref`` left with one owner (see the module docstring), or None.
        self.on_one_owner: Callable[[np.ndarray], None] | None = None
        self.kv_spec = kv_spec
        self.kv = None
        if kv_spec is not None:
            import torch

            dtype = getattr(torch, kv_spec.dtype) if isinstance(kv_spec.dtype, str) else kv_spec.dtype
            try:
                self.kv = torch.zeros(
                    (kv_spec.num_layers, 2, kv_spec.num_kv_heads, self.num_pages, self.page_size, kv_spec.head_dim),
                    dtype=dtype,
                    device=kv_spec.device,
                )
            except (MemoryError, RuntimeError) as e:  # the allocator's refusal
                raise InvalidRequest(f"a KV pool of {self.num_pages} pages cannot be allocated: "
                                     f"{type(e).__name__}: {e}") from None

    @property
    def num_free(self) -> int:
        return self._free_top

    def take(self, n: int) -> np.ndarray:
        """Pop ``n`` free pages (caller checked ``num_free``); each gets owner count 1."""
        if n > self._free_top:
            raise RuntimeError(f"take({n}) with {self._free_top} free pages")  # a manager bug, not user input
        top = self._free_top
        pages = self._free[top - n : top][::-1].copy()
        self._free_top = top - n
        self.refcount[pages] = 1
        return pages

    def incref(self, pages: np.ndarray) -> None:
        """Add one owner to each of ``pages`` (distinct pages, each already owned)."""
        self.refcount[pages] += 1

    def decref(self, pages: np.ndarray) -> np.ndarray:
        """Drop one owner from each of ``pages`` (distinct); pages reaching 0 go to the free stack, returned."""
        if len(pages) == 0:
            return pages
        rc = self.refcount
        rc[pages] -= 1
        left = rc[pages]
        freed = pages[left == 0]
        if len(freed):
            top = self._free_top
            self._free[top : top + len(freed)] = freed[::-1]
            self._free_top = top + len(freed)
        if self.on_one_owner is not None:
            alone = pages[left == 1]
            if len(alone):
                self.on_one_owner(alone)
        return freed

    def free_pages(self) -> np.ndarray:
        return self._free[: self._free_top].copy()

    def metadata_nbytes(self) -> int:
        """Bytes of per-page metadata the pool keeps (owner counts, free stack, verifying ids)."""
        return self.refcount.nbytes + self._free.nbytes + self.ids.nbytes

    def check_invariants(self) -> None:
        rc = self.refcount
        if (rc < 0).any():
            raise AssertionError(f"negative owner count on pages {np.flatnonzero(rc < 0).tolist()}")
        free = self._free[: self._free_top]
        if len(np.unique(free)) != len(free):
            raise AssertionError("a page is on the free stack twice")
        zero = np.flatnonzero(rc == 0)
        if not np.array_equal(np.sort(free), zero):
            raise AssertionError("free stack differs from the set of pages with owner count 0")
