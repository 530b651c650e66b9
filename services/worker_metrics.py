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
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.outputs import StepOutput
from services.observability import metric_names as names
from services.observability.buckets import LATENCY_BUCKETS, TOKEN_BUCKETS, TRANSFER_BUCKETS
from services.observability.metric_names import LABELS, full

if TYPE_CHECKING:
    from protos import pb

# Engine and transfer counters of the load report, under their metric names.
# Every name here is exported, as 0 until it counts something (a dashboard
# or alert should not break because, say, speculation is off).
LOAD_COUNTERS = {
    "prompt_tokens_computed": names.PROMPT_TOKENS_COMPUTED,
    "num_preemptions": names.NUM_PREEMPTIONS,
    "prefix_cache_queries": names.PREFIX_CACHE_QUERIES,
    "prefix_cache_hits": names.PREFIX_CACHE_HITS,
    "spec_decode_num_drafts": names.SPEC_DECODE_NUM_DRAFTS,
    "spec_decode_num_draft_tokens": names.SPEC_DECODE_NUM_DRAFT_TOKENS,
    "spec_decode_num_accepted_tokens": names.SPEC_DECODE_NUM_ACCEPTED_TOKENS,
    "kv_bytes_received": names.KV_TRANSFER_BYTES,  # decode: bytes that landed here
    "bytes_sent": names.KV_TRANSFER_BYTES,  # prefill: bytes sent from here
    "kv_transfer_failures": names.KV_TRANSFER_FAILURES,
    "transfer_failures": names.KV_TRANSFER_FAILURES,
    "kv_transfer_recomputes": names.KV_TRANSFER_RECOMPUTES,
    "remote_prefills": names.REMOTE_PREFILLS,
    "local_prefills": names.LOCAL_PREFILLS,
    "prefills": names.PREFILLS,
}
# Load counters that a per-request metric above already covers under this name.
_SHADOWED = {names.GENERATION_TOKENS, names.KV_TRANSFER_SECONDS}
ALWAYS = (names.PROMPT_TOKENS_COMPUTED, names.NUM_PREEMPTIONS, names.PREFIX_CACHE_QUERIES,
          names.PREFIX_CACHE_HITS, names.SPEC_DECODE_NUM_DRAFTS, names.SPEC_DECODE_NUM_DRAFT_TOKENS,
          names.SPEC_DECODE_NUM_ACCEPTED_TOKENS, names.KV_TRANSFER_BYTES, names.KV_TRANSFER_FAILURES,
          names.KV_TRANSFER_RECOMPUTES)
_HELP = {names.PROMPT_TOKENS_COMPUTED: "prompt tokens this worker computed (prefix-cache hits excluded)",
         names.NUM_PREEMPTIONS: "requests preempted to free KV blocks",
         names.PREFIX_CACHE_QUERIES: "prompt tokens looked up in the prefix cache",
         names.PREFIX_CACHE_HITS: "prompt tokens found in the prefix cache",
         names.KV_TRANSFER_BYTES: "KV bytes moved between workers (received on decode, sent on prefill)"}


class LoadSource(Protocol):
    """What the scrape-time collector reads (a worker's WorkerState)."""

    role: str
    worker_id: str

    def load(self) -> pb.LoadReport: ...

    def accepted_per_position(self) -> list[int]: ...


class WorkerMetrics:
    def __init__(self, source: LoadSource, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = (model_name, source.worker_id, source.role)
        r = self.registry

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(full(name), doc, LABELS, buckets=buckets, registry=r).labels(*labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(full(name), doc, LABELS, registry=r).labels(*labels)

        self.ttft = histogram(names.TTFT, "arrival to first token", LATENCY_BUCKETS)
        self.itl = histogram(names.ITL, "between two outputs of a request",
                             LATENCY_BUCKETS)
        self.e2e = histogram(names.E2E, "arrival to finish", LATENCY_BUCKETS)
        self.queue = histogram(names.QUEUE_TIME, "arrival to first scheduled", LATENCY_BUCKETS)
        self.prefill = histogram(names.PREFILL_TIME, "first scheduled to first token",
                                 LATENCY_BUCKETS)
        self.decode = histogram(names.DECODE_TIME, "first token to finish", LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram(names.REQUEST_PROMPT_TOKENS, "prompt length per request",
                                               TOKEN_BUCKETS)
        self.request_generation_tokens = histogram(names.REQUEST_GENERATION_TOKENS,
                                                   "generated tokens per request", TOKEN_BUCKETS)
        self.kv_transfer_seconds = histogram(names.KV_TRANSFER_SECONDS, "one request's KV blocks, end to end",
                                             TRANSFER_BUCKETS)
        self.prompt_tokens = counter(names.PROMPT_TOKENS, "prompt tokens of requests served")
        self.generation_tokens = counter(names.GENERATION_TOKENS, "tokens generated")
        self._success = Counter(full(names.REQUEST_SUCCESS), "finished requests by finish reason",
                                (*LABELS, "finished_reason"), registry=r)
        self._labels = labels
        r.register(_LoadCollector(source, labels))

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

    def __init__(self, source: LoadSource, labels: tuple[str, str, str]) -> None:
        self.source = source
        self.labels = list(labels)

    def collect(self) -> Iterator[Metric]:
        r = self.source.load()
        gauges = {names.NUM_REQUESTS_RUNNING: (r.running, "requests in the running batch"),
                  names.NUM_REQUESTS_WAITING: (r.waiting, "requests waiting to be scheduled"),
                  names.NUM_PROMPT_TOKENS_WAITING: (r.queued_prompt_tokens,
                                                "prompt tokens not yet computed (prefill autoscaling)"),
                  names.KV_CACHE_USAGE_PERC: (1 - r.free_blocks / max(r.total_blocks, 1),
                                          "fraction of KV blocks in use (0-1)"),
                  names.KV_CACHE_FREE_BLOCKS: (r.free_blocks, "free KV blocks"),
                  names.KV_CACHE_TOTAL_BLOCKS: (r.total_blocks, "KV blocks in the pool"),
                  names.KV_TRANSFERS_PENDING: (r.kv_transfers_pending, "KV transfers started and not ended")}
        for name, (value, doc) in gauges.items():
            g = GaugeMetricFamily(full(name), doc, labels=LABELS)
            g.add_metric(self.labels, value)
            yield g
        totals = dict.fromkeys(ALWAYS, 0.0)
        for key, value in r.counters.items():
            name = LOAD_COUNTERS.get(key, key)
            if name not in _SHADOWED:
                totals[name] = totals.get(name, 0.0) + value
        for name, value in sorted(totals.items()):
            c = CounterMetricFamily(full(name), _HELP.get(name, name.replace("_", " ")),
                                    labels=LABELS)
            c.add_metric(self.labels, value)
            yield c
        per_pos = CounterMetricFamily(full(names.SPEC_DECODE_ACCEPTED_PER_POS),
                                      "accepted draft tokens by their position in the draft",
                                      labels=[*LABELS, "position"])
        for pos, accepted in enumerate(self.source.accepted_per_position()):
            per_pos.add_metric([*self.labels, str(pos)], accepted)
        yield per_pos


def start_metrics_server(metrics: WorkerMetrics, host: str, port: int) -> str:
    from prometheus_client import start_http_server

    server, _ = start_http_server(port, addr=host, registry=metrics.registry)
    return f"http://{host}:{server.server_port}/metrics"
