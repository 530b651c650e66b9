"""The Prometheus metrics the services export, by type (prefix `splitserve_`,
vLLM's names and suffixes).  Labels: model_name, worker_id, role, plus
finished_reason on request_success and reason on router_decisions.

The registrations (services/worker_metrics.py, services/frontend/metrics.py)
spell every name from here.  HISTOGRAMS, GAUGES and COUNTERS are the series
the Grafana dashboard (deploy/grafana/dashboards/splitserve.json) and the
Kubernetes autoscalers may query; tests/unit/test_compose.py checks it.  The
rest are operator views (per-worker health, the frontend's own counts).
"""

from __future__ import annotations

PREFIX = "splitserve_"
LABELS = ("model_name", "worker_id", "role")

# Histograms (per request).
TTFT = "time_to_first_token_seconds"
ITL = "inter_token_latency_seconds"
E2E = "e2e_request_latency_seconds"
QUEUE_TIME = "request_queue_time_seconds"
PREFILL_TIME = "request_prefill_time_seconds"
DECODE_TIME = "request_decode_time_seconds"
REQUEST_PROMPT_TOKENS = "request_prompt_tokens"
REQUEST_GENERATION_TOKENS = "request_generation_tokens"
KV_TRANSFER_SECONDS = "kv_transfer_seconds"
# Gauges (a worker's load report).
NUM_REQUESTS_RUNNING = "num_requests_running"
NUM_REQUESTS_WAITING = "num_requests_waiting"
NUM_PROMPT_TOKENS_WAITING = "num_prompt_tokens_waiting"
KV_CACHE_USAGE_PERC = "kv_cache_usage_perc"
# Counters.
PROMPT_TOKENS = "prompt_tokens"
GENERATION_TOKENS = "generation_tokens"
REQUEST_SUCCESS = "request_success"
NUM_PREEMPTIONS = "num_preemptions"
PREFIX_CACHE_QUERIES = "prefix_cache_queries"
PREFIX_CACHE_HITS = "prefix_cache_hits"
SPEC_DECODE_NUM_DRAFTS = "spec_decode_num_drafts"
SPEC_DECODE_NUM_DRAFT_TOKENS = "spec_decode_num_draft_tokens"
SPEC_DECODE_NUM_ACCEPTED_TOKENS = "spec_decode_num_accepted_tokens"
KV_TRANSFER_BYTES = "kv_transfer_bytes"
KV_TRANSFER_FAILURES = "kv_transfer_failures"
KV_TRANSFER_RECOMPUTES = "kv_transfer_recomputes"
ROUTER_DECISIONS = "router_decisions"
INDEX_FALLBACKS = "index_fallbacks"
REQUESTS_MIGRATED = "requests_migrated"

HISTOGRAMS = (TTFT, ITL, E2E, QUEUE_TIME, PREFILL_TIME, DECODE_TIME, REQUEST_PROMPT_TOKENS,
              REQUEST_GENERATION_TOKENS, KV_TRANSFER_SECONDS)
GAUGES = (NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING, NUM_PROMPT_TOKENS_WAITING, KV_CACHE_USAGE_PERC)
COUNTERS = (
    PROMPT_TOKENS, GENERATION_TOKENS, REQUEST_SUCCESS, NUM_PREEMPTIONS,
    PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS,
    SPEC_DECODE_NUM_DRAFTS, SPEC_DECODE_NUM_DRAFT_TOKENS, SPEC_DECODE_NUM_ACCEPTED_TOKENS,
    KV_TRANSFER_BYTES, KV_TRANSFER_FAILURES, KV_TRANSFER_RECOMPUTES,
    ROUTER_DECISIONS, INDEX_FALLBACKS, REQUESTS_MIGRATED,
)

# Operator views: a worker's pool and transfers, the per-worker view the
# frontend keeps, and the frontend's own counts.
PROMPT_TOKENS_COMPUTED = "prompt_tokens_computed"
PREFILLS = "prefills"
REMOTE_PREFILLS = "remote_prefills"
LOCAL_PREFILLS = "local_prefills"
KV_CACHE_FREE_BLOCKS = "kv_cache_free_blocks"
KV_CACHE_TOTAL_BLOCKS = "kv_cache_total_blocks"
KV_TRANSFERS_PENDING = "kv_transfers_pending"
SPEC_DECODE_ACCEPTED_PER_POS = "spec_decode_num_accepted_tokens_per_pos"
WORKER_HEALTHY = "worker_healthy"
WORKER_RUNNING_REQUESTS = "worker_running_requests"
WORKER_WAITING_REQUESTS = "worker_waiting_requests"
WORKER_FREE_BLOCKS = "worker_free_blocks"
WORKER_INDEXED_BLOCKS = "worker_indexed_blocks"
WORKER_REQUESTS_ROUTED = "worker_requests_routed"
WORKER_PREFIX_CACHE_QUERIES = "worker_prefix_cache_queries"
WORKER_PREFIX_CACHE_HITS = "worker_prefix_cache_hits"
WORKER_RETRIES = "worker_retries"
WORKER_FAILURES = "worker_failures"
FRONTEND_REQUESTS = "frontend_requests"
FRONTEND_REQUESTS_IN_FLIGHT = "frontend_requests_in_flight"
FRONTEND_REQUESTS_WAITING = "frontend_requests_waiting"
CACHED_PROMPT_TOKENS = "cached_prompt_tokens"
INDEX_LOOKUPS = "index_lookups"
INDEX_LOOKUP_SECONDS = "index_lookup_seconds"


def series_names() -> frozenset[str]:
    """Every series name a query may use: histograms as _bucket/_sum/_count,
    counters as _total (prometheus_client's exposition), gauges as they are."""
    names = {PREFIX + g for g in GAUGES}
    names |= {f"{PREFIX}{h}{s}" for h in HISTOGRAMS for s in ("_bucket", "_sum", "_count")}
    names |= {f"{PREFIX}{c}_total" for c in COUNTERS}
    return frozenset(names)


def full(name: str) -> str:
    """The exported metric name."""
    return PREFIX + name
