"""What a running worker knows about itself: its engine, addresses, layout,
load report and Info answer, shared by its RPCs, metrics and shutdown."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from engine.llm_engine import LLMEngine
from kvtransfer.layout import KVLayout
from protos import pb
from services.cache_event_log import CacheEventLog
from services.engine_loop import EngineLoop
from services.fault_hooks import FaultHooks
from services.kv_layout import layout_to_proto
from services.tracing import Tracing
from services.worker_metrics import WorkerMetrics

if TYPE_CHECKING:
    from kvtransfer.transport import KVTransport


@dataclass
class WorkerState:
    role: str
    worker_id: str
    engine: EngineLoop
    grpc_address: str = ""
    kv_address: str = ""  # the UCX listener's host:port (WorkerInfo.ucx_address, PrefillRequest.kv_address)
    metrics_url: str = ""
    extra_counters: Callable[[], dict[str, float]] | None = None
    cache_events: CacheEventLog = field(default_factory=CacheEventLog)
    tracing: Tracing = field(default_factory=Tracing.off)
    metrics: WorkerMetrics | None = None  # Prometheus; set up before serving
    draining: bool = False  # SIGTERM: finish what is here, take nothing new
    transport: KVTransport | None = None  # for its pending transfers
    faults: FaultHooks = field(default_factory=FaultHooks)  # tests only (services/fault_hooks.py)

    @property
    def layout(self) -> KVLayout:
        """This worker's KV blocks (built once, by its engine)."""
        return self.engine.engine.kv_layout

    def load(self) -> pb.LoadReport:
        eng = self.engine.engine
        sched = eng.scheduler
        queued = sum(r.num_tokens - r.num_computed_tokens for r in list(sched.requests.values()))
        counters = {"prompt_tokens_computed": float(eng.prompt_tokens_computed),
                    "generation_tokens": float(eng.generation_tokens),
                    "num_preemptions": float(sched.num_preemptions),
                    "prefix_cache_queries": float(eng.kv.prefix_queries),
                    "prefix_cache_hits": float(eng.kv.prefix_hits)}
        counters.update(spec_decode_counters(eng))
        if self.extra_counters is not None:
            counters.update(self.extra_counters())
        return pb.LoadReport(worker_id=self.worker_id, role=self.role, running=sched.num_running,
                             waiting=sched.num_waiting, free_blocks=eng.kv.num_free_blocks,
                             total_blocks=eng.kv.num_blocks, queued_prompt_tokens=queued,
                             counters=counters, draining=self.draining,
                             kv_transfers_pending=self.transport.num_pending if self.transport else 0)

    def info(self) -> pb.WorkerInfo:
        eng = self.engine.engine
        return pb.WorkerInfo(worker_id=self.worker_id, role=self.role, pid=os.getpid(),
                             grpc_address=self.grpc_address, ucx_address=self.kv_address,
                             metrics_url=self.metrics_url, model_id=eng.model_id,
                             layout=layout_to_proto(self.layout), max_model_len=eng.max_model_len)

    def accepted_per_position(self) -> list[int]:
        spec = self.engine.engine.spec
        return list(spec.stats.accepted_per_position) if spec is not None else []


def spec_decode_counters(engine: LLMEngine) -> dict[str, float]:
    stats = engine.spec.stats if engine.spec is not None else None
    return {"spec_decode_num_drafts": float(stats.num_drafts if stats else 0),
            "spec_decode_num_draft_tokens": float(stats.num_draft_tokens if stats else 0),
            "spec_decode_num_accepted_tokens": float(stats.num_accepted_tokens if stats else 0)}


def numeric_fields(stats: object) -> dict[str, float]:
    """A stats dataclass's numeric fields as counters."""
    return {k: float(v) for k, v in asdict(stats).items() if isinstance(v, (int, float))}  # type: ignore[call-overload]
