"""Prometheus metrics of a server, names under ``mmcache:`` in vLLM's style.

Two sources, one registry per server (never the process-wide default, so servers in one process do not mix):

* What the engine, the store and the generation queues already count is read at scrape time by collectors
  (``_EngineCollector``, ``_StoreCollector``, ``_QueueCollector``): prefix-cache queries and hits in prompt
  tokens (of new requests, as vLLM counts them; a preempted request's lookups on re-admission apart), whether
  every pool reuses pages (a gauge), KV pages free / cached / live and the live share, evictions, per tier of
  the second tier (label ``tier``: ``host``, ``disk``) its hits, read-in bytes and seconds, evictions, refused
  disk pages and pages held, requests running and waiting; the one encoder-output store's queries and hits per
  kind of entry, its bytes and entries; image and speech requests queued and running. No counter is mirrored,
  so a scrape always agrees with ``engine.metrics()`` and ``store.metrics``.
* What only the server sees is recorded as requests end: chat outcomes by finish reason, errors by type (every
  error response, engine errors included), histograms of time to first token, inter-token latency, end-to-end
  latency and prompt length; per generation endpoint (``images``, ``speech``) requests by status and a latency
  histogram, and the time to first audio of speech.

Store kinds are labelled by the encoder that fills them: ``output`` (the store's default kind, which only a VLM's
vision tower uses in a server) is ``vision``; the image and speech pipelines file their entries under
``text_encoder``, ``negative_prompt``, ``position_bias`` and ``codec`` themselves.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .errors import APIError

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TOKEN_BUCKETS = tuple(float(2**i) for i in range(0, 18))
_STORE_KIND_LABELS = {"output": "vision", "position_bias": "position_bias", "text_encoder": "text_encoder",
                      "negative_prompt": "negative_prompt", "codec": "codec"}
ENGINE_SECTIONS = ("engine", "encoder", "tensor_parallel")  # entries of engine.metrics() that are not pool labels


class ServerMetrics:
    """The registry of one server over ``host`` (an ``EngineHost``, None without a chat model) and ``store``
    (the shared encoder-output store, None without one); ``observe`` is the host's callback."""

    def __init__(self, host, model_name: str, store=None):
        self.registry = CollectorRegistry(auto_describe=False)  # collectors have no describe: registering reads nothing
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
        self.endpoint_requests = Counter("mmcache:endpoint_requests", "Image and speech requests, by endpoint and "
                                         "HTTP status (499: the client went away).",
                                         labels + ["endpoint", "status"], registry=r)
        self.endpoint_latency = Histogram("mmcache:endpoint_latency_seconds", "Arrival to response of successful "
                                          "image and speech requests.", labels + ["endpoint"],
                                          buckets=_LATENCY_BUCKETS, registry=r)
        self.ttfa = Histogram("mmcache:time_to_first_audio_seconds", "Arrival to the first byte of audio of a "
                              "speech request.", labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.timeouts = Counter("mmcache:connection_timeouts", "Connections closed because a request's headers "
                                "or body did not arrive in time, by phase.", labels + ["phase"], registry=r)
        if host is not None:
            r.register(_EngineCollector(host, model_name))
        r.register(_StoreCollector(store, model_name))
        self.queues = _QueueCollector()
        r.register(self.queues)

    def watch_queue(self, endpoint: str, model_name: str, queue) -> None:
        """Report ``queue`` (a ``GenerationQueue``) as ``endpoint``'s requests waiting and running."""
        self.queues.queues[endpoint] = (model_name, queue)

    @contextmanager
    def timed(self, endpoint: str, model_name: str):
        """Records a generation request: its status (200 unless an ``APIError`` or another exception ends the
        block, or the block sets ``outcome.status``) and, for a 200, its latency."""
        outcome = _Outcome()
        start = time.perf_counter()
        try:
            yield outcome
        except APIError as e:
            outcome.status = e.status
            raise
        except BaseException:
            outcome.status = 500
            raise
        finally:
            self.endpoint_requests.labels(model_name, endpoint, str(outcome.status)).inc()
            if outcome.status == 200:
                self.endpoint_latency.labels(model_name, endpoint).observe(time.perf_counter() - start)

    def first_audio(self, model_name: str, seconds: float) -> None:
        self.ttfa.labels(model_name).observe(max(0.0, seconds))

    def observe(self, event, reason: str) -> None:
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

    def timed_out(self, phase: str) -> None:
        self.timeouts.labels(self.model_name, phase).inc()

    def error(self, error_type: str) -> None:
        self.errors.labels(self.model_name, error_type).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Reads the engine's, the pools' and the store's own counts at scrape time."""

    def __init__(self, host, model_name: str):
        self.host = host
        self.model_name = model_name

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
        yield from _prefix_cache(counter, total)
        yield gauge("mmcache:prefix_cache_enabled", "1 when every page pool reuses cached pages, 0 when one runs "
                    "with reuse off (by configuration, or a gate: `mmcache serve` says why at start).",
                    float(all(d.get("mode") == "on" for d in pools.values())))
        yield counter("mmcache:kv_cache_evictions", "KV pages evicted from the prefix cache.", total("evicted_pages"))
        num, free, cached = total("num_pages"), total("free_pages"), total("cached_pages")
        live = self._live_pages()
        yield gauge("mmcache:kv_pages_total", "KV pages in the pools.", num)
        yield gauge("mmcache:kv_pages_free", "KV pages on the free lists.", free)
        yield gauge("mmcache:kv_pages_cached", "KV pages held by the prefix index.", cached)
        yield gauge("mmcache:kv_pages_live", "KV pages held by live requests.", live)
        yield gauge("mmcache:kv_cache_usage_perc", "Share of KV pages held by live requests (0 to 1).",
                    live / num if num else 0.0)
        yield from _tiers(pools, name)
        tp = stats.get("tensor_parallel")
        if tp is not None:
            yield gauge("mmcache:tensor_parallel_size", "Ranks of the chat model's tensor-parallel group.", tp["size"])
            yield counter("mmcache:tensor_parallel_agreements", "Admissions whose matched length the ranks agreed "
                          "on (rank 0's count).", tp["agreements"])
            yield counter("mmcache:tensor_parallel_agreement_seconds", "Seconds rank 0 spent announcing admissions "
                          "and agreeing on their matched lengths.", tp["agreement_seconds"])
        yield gauge("mmcache:num_requests_running", "Requests with an output token and not yet finished.",
                    host.running)
        yield gauge("mmcache:num_requests_waiting", "Requests accepted that have no output yet.", host.waiting)

    def _live_pages(self) -> int:
        """Pages with an owner besides the index: a page's owner count is its live requests plus one if indexed."""
        live = 0
        for manager in list(self.host.core.managers.values()):
            live += int(np.count_nonzero(manager.pool.refcount > manager.index.in_index))
        return live


def _prefix_cache(counter, total):
    """The prefix cache's counters: new requests' lookups (as vLLM counts them: a preempted request looked up
    again mostly finds its own pages), and the re-admissions' apart."""
    again, again_hit = total("readmission_lookup_tokens"), total("readmission_hit_tokens")
    yield counter("mmcache:prefix_cache_queries", "Prompt tokens of new requests looked up in the prefix cache.",
                  total("lookup_tokens") - again)
    yield counter("mmcache:prefix_cache_hits", "Prompt tokens of new requests seeded from the prefix cache.",
                  total("hit_tokens") - again_hit)
    yield counter("mmcache:prefix_cache_preempted_queries",
                  "Prompt tokens looked up again by preempted requests on re-admission.", again)
    yield counter("mmcache:prefix_cache_preempted_hits",
                  "Prompt tokens seeded from the prefix cache on re-admission.", again_hit)


_TIER_COUNTERS = (
    ("hits", "mmcache:kv_tier_hits", "KV pages read back into the pool from this tier."),
    ("read_in_bytes", "mmcache:kv_tier_read_in_bytes", "Bytes of KV read back into the pool from this tier."),
    ("read_in_seconds", "mmcache:kv_tier_read_in_seconds", "Seconds spent reading KV back in from this tier."),
    ("evictions", "mmcache:kv_tier_evictions", "KV pages this tier gave up (to the tier below, or dropped)."),
    ("corrupt_pages", "mmcache:kv_tier_corrupt_pages", "Disk pages refused by their checksum or header."),
)


def _tiers(pools: dict, name: str):
    """The second tier's series per tier (``host``, ``disk``), summed over the pools that have one; nothing
    when none has."""
    levels: dict[str, dict] = {}
    for d in pools.values():
        for tier, counts in (d.get("tiers") or {}).items():
            into = levels.setdefault(tier, {})
            for key, value in counts.items():
                into[key] = into.get(key, 0) + value
    if not levels:
        return
    for key, metric, doc in _TIER_COUNTERS:
        fam = CounterMetricFamily(metric, doc, labels=["model_name", "tier"])
        for tier, counts in levels.items():
            fam.add_metric([name, tier], counts.get(key, 0))
        yield fam
    pages = GaugeMetricFamily("mmcache:kv_tier_pages", "KV pages held by this tier.", labels=["model_name", "tier"])
    for tier, counts in levels.items():
        pages.add_metric([name, tier], counts.get("pages", 0))
    yield pages


class _Outcome:
    status: int = 200


class _StoreCollector:
    """Reads the shared encoder-output store's own counts at scrape time (zeros when there is none)."""

    def __init__(self, store, model_name: str):
        self.store = store
        self.model_name = model_name

    def collect(self):
        store = self._counts()
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
        for kind, counts in (store.get("kinds") or {}).items():
            label = _STORE_KIND_LABELS.get(kind, kind)
            queries.add_metric([name, label], counts.get("lookups", 0))
            hits.add_metric([name, label], counts.get("hits", 0))
        evictions.add_metric([name], store.get("evictions", 0))
        used.add_metric([name], store.get("bytes", 0))
        entries.add_metric([name], store.get("entries", 0))
        yield from (queries, hits, evictions, used, entries)

    def _counts(self) -> dict:
        if self.store is None:
            return {}
        for _ in range(3):
            try:
                return self.store.metrics.as_dict()
            except RuntimeError:  # a request added a kind while the counts were read: read them again
                continue
        return self.store.metrics.as_dict()


class _QueueCollector:
    """Image and speech requests waiting and running, per endpoint, read from their queues at scrape time."""

    def __init__(self):
        self.queues: dict[str, tuple[str, object]] = {}

    def collect(self):
        waiting = GaugeMetricFamily("mmcache:generation_requests_waiting", "Image and speech requests queued.",
                                    labels=["model_name", "endpoint"])
        running = GaugeMetricFamily("mmcache:generation_requests_running", "Image and speech requests running.",
                                    labels=["model_name", "endpoint"])
        for endpoint, (name, queue) in list(self.queues.items()):
            waiting.add_metric([name, endpoint], queue.waiting)
            running.add_metric([name, endpoint], queue.running)
        yield from (waiting, running)
