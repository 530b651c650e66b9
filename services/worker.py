"""What prefill and decode workers share, by concern:

    worker_flags.py     every worker flag; flags -> EngineConfig
    worker_state.py     WorkerState: load report, Info
    worker_rpcs.py      Info / WatchLoad / Abort; sampling params + grammar; error -> status
    worker_serve.py     run, serve, drain (transport, metrics, health, registration)
    worker_metrics.py   Prometheus
    kv_layout.py        the handoff (block ids, first block, layout) in protobuf
    cache_event_log.py  prefix-cache events for WatchLoad
    affinity.py         CPU pinning
    fault_hooks.py      the fault-injection seam (tests only)

This module re-exports the names the role packages use."""

from services.worker_flags import add_worker_args, worker_engine_config
from services.worker_rpcs import RequestAborted, WorkerRPCs, abort_with, request_sampling
from services.worker_serve import run_worker
from services.worker_state import WorkerState

__all__ = ["RequestAborted", "WorkerRPCs", "WorkerState", "abort_with", "add_worker_args", "request_sampling",
           "run_worker", "worker_engine_config"]
