"""Prometheus metrics of the frontend (own registry: no process-global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.frontend.router import Router
from services.frontend.workers import WorkerPool

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_LOOKUP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)


class _WorkerCollector(Collector):
    """Worker health and load, read from the pool at scrape time."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool

    def collect(self):  # type: ignore[no-untyped-def]
        labels = ["worker", "role"]
        healthy = GaugeMetricFamily("splitserve_worker_healthy", "1 when the worker's load stream is up",
                                    labels=labels)
        running = GaugeMetricFamily("splitserve_worker_running_requests", "last reported", labels=labels)
        waiting = GaugeMetricFamily("splitserve_worker_waiting_requests", "last reported", labels=labels)
        free = GaugeMetricFamily("splitserve_worker_free_blocks", "last reported free KV blocks",
                                 labels=labels)
        indexed = GaugeMetricFamily("splitserve_worker_indexed_blocks",
                                    "prefix-cache blocks this frontend knows the worker holds", labels=labels)
        routed = CounterMetricFamily("splitserve_worker_requests_routed",
                                     "requests this frontend routed to the worker", labels=labels)
        # The worker's own prefix-cache counters (prompt tokens), as of its last report.
        queries = CounterMetricFamily("splitserve_worker_prefix_cache_queries",
                                      "prompt tokens looked up in the worker's prefix cache", labels=labels)
        hits = CounterMetricFamily("splitserve_worker_prefix_cache_hits",
                                   "prompt tokens found in the worker's prefix cache", labels=labels)
        for w in self.pool.all:
            key = [w.worker_id, w.role]
            healthy.add_metric(key, 1.0 if w.healthy else 0.0)
            load = w.load
            running.add_metric(key, load.running if load else 0)
            waiting.add_metric(key, load.waiting if load else 0)
            free.add_metric(key, load.free_blocks if load else 0)
            indexed.add_metric(key, len(w.cached))
            routed.add_metric(key, w.routed)
            counters = load.counters if load else {}
            queries.add_metric(key, counters.get("prefix_cache_queries", 0.0))
            hits.add_metric(key, counters.get("prefix_cache_hits", 0.0))
        yield from (healthy, running, waiting, free, indexed, routed, queries, hits)


class _RouterCollector(Collector):
    """The router's decision counts, read at scrape time (the router stays pure)."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self):  # type: ignore[no-untyped-def]
        decisions = CounterMetricFamily("splitserve_router_decisions",
                                        "prefill routing decisions by what decided them", labels=["reason"])
        for reason, count in sorted(getattr(self.router, "decisions", {}).items()):
            decisions.add_metric([reason], count)
        fallbacks = CounterMetricFamily("splitserve_index_fallbacks",
                                        "prefix-index lookups that failed, so load alone routed")
        fallbacks.add_metric([], getattr(self.router, "index_fallbacks", 0))
        yield from (decisions, fallbacks)


class Metrics:
    def __init__(self, pool: WorkerPool | None = None, router: Router | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("splitserve_frontend_requests", "finished requests",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("splitserve_time_to_first_token_seconds",
                              "arrival to first token of the first choice", ["endpoint"],
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("splitserve_e2e_request_latency_seconds", "arrival to last token",
                             ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("splitserve_prompt_tokens", "prompt tokens of finished requests",
                                     registry=r)
        self.generation_tokens = Counter("splitserve_generation_tokens", "generated tokens", registry=r)
        self.cached_tokens = Counter("splitserve_cached_prompt_tokens",
                                     "prompt tokens the workers did not recompute", registry=r)
        self.in_flight = Gauge("splitserve_frontend_requests_in_flight", "requests being served",
                               registry=r)
        self.worker_retries = Counter("splitserve_worker_retries",
                                      "worker calls retried on another decode worker", ["reason"],
                                      registry=r)
        self.worker_failures = Counter("splitserve_worker_failures", "worker calls that failed",
                                       ["worker", "code"], registry=r)
        self.index_lookups = Counter("splitserve_index_lookups", "prefix-index lookups at route time",
                                     ["result"], registry=r)
        self.index_lookup_seconds = Histogram("splitserve_index_lookup_seconds",
                                              "prefix-index lookup latency at route time",
                                              buckets=_LOOKUP_BUCKETS, registry=r)
        if pool is not None:
            r.register(_WorkerCollector(pool))
        if router is not None:
            r.register(_RouterCollector(router))

    def observe_lookup(self, seconds: float, ok: bool) -> None:
        self.index_lookups.labels("ok" if ok else "error").inc()
        self.index_lookup_seconds.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
