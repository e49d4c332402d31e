"""Prometheus metrics of a server, names under ``mmcache:`` in vLLM's style.

Two sources, one registry per server (never the process-wide default, so servers in one process do not mix):

* What the engine and the store already count is read at scrape time by a collector (``_EngineCollector``):
  prefix-cache queries and hits in prompt tokens, encoder-store queries and hits per kind of entry, store bytes
  and entries, KV pages free / cached / live and the live share, evictions, requests running and waiting. No
  counter is mirrored, so a scrape always agrees with ``engine.metrics()``.
* What only the server sees is recorded as requests end: outcomes by finish reason, errors by type (every
  error response, engine errors included), and histograms of time to first token, inter-token latency,
  end-to-end latency and prompt length.

Store kinds are labelled as the issue names them; a VLM's store holds vision-tower outputs, which the store
files under its default kind ``output``.
"""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..engine.request import StreamEvent

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TOKEN_BUCKETS = tuple(float(2**i) for i in range(0, 18))
_STORE_KIND_LABELS = {"output": "vision", "position_bias": "position_bias", "text_encoder": "text_encoder",
                      "negative_prompt": "negative_prompt", "codec": "codec"}
ENGINE_SECTIONS = ("engine", "encoder")  # entries of engine.metrics() that are not page-pool labels


class ServerMetrics:
    """The registry of one server over ``host`` (an ``EngineHost``); ``observe`` is the host's callback."""

    def __init__(self, host, model_name: str):
        self.registry = CollectorRegistry(auto_describe=False)
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry
        self.success = Counter("mmcache:request_success", "Requests that ended without error, by finish reason.",
                               labels + ["finished_reason"], registry=r)
        self.errors = Counter("mmcache:request_errors", "Requests answered with an error, by error type.",
                              labels + ["error_type"], registry=r)
        self.ttft = Histogram("mmcache:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("mmcache:inter_token_latency_seconds", "Time between consecutive output tokens.",
                             labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("mmcache:e2e_request_latency_seconds", "Arrival to finish of a request.", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Histogram("mmcache:request_prompt_tokens", "Prompt length of finished requests.",
                                       labels, buckets=_TOKEN_BUCKETS, registry=r)
        self.generation_tokens = Counter("mmcache:generation_tokens", "Output tokens generated.", labels,
                                         registry=r)
        r.register(_EngineCollector(host, model_name))

    def observe(self, event: StreamEvent, reason: str) -> None:
        """Record a finished request (called on the step thread); errors are recorded by ``error``."""
        out = event.output
        name = self.model_name
        if out is None or reason == "error":
            return
        self.success.labels(name, reason).inc()
        self.prompt_tokens.labels(name).observe(out.prompt_len)
        self.generation_tokens.labels(name).inc(len(out.output_ids))
        self.e2e.labels(name).observe(max(0.0, event.time - out.arrival_time))
        if out.ttft is not None:
            self.ttft.labels(name).observe(max(0.0, out.ttft))
        times = out.token_times
        for a, b in zip(times, times[1:]):
            self.itl.labels(name).observe(b - a)

    def error(self, error_type: str) -> None:
        self.errors.labels(self.model_name, error_type).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Reads the engine's, the pools' and the store's own counts at scrape time."""

    def __init__(self, host, model_name: str):
        self.host = host
        self.model_name = model_name

    def describe(self):
        return []

    def collect(self):
        host, name = self.host, self.model_name
        stats = host.engine.metrics()
        labels = ["model_name"]

        def counter(metric: str, doc: str, value: float):
            fam = CounterMetricFamily(metric, doc, labels=labels)
            fam.add_metric([name], value)
            return fam

        def gauge(metric: str, doc: str, value: float):
            fam = GaugeMetricFamily(metric, doc, labels=labels)
            fam.add_metric([name], value)
            return fam

        pools = {label: d for label, d in stats.items() if label not in ENGINE_SECTIONS}
        total = lambda key: sum(d.get(key, 0) for d in pools.values())  # noqa: E731
        yield counter("mmcache:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      total("lookup_tokens"))
        yield counter("mmcache:prefix_cache_hits", "Prompt tokens seeded from the prefix cache.", total("hit_tokens"))
        yield counter("mmcache:kv_cache_evictions", "KV pages evicted from the prefix cache.", total("evicted_pages"))
        num, free, cached = total("num_pages"), total("free_pages"), total("cached_pages")
        live = self._live_pages()
        yield gauge("mmcache:kv_pages_total", "KV pages in the pools.", num)
        yield gauge("mmcache:kv_pages_free", "KV pages on the free lists.", free)
        yield gauge("mmcache:kv_pages_cached", "KV pages held by the prefix index.", cached)
        yield gauge("mmcache:kv_pages_live", "KV pages held by live requests.", live)
        yield gauge("mmcache:kv_cache_usage_perc", "Share of KV pages held by live requests (0 to 1).",
                    live / num if num else 0.0)
        yield gauge("mmcache:num_requests_running", "Requests with an output token and not yet finished.",
                    host.running)
        yield gauge("mmcache:num_requests_waiting", "Requests accepted that have no output yet.", host.waiting)
        yield from self._store(stats.get("encoder"))

    def _live_pages(self) -> int:
        """Pages with an owner besides the index: a page's owner count is its live requests plus one if indexed."""
        live = 0
        for manager in list(self.host.core.managers.values()):
            live += int(np.count_nonzero(manager.pool.refcount > manager.index.in_index))
        return live

    def _store(self, store: dict | None):
        name = self.model_name
        queries = CounterMetricFamily("mmcache:encoder_cache_queries", "Encoder-output store lookups, by kind.",
                                      labels=["model_name", "kind"])
        hits = CounterMetricFamily("mmcache:encoder_cache_hits", "Encoder-output store hits, by kind.",
                                   labels=["model_name", "kind"])
        evictions = CounterMetricFamily("mmcache:encoder_cache_evictions", "Encoder-output store evictions.",
                                        labels=["model_name"])
        used = GaugeMetricFamily("mmcache:encoder_cache_bytes", "Bytes held by the encoder-output store.",
                                 labels=["model_name"])
        entries = GaugeMetricFamily("mmcache:encoder_cache_entries", "Entries in the encoder-output store.",
                                    labels=["model_name"])
        store = store or {}
        for kind, counts in (store.get("kinds") or {}).items():
            label = _STORE_KIND_LABELS.get(kind, kind)
            queries.add_metric([name, label], counts.get("lookups", 0))
            hits.add_metric([name, label], counts.get("hits", 0))
        evictions.add_metric([name], store.get("evictions", 0))
        used.add_metric([name], store.get("bytes", 0))
        entries.add_metric([name], store.get("entries", 0))
        yield from (queries, hits, evictions, used, entries)
