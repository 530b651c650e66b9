"""The Prometheus metrics the services export, by type (prefix `splitserve_`,
vLLM's names and suffixes).  Labels: model_name, worker_id, role, plus
finished_reason on request_success and reason on router_decisions.

The Grafana dashboard (deploy/grafana/dashboards/splitserve.json) may query
only these; tests/unit/test_compose.py checks it.
"""

from __future__ import annotations

PREFIX = "splitserve_"

HISTOGRAMS = (
    "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
    "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
    "request_prompt_tokens", "request_generation_tokens", "kv_transfer_seconds",
)
GAUGES = ("num_requests_running", "num_requests_waiting", "num_prompt_tokens_waiting", "kv_cache_usage_perc")
COUNTERS = (
    "prompt_tokens", "generation_tokens", "request_success", "num_preemptions",
    "prefix_cache_queries", "prefix_cache_hits",
    "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
    "kv_transfer_bytes", "kv_transfer_failures", "kv_transfer_recomputes",
    "router_decisions", "index_fallbacks", "requests_migrated",
)


def series_names() -> frozenset[str]:
    """Every series name a query may use: histograms as _bucket/_sum/_count,
    counters as _total (prometheus_client's exposition), gauges as they are."""
    names = {PREFIX + g for g in GAUGES}
    names |= {f"{PREFIX}{h}{s}" for h in HISTOGRAMS for s in ("_bucket", "_sum", "_count")}
    names |= {f"{PREFIX}{c}_total" for c in COUNTERS}
    return frozenset(names)
