"""Every series the frontend and a worker register is spelled in metric_names
(the one list that dashboards, alerts and tests read), and a worker exports
every engine series the dashboard may query."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from services.frontend.metrics import Metrics
from services.observability import metric_names as names


def declared() -> set[str]:
    return {names.full(v) for k, v in vars(names).items() if k.isupper() and isinstance(v, str)
            and k != "PREFIX"}


def families(registry: CollectorRegistry) -> set[str]:
    return {m.name for m in registry.collect()}


def test_the_frontend_registers_only_declared_names() -> None:
    pool = SimpleNamespace(all=[])
    router = SimpleNamespace(decisions={"prefix": 1}, index_fallbacks=0)
    exported = families(Metrics(pool, router, "m", "fe").registry)  # type: ignore[arg-type]
    assert exported, "no metric registered"
    assert exported <= declared(), sorted(exported - declared())
    assert names.full(names.TTFT) in exported and names.full(names.WORKER_HEALTHY) in exported


def test_a_worker_registers_only_declared_names() -> None:
    from protos import pb
    from services.worker_metrics import WorkerMetrics

    report = pb.LoadReport(counters={"prompt_tokens_computed": 3.0, "kv_bytes_received": 10.0,
                                     "remote_prefills": 1.0, "local_prefills": 1.0, "prefills": 2.0})
    state = SimpleNamespace(worker_id="w", role="decode", load=lambda: report,
                            accepted_per_position=lambda: [])
    exported = families(WorkerMetrics(state, "m").registry)  # type: ignore[arg-type]
    assert exported <= declared(), sorted(exported - declared())
    dashboard = {names.full(n) for n in (*names.HISTOGRAMS, *names.GAUGES, *names.COUNTERS)}
    assert dashboard - {names.full(n) for n in (names.ROUTER_DECISIONS, names.INDEX_FALLBACKS,
                                                 names.REQUESTS_MIGRATED)} <= exported
