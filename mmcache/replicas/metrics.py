"""One Prometheus exposition for the whole deployment, assembled at the ingress on each scrape: the ingress's
own series (request errors it answered, the generation services it runs), and every live replica's registry
(its engine, pools, store, and the latencies of the requests it ran), each replica's samples carrying a
``replica`` label with its Ray Serve replica id. A family that appears in several registries is written once,
with all their samples."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

REPLICA_LABEL = "replica"


class _Families:
    """A collector of parsed metric families (what ``generate_latest`` renders)."""

    def __init__(self, families):
        self.families = families

    def collect(self):
        return iter(self.families)


def merge_expositions(own: bytes, replicas: dict[str, bytes]) -> bytes:
    """``own`` (unlabelled) and each replica's exposition (``replica id -> text``) as one exposition."""
    merged: dict[str, object] = {}
    sources = [(None, own)] + sorted(replicas.items())
    for replica, text in sources:
        for family in text_string_to_metric_families(text.decode("utf-8")):
            target = merged.setdefault(family.name, family)
            samples = family.samples
            if replica is not None:
                samples = [s._replace(labels={**s.labels, REPLICA_LABEL: replica}) for s in samples]
            if target is family:
                family.samples = list(samples)
            else:
                target.samples.extend(samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values())))
    return generate_latest(registry)
