"""An OTLP gRPC trace receiver in the test process: what an OpenTelemetry
collector would get from the services (opentelemetry-proto's trace service)."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@dataclass
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    events: dict[str, dict[str, Any]] = field(default_factory=dict)


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """What an OpenTelemetry collector's OTLP gRPC endpoint would receive."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.lock = threading.Lock()

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,  # noqa: N802 (gRPC's name)
               context: Any) -> trace_service_pb2.ExportTraceServiceResponse:
        with self.lock:
            for rs in request.resource_spans:
                service = {a.key: _value(a.value) for a in rs.resource.attributes}["service.name"]
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append(Span(
                            service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                            {a.key: _value(a.value) for a in s.attributes},
                            {e.name: {a.key: _value(a.value) for a in e.attributes} for e in s.events}))
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, names: set[str], timeout: float = 30) -> list[Span]:
        deadline = time.monotonic() + timeout
        while True:
            spans = self.trace(trace_id)
            if names <= {s.name for s in spans} or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)


@contextmanager
def serve_receiver() -> Iterator[tuple[Receiver, int]]:
    """A Receiver on a free loopback port: (receiver, port)."""
    rec = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(rec, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield rec, port
    finally:
        server.stop(grace=None)


def traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def one(spans: list[Span], name: str, service: str) -> Span:
    found = [s for s in spans if s.name == name and s.service == service]
    assert len(found) == 1, [(s.service, s.name) for s in spans]
    return found[0]
