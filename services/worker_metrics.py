"""A worker's Prometheus metrics, named as vLLM names them with the prefix
`splitserve_`, so that vLLM dashboards and alerts port by renaming the prefix.

Two sources, both off the engine thread:
- per request, `RequestClock` observes latencies and token counts on the
  asyncio side, once per step output (one message per request per step);
- at scrape time, a collector reads gauges and engine counters from the
  worker's load report.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.outputs import StepOutput

if TYPE_CHECKING:
    from services.worker import WorkerState

LABELS = ("model_name", "worker_id", "role")
# Milliseconds to minutes: a decode step is ~10-100 ms here, a long prompt's
# prefill seconds, a queued request's wait up to minutes.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# Engine and transfer counters of the load report, under their metric names.
# Every name here is exported, as 0 until it counts something (a dashboard
# or alert should not break because, say, speculation is off).
LOAD_COUNTERS = {
    "prompt_tokens_computed": "prompt_tokens_computed",
    "num_preemptions": "num_preemptions",
    "prefix_cache_queries": "prefix_cache_queries",
    "prefix_cache_hits": "prefix_cache_hits",
    "spec_decode_num_drafts": "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens": "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens": "spec_decode_num_accepted_tokens",
    "kv_bytes_received": "kv_transfer_bytes",  # decode: bytes that landed here
    "bytes_sent": "kv_transfer_bytes",  # prefill: bytes sent from here
    "kv_transfer_failures": "kv_transfer_failures",
    "transfer_failures": "kv_transfer_failures",
    "kv_transfer_recomputes": "kv_transfer_recomputes",
    "remote_prefills": "remote_prefills",
    "local_prefills": "local_prefills",
    "prefills": "prefills",
}
# Load counters that a per-request metric above already covers under this name.
_SHADOWED = {"generation_tokens", "kv_transfer_seconds"}
ALWAYS = ("prompt_tokens_computed", "num_preemptions", "prefix_cache_queries", "prefix_cache_hits",
          "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
          "kv_transfer_bytes", "kv_transfer_failures", "kv_transfer_recomputes")
_HELP = {"prompt_tokens_computed": "prompt tokens this worker computed (prefix-cache hits excluded)",
         "num_preemptions": "requests preempted to free KV blocks",
         "prefix_cache_queries": "prompt tokens looked up in the prefix cache",
         "prefix_cache_hits": "prompt tokens found in the prefix cache",
         "kv_transfer_bytes": "KV bytes moved between workers (received on decode, sent on prefill)"}


class WorkerMetrics:
    def __init__(self, state: WorkerState) -> None:
        self.state = state
        self.registry = CollectorRegistry()
        labels = (state.engine.engine.model_name, state.worker_id, state.role)
        r = self.registry

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"splitserve_{name}", doc, LABELS, buckets=buckets, registry=r).labels(*labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"splitserve_{name}", doc, LABELS, registry=r).labels(*labels)

        self.ttft = histogram("time_to_first_token_seconds", "arrival to first token", LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "between two outputs of a request",
                             LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "arrival to finish", LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "arrival to first scheduled", LATENCY_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds", "first scheduled to first token",
                                 LATENCY_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "first token to finish", LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "prompt length per request",
                                               TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "generated tokens per request", TOKEN_BUCKETS)
        self.kv_transfer_seconds = histogram("kv_transfer_seconds", "one request's KV blocks, end to end",
                                             TRANSFER_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "prompt tokens of requests served")
        self.generation_tokens = counter("generation_tokens", "tokens generated")
        self._success = Counter("splitserve_request_success", "finished requests by finish reason",
                                (*LABELS, "finished_reason"), registry=r)
        self._labels = labels
        r.register(_LoadCollector(state, labels))

    def request_success(self, reason: str) -> None:
        self._success.labels(*self._labels, reason).inc()

    def clock(self, num_prompt_tokens: int) -> RequestClock:
        return RequestClock(self, num_prompt_tokens)


class RequestClock:
    """One request's timeline as its outputs arrive on the asyncio side."""

    __slots__ = ("m", "arrival", "first", "last", "num_prompt", "generated", "queue_time", "done")

    def __init__(self, metrics: WorkerMetrics, num_prompt_tokens: int) -> None:
        self.m = metrics
        self.arrival = self.last = time.monotonic()
        self.first: float | None = None
        self.num_prompt = num_prompt_tokens
        self.generated = 0
        self.queue_time = 0.0
        self.done = False

    def output(self, out: StepOutput, count_tokens: bool = True) -> None:
        now = time.monotonic()
        if self.first is None:
            self.first = now
            self.queue_time = min(out.queue_time, now - self.arrival)
            self.m.ttft.observe(now - self.arrival)
            self.m.queue.observe(self.queue_time)
            self.m.prefill.observe(now - self.arrival - self.queue_time)
            self.m.prompt_tokens.inc(self.num_prompt)
            self.m.request_prompt_tokens.observe(self.num_prompt)
        elif out.new_token_ids:
            self.m.itl.observe(now - self.last)
        self.last = now
        if count_tokens and out.new_token_ids:
            self.generated += len(out.new_token_ids)
            self.m.generation_tokens.inc(len(out.new_token_ids))

    def finish(self, reason: str) -> None:
        """reason: the engine's finish reason, or "abort" for a request that
        ended early (client gone, cancelled, failed).  Idempotent."""
        if self.done:
            return
        self.done = True
        now = time.monotonic()
        self.m.request_success(reason)
        if reason == "abort":
            return
        self.m.e2e.observe(now - self.arrival)
        self.m.decode.observe(now - (self.first or now))
        self.m.request_generation_tokens.observe(self.generated)


class _LoadCollector(Collector):
    """Gauges and engine counters, read from the load report at scrape time."""

    def __init__(self, state: WorkerState, labels: tuple[str, str, str]) -> None:
        self.state = state
        self.labels = list(labels)

    def collect(self) -> Iterator[Metric]:
        r = self.state.load()
        gauges = {"num_requests_running": (r.running, "requests in the running batch"),
                  "num_requests_waiting": (r.waiting, "requests waiting to be scheduled"),
                  "num_prompt_tokens_waiting": (r.queued_prompt_tokens,
                                                "prompt tokens not yet computed (prefill autoscaling)"),
                  "kv_cache_usage_perc": (1 - r.free_blocks / max(r.total_blocks, 1),
                                          "fraction of KV blocks in use (0-1)"),
                  "kv_cache_free_blocks": (r.free_blocks, "free KV blocks"),
                  "kv_cache_total_blocks": (r.total_blocks, "KV blocks in the pool"),
                  "kv_transfers_pending": (r.kv_transfers_pending, "KV transfers started and not ended")}
        for name, (value, doc) in gauges.items():
            g = GaugeMetricFamily(f"splitserve_{name}", doc, labels=LABELS)
            g.add_metric(self.labels, value)
            yield g
        totals = dict.fromkeys(ALWAYS, 0.0)
        for key, value in r.counters.items():
            name = LOAD_COUNTERS.get(key, key)
            if name not in _SHADOWED:
                totals[name] = totals.get(name, 0.0) + value
        for name, value in sorted(totals.items()):
            c = CounterMetricFamily(f"splitserve_{name}", _HELP.get(name, name.replace("_", " ")),
                                    labels=LABELS)
            c.add_metric(self.labels, value)
            yield c
        per_pos = CounterMetricFamily("splitserve_spec_decode_num_accepted_tokens_per_pos",
                                      "accepted draft tokens by their position in the draft",
                                      labels=[*LABELS, "position"])
        spec = self.state.engine.engine.spec
        for pos, accepted in enumerate(list(spec.stats.accepted_per_position) if spec is not None else []):
            per_pos.add_metric([*self.labels, str(pos)], accepted)
        yield per_pos


def start_metrics_server(metrics: WorkerMetrics, host: str, port: int) -> str:
    from prometheus_client import start_http_server

    server, _ = start_http_server(port, addr=host, registry=metrics.registry)
    return f"http://{host}:{server.server_port}/metrics"
