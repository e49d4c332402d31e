"""Replicas on Ray Serve (``mmcache serve --replicas N``): an ingress that renders prompts and computes each
request's routing key, and an engine deployment of N replicas, each an engine with its own pools and store,
routed by mmcache's prefix-affinity router (or Ray's own, to compare). Ray is imported only by the modules that
run inside Ray (``launch``, ``engine_replica``, ``ingress``, ``ray_routers``), never by the single-process
server."""
