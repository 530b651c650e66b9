"""OpenTelemetry traces: one trace per request across frontend, decode and prefill.

Off unless an OTLP endpoint is given (`--otlp-endpoint`, default
$OTEL_EXPORTER_OTLP_ENDPOINT).  Off, `Tracing.off()` has no tracer, the SDK is
never imported, and every hook in the services is one `if` on `enabled`.  On,
spans go through a BatchSpanProcessor (a bounded queue drained by a background
thread, which drops spans rather than wait) to an OTLP gRPC exporter.

Nothing here runs on an engine thread: the servicers note wall-clock times
(`time.time_ns()`) on their asyncio loop and create finished spans with
explicit start and end times.  W3C trace context (`traceparent`, `tracestate`)
travels in gRPC metadata between the services and is accepted from clients as
an HTTP header or gRPC metadata.

Attribute names follow OpenTelemetry's gen_ai semantic conventions where one
exists (`gen_ai.request.*`, `gen_ai.usage.*`); the rest are `splitserve.*`.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, SpanKind, Tracer

    from engine.vocab.sampling_params import SamplingParams

    Parent = Span | Context | None

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
_EXPORT_TIMEOUT_S = 5
Carrier = Mapping[str, Any] | Iterable[tuple[str, str]]
Attributes = dict[str, Any]


def add_tracing_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--otlp-endpoint", default=os.environ.get(ENDPOINT_ENV) or None,
                   help=f"send traces to this OTLP gRPC collector, e.g. http://jaeger:4317 "
                        f"(default: ${ENDPOINT_ENV}; unset: tracing off)")


def now_ns() -> int:
    return time.time_ns()


def wall_ns(monotonic_s: float) -> int:
    """A time.monotonic() reading as wall-clock nanoseconds (span timestamps)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def prefill_chunks(num_prompt_tokens: int, num_cached_tokens: int, max_batched_tokens: int) -> int:
    """Engine steps for the uncached part of a prompt at `max_batched_tokens` a step: exact
    when the request runs alone, a lower bound when it shares steps with others."""
    return max(1, math.ceil(max(num_prompt_tokens - num_cached_tokens, 1) / max(max_batched_tokens, 1)))


def sampling_attributes(params: SamplingParams) -> Attributes:
    attrs: Attributes = {"gen_ai.request.temperature": params.temperature,
                         "gen_ai.request.top_p": params.top_p}
    if params.max_tokens is not None:
        attrs["gen_ai.request.max_tokens"] = params.max_tokens
    if params.top_k > 0:
        attrs["gen_ai.request.top_k"] = params.top_k
    if params.seed is not None:
        attrs["gen_ai.request.seed"] = params.seed
    if params.n > 1:
        attrs["gen_ai.request.choice.count"] = params.n
    return attrs


def _pairs(carrier: Carrier) -> dict[str, str]:
    """HTTP headers (a case-insensitive mapping) or gRPC metadata (pairs) as a dict."""
    if isinstance(carrier, Mapping):
        return {k: carrier[k] for k in ("traceparent", "tracestate") if carrier.get(k)}
    return {k: v for k, v in carrier if k in ("traceparent", "tracestate") and isinstance(v, str)}


class Tracing:
    """One service's tracer, or nothing (`off()`).  No process-global provider
    or propagator is installed: everything goes through this object."""

    def __init__(self, provider: TracerProvider | None = None) -> None:
        self.provider = provider
        self.tracer: Tracer | None = provider.get_tracer("splitserve") if provider is not None else None
        self._propagator: Any = None
        if provider is not None:
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

            self._propagator = TraceContextTextMapPropagator()

    @property
    def enabled(self) -> bool:
        return self.tracer is not None

    @classmethod
    def off(cls) -> Tracing:
        return cls()

    @classmethod
    def start(cls, service_name: str, endpoint: str | None, instance_id: str | None = None,
              exporter: SpanExporter | None = None) -> Tracing:
        """`endpoint`: an OTLP gRPC collector (http://host:4317; https:// for TLS).
        `exporter` replaces the OTLP one (tests).  Neither: tracing off."""
        if endpoint is None and exporter is None:
            return cls.off()
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        if exporter is None:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            assert endpoint is not None
            # A collector that has not answered in 5 s is down: its spans are dropped,
            # and a stopping service waits no longer than that for it.
            exporter = OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"),
                                        timeout=_EXPORT_TIMEOUT_S)
        attrs = {"service.name": service_name, "service.namespace": "splitserve"}
        if instance_id:
            attrs["service.instance.id"] = instance_id
        provider = TracerProvider(resource=Resource.create(attrs))
        # Defaults (5 s schedule, 2048 queue) or OTEL_BSP_* from the environment.
        provider.add_span_processor(BatchSpanProcessor(exporter))
        return cls(provider)

    def shutdown(self) -> None:
        """Export what is queued, then stop (blocks up to the exporter's timeout)."""
        if self.provider is not None:
            self.provider.shutdown()

    # -- context ------------------------------------------------------------------

    def extract(self, carrier: Carrier | None) -> Context | None:
        """The caller's trace context, or None (the request starts a new trace)."""
        if not self.enabled or carrier is None:
            return None
        pairs = _pairs(carrier)
        return self._propagator.extract(pairs) if pairs else None

    def metadata(self, parent: Span) -> list[tuple[str, str]]:
        """gRPC metadata that makes `parent` the parent of the callee's spans."""
        from opentelemetry import trace

        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=trace.set_span_in_context(parent))
        return list(carrier.items())

    # -- spans --------------------------------------------------------------------

    def start_span(self, name: str, parent: Parent, start_ns: int | None = None,
                   kind: SpanKind | None = None, attributes: Attributes | None = None) -> Span:
        """A span the caller ends (`span.end(end_time=...)`).  parent None: a new trace."""
        from opentelemetry import trace
        from opentelemetry.context import Context

        assert self.tracer is not None, "tracing is off"
        if parent is None:
            ctx = Context()  # never the ambient context: parents are always explicit
        elif isinstance(parent, trace.Span):
            ctx = trace.set_span_in_context(parent, Context())
        else:
            ctx = parent
        return self.tracer.start_span(name, context=ctx, kind=kind or trace.SpanKind.INTERNAL,
                                      attributes=attributes, start_time=start_ns)

    def record(self, name: str, parent: Parent, start_ns: int, end_ns: int,
               attributes: Attributes | None = None, error: str | None = None) -> Span:
        """A finished span with explicit times (what happened between two noted instants)."""
        span = self.start_span(name, parent, start_ns, attributes=attributes)
        if error is not None:
            set_error(span, error)
        span.end(end_time=max(end_ns, start_ns))
        return span


def set_error(span: Span, message: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_status(Status(StatusCode.ERROR, message))


def server_kind() -> SpanKind:
    from opentelemetry.trace import SpanKind

    return SpanKind.SERVER


def rpc_attributes(service: str, method: str) -> Attributes:
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}
