"""Prometheus metrics of the frontend (own registry: no process-global state)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.frontend.router import Router
from services.frontend.worker_pool import WorkerPool
from services.observability import metric_names as names
from services.observability.buckets import LATENCY_BUCKETS, LOOKUP_BUCKETS, TOKEN_BUCKETS
from services.observability.metric_names import LABELS, full

if TYPE_CHECKING:
    from services.frontend.results import Usage


class _WorkerCollector(Collector):
    """Worker health and load, read from the pool at scrape time."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool

    def collect(self):  # type: ignore[no-untyped-def]
        labels = ["worker", "role"]
        healthy = GaugeMetricFamily(full(names.WORKER_HEALTHY), "1 when the worker's load stream is up",
                                    labels=labels)
        running = GaugeMetricFamily(full(names.WORKER_RUNNING_REQUESTS), "last reported", labels=labels)
        waiting = GaugeMetricFamily(full(names.WORKER_WAITING_REQUESTS), "last reported", labels=labels)
        free = GaugeMetricFamily(full(names.WORKER_FREE_BLOCKS), "last reported free KV blocks",
                                 labels=labels)
        indexed = GaugeMetricFamily(full(names.WORKER_INDEXED_BLOCKS),
                                    "prefix-cache blocks this frontend knows the worker holds", labels=labels)
        routed = CounterMetricFamily(full(names.WORKER_REQUESTS_ROUTED),
                                     "requests this frontend routed to the worker", labels=labels)
        # The worker's own prefix-cache counters (prompt tokens), as of its last report.
        queries = CounterMetricFamily(full(names.WORKER_PREFIX_CACHE_QUERIES),
                                      "prompt tokens looked up in the worker's prefix cache", labels=labels)
        hits = CounterMetricFamily(full(names.WORKER_PREFIX_CACHE_HITS),
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
        decisions = CounterMetricFamily(full(names.ROUTER_DECISIONS),
                                        "prefill routing decisions by what decided them",
                                        labels=[*LABELS, "reason"])
        for reason, count in sorted(getattr(self.router, "decisions", {}).items()):
            decisions.add_metric([*self.labels, reason], count)
        fallbacks = CounterMetricFamily(full(names.INDEX_FALLBACKS),
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
            h = Histogram(full(name), doc, [*LABELS, *extra], buckets=buckets, registry=r)
            return h if extra else h.labels(*base)

        def counter(name: str, doc: str, *extra: str) -> Counter:
            c = Counter(full(name), doc, [*LABELS, *extra], registry=r)
            return c if extra else c.labels(*base)

        self.base = base
        self.requests = Counter(full(names.FRONTEND_REQUESTS), "finished requests by HTTP status",
                                ["endpoint", "status"], registry=r)
        self._ttft = histogram(names.TTFT, "arrival to first token of the first choice",
                               LATENCY_BUCKETS, "endpoint")
        self._e2e = histogram(names.E2E, "arrival to last token", LATENCY_BUCKETS,
                              "endpoint")
        self.itl = histogram(names.ITL, "between two outputs of one choice",
                             LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram(names.REQUEST_PROMPT_TOKENS, "prompt tokens per request",
                                               TOKEN_BUCKETS)
        self.request_generation_tokens = histogram(names.REQUEST_GENERATION_TOKENS,
                                                   "generated tokens per request", TOKEN_BUCKETS)
        self.prompt_tokens = counter(names.PROMPT_TOKENS, "prompt tokens of finished requests")
        self.generation_tokens = counter(names.GENERATION_TOKENS, "tokens generated for finished requests")
        self.cached_tokens = counter(names.CACHED_PROMPT_TOKENS,
                                     "prompt tokens the workers did not recompute")
        self._success = counter(names.REQUEST_SUCCESS, "finished choices by finish reason", "finished_reason")
        self.requests_migrated = counter(names.REQUESTS_MIGRATED,
                                         "streams resumed on another decode worker mid-generation")
        self.in_flight = Gauge(full(names.FRONTEND_REQUESTS_IN_FLIGHT), "requests being served",
                               registry=r)
        self.waiting = Gauge(full(names.FRONTEND_REQUESTS_WAITING),
                             "admitted choices (prompts x n) not yet at their first token", registry=r)
        self.worker_retries = Counter(full(names.WORKER_RETRIES),
                                      "worker calls retried on another decode worker", ["reason"],
                                      registry=r)
        self.worker_failures = Counter(full(names.WORKER_FAILURES), "worker calls that failed",
                                       ["worker", "code"], registry=r)
        self.index_lookups = Counter(full(names.INDEX_LOOKUPS), "prefix-index lookups at route time",
                                     ["result"], registry=r)
        self.index_lookup_seconds = Histogram(full(names.INDEX_LOOKUP_SECONDS),
                                              "prefix-index lookup latency at route time",
                                              buckets=LOOKUP_BUCKETS, registry=r)
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
