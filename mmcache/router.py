"""Replica choice for data-parallel replicas: rendezvous hashing of a page name that later turns share, and an
explicit fallback past a load threshold.

Rules (docs/DESIGN.md, "Replica choice"):

* The preferred replica is a pure function of the request's prefix: the replica whose identity scores
  highest under ``xxh64(page name, seed = xxh64(replica identity))`` (rendezvous, or highest-random-weight,
  hashing). The page is the ``depth_pages``-th full page of a prompt that has that many, and the first full
  page of a shorter prompt. So two prompts that agree on their first ``depth_pages`` pages agree on the
  replica without communicating, and the turns of a chat, each extending the one before, all route by their
  first page while they are short and by the same deep page once they reach the depth: a conversation
  changes replica at most once, at the turn whose prompt first reaches ``depth_pages`` pages.
* The router keeps no cache state: nothing it holds can go stale. Its inputs are the page names and the
  per-replica loads the host reports on each call; beyond its configuration it holds only the random
  generator of the fallback.
* A hot prefix must not pin all its load on one replica: when the preferred replica's load is past the
  threshold ``max(min_load, load_factor * mean load)`` and some replica is less loaded, the request goes
  where the fallback sends it. The threshold follows the mean, as in consistent hashing with bounded loads
  (Mirrokni, Thorup, Zadimoghaddam, SODA 2018), so a deployment that is busy everywhere keeps its affinity
  and only a replica loaded well above its share sheds requests; ``min_load`` keeps a nearly idle deployment
  from shedding at its first queued request.
* The fallback (``FALLBACKS``) is ``deeper`` by default: the overflow is routed by rendezvous hashing of a
  page twice as deep as the routing page (``overflow_name``: the ``2 * depth_pages``-th, or the last full
  page of a shorter prompt), to the first replica of that page's ranking that is not past the threshold.
  When the routing page sits inside a prefix most requests share (a long system prompt), the overflow then
  spreads by what follows that prefix (each conversation's own pages), and a conversation that overflows
  goes back to the same replica each time, where its earlier turns are cached; a uniform draw would send
  its next turn to a replica without them, and an idle replica would re-prefill a long context, which is
  what made the tail worse than random routing. Some replica is always under the threshold (the least
  loaded is at most the mean), so the walk ends. A prompt with no full page has nothing cacheable to route
  by and goes to a uniform draw over all replicas.
* ``random`` sends the overflow to a uniform draw over all replicas, the runtime's own choice without
  affinity, so past the threshold a deployment behaves as it did before the router, and several routers
  acting on load reports that lag do not all send their overflow to the one replica that looked least
  loaded. ``least_loaded`` takes the least-loaded replica instead (ties broken by the rendezvous ranking, so
  the overflow of one prefix lands on a fixed order of replicas): better where one router sees fresh loads.
  Both route a prompt with no full page as they route the overflow.
* Removing one replica moves only the prefixes that preferred it (a property of rendezvous hashing).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import xxhash

from .checks import finite_number, unicode_text
from .errors import InvalidRequest

FALLBACKS = ("deeper", "random", "least_loaded")
"""Where a request goes when its preferred replica is past the load threshold, or when it has no full page."""


@dataclass(frozen=True)
class RouterConfig:
    """``replicas``: identities of the replicas (any distinct strings; their order is the index returned).
    ``depth_pages``: which full page's name routes a prompt that has that many (1 = the first page); a
    shorter prompt routes by its first page. The preferred replica is skipped once its load (what the host
    counts as its queue, e.g. requests routed to it and not finished) is greater than
    ``max(min_load, load_factor * mean load)``; the request then goes where ``fallback`` says (``FALLBACKS``;
    ``deeper``, the ranking of a page twice as deep, by default: see the module docstring). ``seed`` seeds
    the uniform draws (None: from the operating system)."""

    replicas: tuple[str, ...]
    depth_pages: int = 16
    load_factor: float = 2.0
    min_load: float = 3
    fallback: str = "deeper"
    seed: int | None = None

    def __post_init__(self):
        if (not isinstance(self.replicas, (tuple, list)) or not self.replicas
                or not all(isinstance(r, str) and unicode_text(r) for r in self.replicas)
                or len(set(self.replicas)) != len(self.replicas)):
            raise InvalidRequest(f"replicas must be distinct strings (valid Unicode), at least one, got "
                                 f"{self.replicas!r}")
        object.__setattr__(self, "replicas", tuple(self.replicas))  # frozen: a list could change afterwards
        if isinstance(self.depth_pages, bool) or not isinstance(self.depth_pages, int) or self.depth_pages < 1:
            raise InvalidRequest(f"depth_pages must be a positive int, got {self.depth_pages!r}")
        if not (finite_number(self.load_factor) and self.load_factor >= 1):
            raise InvalidRequest(f"load_factor must be a finite number >= 1, got {self.load_factor!r}")
        if not (finite_number(self.min_load) and self.min_load >= 0):
            raise InvalidRequest(f"min_load must be a finite number >= 0, got {self.min_load!r}")
        if not isinstance(self.fallback, str) or self.fallback not in FALLBACKS:
            raise InvalidRequest(f"fallback must be one of {', '.join(FALLBACKS)}, got {self.fallback!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or self.seed < 0):
            raise InvalidRequest(f"seed must be a non-negative int or None, got {self.seed!r}")

    @classmethod
    def numbered(cls, count: int, **kwargs) -> "RouterConfig":
        """Replicas named ``"0" .. str(count - 1)``."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise InvalidRequest(f"replica count must be a positive int, got {count!r}")
        return cls(tuple(str(i) for i in range(count)), **kwargs)


def _page_names(names) -> np.ndarray:
    if isinstance(names, (list, tuple)):  # names at and past 2**63 beside smaller ones would turn into float64
        if not all(isinstance(n, (int, np.integer)) and not isinstance(n, (bool, np.bool_)) and 0 <= n < 2**64
                   for n in names):
            raise InvalidRequest("page names must be ints in [0, 2**64)")
        return np.array([int(n) for n in names], dtype=np.uint64)
    try:
        arr = np.asarray(names)
    except (ValueError, TypeError, OverflowError):  # ragged nesting
        arr = np.asarray(None)
    if arr.ndim != 1 or (arr.size and (arr.dtype.kind not in "iu" or int(arr.min()) < 0)):
        raise InvalidRequest(f"page names must be a 1-D array of unsigned 64-bit names, got {arr.dtype} "
                             f"of shape {arr.shape}")
    return arr


class ReplicaRouter:
    """No cache state (only its configuration and the fallback's random generator); safe to share between
    threads."""

    def __init__(self, config: RouterConfig):
        if not isinstance(config, RouterConfig):
            raise InvalidRequest(f"a router takes a RouterConfig, got {type(config).__name__}")
        self.config = config
        self._seeds = [xxhash.xxh64_intdigest(r.encode("utf-8")) for r in config.replicas]
        self._draw = np.random.default_rng(config.seed)
        self._draw_lock = threading.Lock()  # a Generator is not safe to draw from in several threads at once

    @property
    def num_replicas(self) -> int:
        return len(self._seeds)

    def routing_name(self, names: np.ndarray) -> int | None:
        """The page name a prompt is routed by: its ``depth_pages``-th page's, or its first page's when it has
        fewer (the page its later turns share); None when the prompt has no full page."""
        names = _page_names(names)
        if len(names) == 0:
            return None
        depth = self.config.depth_pages
        return int(names[depth - 1] if len(names) >= depth else names[0])

    def overflow_name(self, names: np.ndarray) -> int | None:
        """The page name the ``deeper`` fallback routes a prompt by: its ``2 * depth_pages``-th page's, or its
        last full page's when it has fewer; None when the prompt has no full page."""
        names = _page_names(names)
        if len(names) == 0:
            return None
        return int(names[min(len(names), 2 * self.config.depth_pages) - 1])

    def ranking(self, name: int) -> list[int]:
        """Replica indices in rendezvous order for ``name`` (a 64-bit page name): the preferred replica first."""
        if isinstance(name, (bool, np.bool_)) or not isinstance(name, (int, np.integer)) or not 0 <= name < 2**64:
            raise InvalidRequest(f"a page name is an int in [0, 2**64), got {name!r}")
        key = int(name).to_bytes(8, "little")
        scores = [xxhash.xxh64_intdigest(key, seed) for seed in self._seeds]
        return sorted(range(len(scores)), key=lambda i: (-scores[i], i))

    def preferred(self, names: np.ndarray) -> int | None:
        """The replica a prompt with these page names prefers, or None when it has no full page."""
        name = self.routing_name(names)
        return None if name is None else self.ranking(name)[0]

    def _loads(self, loads: Sequence[float]) -> list:
        if not isinstance(loads, (list, tuple, np.ndarray)) or (isinstance(loads, np.ndarray) and loads.ndim != 1):
            raise InvalidRequest(f"loads must be a list with one load per replica, got {type(loads).__name__}")
        loads = list(loads)
        if len(loads) != self.num_replicas:
            raise InvalidRequest(f"{len(loads)} loads given for {self.num_replicas} replicas")
        if not all(finite_number(x) and x >= 0 for x in loads):
            raise InvalidRequest(f"loads must be finite numbers >= 0, got {loads!r}")
        return loads

    def threshold(self, loads: Sequence[float]) -> float:
        """The load past which a preferred replica is skipped."""
        loads = self._loads(loads)
        mean = sum(x / len(loads) for x in loads)  # each term first: a sum of finite loads can overflow
        return max(self.config.min_load, self.config.load_factor * mean)

    def route(self, names: np.ndarray, loads: Sequence[float]) -> int:
        """The replica for a prompt with page names ``names`` given each replica's current load: the preferred
        one unless it is past the threshold and not the least loaded, else the fallback's choice."""
        return self.route_by_names(self.routing_name(names), self.overflow_name(names), loads)

    def route_by_names(self, name: int | None, overflow: int | None, loads: Sequence[float]) -> int:
        """``route`` for a host that computed the prompt's ``routing_name`` and ``overflow_name`` once (both
        None for a prompt with no full page) and carries them instead of the names."""
        loads = self._loads(loads)
        if name is None:
            if self.config.fallback == "least_loaded":
                return self._least_loaded(loads, list(range(self.num_replicas)))
            return self._draw_one()
        order = self.ranking(name)
        first = order[0]
        threshold = self.threshold(loads)
        if loads[first] <= threshold or loads[first] <= min(loads):
            return first
        if self.config.fallback == "deeper":
            deeper = self.ranking(name if overflow is None else overflow)
            return next((i for i in deeper if loads[i] <= threshold), self._least_loaded(loads, deeper))
        if self.config.fallback == "least_loaded":
            return self._least_loaded(loads, order)
        return self._draw_one()

    @staticmethod
    def _least_loaded(loads: list, order: list[int]) -> int:
        """The least-loaded replica, ties broken by ``order``."""
        least = min(loads)
        return next(i for i in order if loads[i] == least)

    def _draw_one(self) -> int:
        with self._draw_lock:
            return int(self._draw.integers(self.num_replicas))
