"""Prometheus metrics of the frontend (own registry: no process-global state)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.frontend.router import Router
from services.frontend.workers import WorkerPool
from services.worker_metrics import LABELS, LATENCY_BUCKETS, TOKEN_BUCKETS

if TYPE_CHECKING:
    from services.frontend.results import Usage

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

    def __init__(self, router: Router, labels: list[str]) -> None:
        self.router = router
        self.labels = labels

    def collect(self):  # type: ignore[no-untyped-def]
        decisions = CounterMetricFamily("splitserve_router_decisions",
                                        "prefill routing decisions by what decided them",
                                        labels=[*LABELS, "reason"])
        for reason, count in sorted(getattr(self.router, "decisions", {}).items()):
            decisions.add_metric([*self.labels, reason], count)
        fallbacks = CounterMetricFamily("splitserve_index_fallbacks",
                                        "routes made on load alone because the prefix index failed",
                                        labels=LABELS)
        fallbacks.add_metric(self.labels, getattr(self.router, "index_fallbacks", 0))
        yield from (decisions, fallbacks)


class Metrics:
    """The vLLM-named request metrics carry model_name, worker_id (this
    frontend) and role="frontend"; the per-worker views carry the worker's."""

    def __init__(self, pool: WorkerPool | None = None, router: Router | None = None,
                 model_name: str = "", frontend_id: str = "frontend") -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        base = [model_name, frontend_id, "frontend"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...], *extra: str) -> Histogram:
            h = Histogram(f"splitserve_{name}", doc, [*LABELS, *extra], buckets=buckets, registry=r)
            return h if extra else h.labels(*base)

        def counter(name: str, doc: str, *extra: str) -> Counter:
            c = Counter(f"splitserve_{name}", doc, [*LABELS, *extra], registry=r)
            return c if extra else c.labels(*base)

        self.base = base
        self.requests = Counter("splitserve_frontend_requests", "finished requests by HTTP status",
                                ["endpoint", "status"], registry=r)
        self._ttft = histogram("time_to_first_token_seconds", "arrival to first token of the first choice",
                               LATENCY_BUCKETS, "endpoint")
        self._e2e = histogram("e2e_request_latency_seconds", "arrival to last token", LATENCY_BUCKETS,
                              "endpoint")
        self.itl = histogram("inter_token_latency_seconds", "between two outputs of one choice",
                             LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "prompt tokens per request",
                                               TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "generated tokens per request", TOKEN_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "tokens generated for finished requests")
        self.cached_tokens = counter("cached_prompt_tokens", "prompt tokens the workers did not recompute")
        self._success = counter("request_success", "finished choices by finish reason", "finished_reason")
        self.requests_migrated = counter("requests_migrated",
                                         "streams resumed on another decode worker mid-generation")
        self.in_flight = Gauge("splitserve_frontend_requests_in_flight", "requests being served",
                               registry=r)
        self.waiting = Gauge("splitserve_frontend_requests_waiting",
                             "admitted choices (prompts x n) not yet at their first token", registry=r)
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
            r.register(_RouterCollector(router, base))

    def ttft(self, endpoint: str, seconds: float) -> None:
        self._ttft.labels(*self.base, endpoint).observe(seconds)

    def finished(self, endpoint: str, seconds: float, usage: Usage, reasons: list[str]) -> None:
        """A request answered in full (status 200)."""
        self._e2e.labels(*self.base, endpoint).observe(seconds)
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.generation_tokens.inc(usage.completion_tokens)
        self.cached_tokens.inc(usage.cached_tokens)
        self.request_prompt_tokens.observe(usage.prompt_tokens)
        self.request_generation_tokens.observe(usage.completion_tokens)
        for reason in reasons:
            self._success.labels(*self.base, reason).inc()

    def observe_lookup(self, seconds: float, ok: bool) -> None:
        self.index_lookups.labels("ok" if ok else "error").inc()
        self.index_lookup_seconds.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
