"""The engine deployment's Ray Serve request routers (``routing``'s module docstring gives their rules). This
module imports Ray: Ray Serve loads it in the process of each handle that routes (the ingress), by the class
paths in ``ROUTER_CLASSES``.

Ray's request-router API is alpha (Ray 2.49 and later); what is used of it: ``RequestRouter.choose_replicas``
(candidates and the pending request's arguments), ``initialize_state`` (the router's keyword options),
``replica_queue_len_cache`` (queue lengths the router already holds), and the power-of-two and prefix-text
routers' own ``choose_replicas`` and ``on_request_routed``; of the prefix-text router also
``_normalize_prompt_to_string``, the text its tree would match for a call: where that is empty (a chat of images
alone, token ids outside the vocabulary) its ``choose_replicas`` divides by zero inside Ray's routing loop, which
then never sends the request, so such a call goes by power-of-two choices and never enters its tree.
"""

from __future__ import annotations

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter

from ..router import ReplicaRouter, RouterConfig
from .routing import EngineCall, record_live

ROUTER_CLASSES = {"mmcache": f"{__name__}.MmcacheRouter", "power-of-two": f"{__name__}.PowerOfTwoRouter",
                  "prefix-text": f"{__name__}.PrefixTextRouter"}


def _pinned(candidates, pending):
    """The candidate a pinned call names (a one-rank list), or None for an unpinned call or a gone replica."""
    target = pending.kwargs.get("replica") if pending is not None and pending.kwargs else None
    if target is None:
        return None
    chosen = [r for r in candidates if r.replica_id.unique_id == target]
    return [chosen] if chosen else None


def _call_of(pending) -> EngineCall | None:
    if pending is None or not pending.args:
        return None
    call = pending.args[0]
    return call if isinstance(call, EngineCall) else None


def _seen(router, candidates) -> None:
    record_live(router._deployment_id.name, (r.replica_id.unique_id for r in candidates))


class _Recorded:
    """Records the replica set whenever Ray Serve updates it (a replica started, stopped or died), so the
    ingress's scrape asks the living replicas, not those the last routed request saw."""

    def update_replicas(self, replicas):
        super().update_replicas(replicas)
        _seen(self, replicas)


class PowerOfTwoRouter(_Recorded, PowerOfTwoChoicesRequestRouter):
    """Ray Serve's default router, with pinned calls."""

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        _seen(self, candidate_replicas)
        return (_pinned(candidate_replicas, pending_request)
                or await super().choose_replicas(candidate_replicas, pending_request))


class PrefixTextRouter(_Recorded, PrefixCacheAffinityRouter):
    """Ray Serve LLM's prefix-text router, with pinned calls; a call with no text for its tree (not an engine
    call, or its text empty) goes by power-of-two choices and never enters the tree."""

    def _matchable(self, pending) -> bool:
        call = _call_of(pending)
        return call is not None and call.messages is not None and bool(
            self._normalize_prompt_to_string(call.messages))

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        _seen(self, candidate_replicas)
        pinned = _pinned(candidate_replicas, pending_request)
        if pinned is not None or not self._matchable(pending_request):
            return pinned or await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas,
                                                                                   pending_request)
        return await super().choose_replicas(candidate_replicas, pending_request)

    def on_request_routed(self, pending_request, replica_id, result):
        if self._matchable(pending_request):
            super().on_request_routed(pending_request, replica_id, result)


class MmcacheRouter(_Recorded, PowerOfTwoChoicesRequestRouter):
    """mmcache's affinity: the replica ``ReplicaRouter.route_by_names`` picks from the call's routing and overflow
    names and the replicas' queue lengths (the preferred replica within the load threshold, past it the
    overflow's ranking); Ray's power-of-two choices as the later ranks (a replica whose queue is full), and for
    calls without a key."""

    def initialize_state(self, **options):
        super().initialize_state()
        self._options = options  # RouterConfig's fields beside the replicas (its defaults where not given)
        self._ranker: tuple[tuple[str, ...], ReplicaRouter] | None = None

    def _ranker_of(self, ids: tuple[str, ...]) -> ReplicaRouter:
        """The rendezvous ranker of this replica set (the one built for the last set, else a new one)."""
        if self._ranker is None or self._ranker[0] != ids:
            self._ranker = (ids, ReplicaRouter(RouterConfig(ids, depth_pages=1, **self._options)))
        return self._ranker[1]

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        _seen(self, candidate_replicas)
        pinned = _pinned(candidate_replicas, pending_request)
        if pinned is not None:
            return pinned
        fallback = await super().choose_replicas(candidate_replicas, pending_request)
        call = _call_of(pending_request)
        if call is None or call.routing_name is None or not candidate_replicas:
            return fallback
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        router = self._ranker_of(tuple(r.replica_id.unique_id for r in ordered))
        cache = self.replica_queue_len_cache
        loads = [float(cache.get(r.replica_id) or 0) for r in ordered]
        chosen = router.route_by_names(call.routing_name, call.overflow_name, loads)
        return [[ordered[chosen]]] + fallback
