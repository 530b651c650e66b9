"""services/tracing.py without a stack: off means no SDK and no spans; on, the
W3C context survives HTTP headers and gRPC metadata, and spans keep the times
they are given (they are made after the fact, off the engine thread)."""

from __future__ import annotations

import subprocess
import sys

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from starlette.datastructures import Headers

from engine.sampling_params import SamplingParams
from services.tracing import Tracing, prefill_chunks, sampling_attributes

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT = "b7ad6b7169203331"


def started() -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    return Tracing.start("splitserve-test", None, "t0", exporter=exporter), exporter


def finished(tracing: Tracing, exporter: InMemorySpanExporter):  # type: ignore[no-untyped-def]
    assert tracing.provider is not None
    tracing.provider.force_flush()  # the batch processor exports in the background
    return exporter.get_finished_spans()


def test_off_imports_no_sdk_and_makes_nothing() -> None:
    code = ("import sys; from services.tracing import Tracing; t = Tracing.start('x', None); "
            "assert not t.enabled and t.extract({'traceparent': '00-' + 'a' * 32 + '-' + 'b' * 16 + '-01'}) "
            "is None; import services.worker_tracing, services.frontend.request_trace; "
            "assert 'opentelemetry.sdk' not in sys.modules, 'the SDK was imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_context_from_headers_and_metadata_round_trip() -> None:
    tracing, exporter = started()
    header = f"00-{TRACE_ID}-{PARENT}-01"
    for carrier in (Headers({"TraceParent": header}), [("traceparent", header), ("x-other", "1")]):
        span = tracing.start_span("request", tracing.extract(carrier))
        metadata = dict(tracing.metadata(span))
        span.end()
        ctx = span.get_span_context()
        assert f"{ctx.trace_id:032x}" == TRACE_ID
        assert metadata["traceparent"] == f"00-{TRACE_ID}-{ctx.span_id:016x}-01"
        child = tracing.start_span("child", tracing.extract(list(metadata.items())))
        child.end()
        assert child.parent is not None and child.parent.span_id == ctx.span_id
    [first, *_] = finished(tracing, exporter)
    assert first.parent is not None and f"{first.parent.span_id:016x}" == PARENT and first.parent.is_remote
    tracing.shutdown()


def test_no_or_bad_traceparent_starts_a_new_trace() -> None:
    tracing, exporter = started()
    for carrier in ({}, {"traceparent": "garbage"}, None):
        tracing.start_span("request", tracing.extract(carrier)).end()
    spans = finished(tracing, exporter)
    assert [s.parent for s in spans] == [None, None, None]
    assert len({s.context.trace_id for s in spans}) == 3
    tracing.shutdown()


def test_recorded_spans_keep_their_times_and_parent() -> None:
    tracing, exporter = started()
    parent = tracing.start_span("call", None, start_ns=1_000)
    tracing.record("queue", parent, 2_000, 5_000, {"splitserve.kv.blocks_reserved": 3})
    tracing.record("kv_transfer", parent, 6_000, 5_500, error="peer went away")  # end < start: clamped
    parent.end(end_time=9_000)
    queue, transfer, call = finished(tracing, exporter)
    assert (queue.start_time, queue.end_time) == (2_000, 5_000)
    assert queue.parent is not None and queue.parent.span_id == call.context.span_id
    assert dict(queue.attributes or {}) == {"splitserve.kv.blocks_reserved": 3}
    assert transfer.end_time == transfer.start_time == 6_000
    assert not transfer.status.is_ok and transfer.status.description == "peer went away"
    assert call.resource.attributes["service.name"] == "splitserve-test"
    assert call.resource.attributes["service.instance.id"] == "t0"
    tracing.shutdown()


def test_attribute_helpers() -> None:
    attrs = sampling_attributes(SamplingParams(temperature=0.5, top_p=0.9, max_tokens=7, seed=3, n=2))
    assert attrs == {"gen_ai.request.temperature": 0.5, "gen_ai.request.top_p": 0.9,
                     "gen_ai.request.max_tokens": 7, "gen_ai.request.seed": 3,
                     "gen_ai.request.choice.count": 2}
    assert prefill_chunks(100, 0, 2048) == 1
    assert prefill_chunks(5000, 0, 2048) == 3
    assert prefill_chunks(5000, 4096, 2048) == 1
    assert prefill_chunks(32, 32, 2048) == 1  # a full hit still runs one step for the last token
