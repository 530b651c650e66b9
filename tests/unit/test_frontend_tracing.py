"""The frontend's spans against fake workers (no model, about a second): the
client's trace continues, the decode call carries the request span as its
parent in gRPC metadata, a failed worker call shows as an event plus a second
route, and n choices fan out under one request span."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest

from protos import pb_grpc
from services.frontend.app import serve
from services.frontend.config import FrontendConfig
from tests.otlp_receiver import Receiver, one, serve_receiver, traceparent
from tests.unit.test_frontend_service import (
    THRESHOLD,
    FakeDecode,
    FakePrefill,
    free_port,
    report_running,
    tiny_model_dir,
)

FE = "splitserve-frontend"


class MetadataDecode(FakeDecode):
    """A fake decode worker that keeps the traceparent each Generate call came with."""

    def __init__(self, worker_id: str) -> None:
        super().__init__(worker_id)
        self.traceparents: list[str | None] = []

    async def Generate(self, request: Any, context: Any):  # type: ignore[no-untyped-def]  # noqa: N802
        self.traceparents.append(dict(context.invocation_metadata()).get("traceparent"))
        async for r in super().Generate(request, context):
            yield r


class TracedStack:
    def __init__(self, model_dir: str, otlp_port: int) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.decodes = [MetadataDecode("d0"), MetadataDecode("d1")]
        self.prefill = FakePrefill("p0")
        self.servers: list[grpc.aio.Server] = []
        for fake in (*self.decodes, self.prefill):
            fake.address = f"127.0.0.1:{free_port()}"
            asyncio.run_coroutine_threadsafe(self._start(fake), self.loop).result(10)
        port = free_port()
        config = FrontendConfig(
            port=port, grpc_port=free_port(), model=model_dir, served_model_name="fake-model",
            decode=tuple(d.address for d in self.decodes), prefill=(self.prefill.address,),
            local_prefill_threshold=THRESHOLD, load_interval_seconds=0.05, shutdown_grace_seconds=0.5,
            log_level="warning", otlp_endpoint=f"http://127.0.0.1:{otlp_port}")
        self.stop = asyncio.run_coroutine_threadsafe(self._event(), self.loop).result(10)
        self.frontend = asyncio.run_coroutine_threadsafe(serve(config, self.stop), self.loop)
        self.url = f"http://127.0.0.1:{port}"

    async def _event(self) -> asyncio.Event:
        return asyncio.Event()

    async def _start(self, fake: Any) -> None:
        server = grpc.aio.server()
        if isinstance(fake, FakeDecode):
            pb_grpc.add_DecodeServicer_to_server(fake, server)
        else:
            pb_grpc.add_PrefillServicer_to_server(fake, server)
        server.add_insecure_port(fake.address)
        await server.start()
        self.servers.append(server)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        try:
            self.frontend.result(15)  # exports what is queued on the way out
        finally:
            for server in self.servers:
                asyncio.run_coroutine_threadsafe(server.stop(None), self.loop).result(5)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)


@pytest.fixture(scope="module")
def short_export_delay() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # read when the frontend's span processor starts
        yield mp


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory,
           short_export_delay: pytest.MonkeyPatch) -> Iterator[tuple[TracedStack, Receiver]]:
    with serve_receiver() as (rec, port):
        stack = TracedStack(tiny_model_dir(tmp_path_factory.mktemp("model")), port)
        try:
            for _ in range(200):
                try:
                    r = httpx.get(f"{stack.url}/health", timeout=1)
                    if r.status_code == 200 and r.json()["healthy_decode_workers"] == 2:
                        break
                except httpx.TransportError:
                    pass
                threading.Event().wait(0.05)
            yield stack, rec
        finally:
            stack.close()


def test_retry_and_fan_out_under_the_clients_trace(traced: tuple[TracedStack, Receiver]) -> None:
    stack, rec = traced
    d0, d1 = stack.decodes
    d0.fail_salts["flaky"] = grpc.StatusCode.UNAVAILABLE
    # The router tries d0 first, for both choices, once it has seen d1's load.
    report_running(stack.url, d1, 50)
    header, trace_id, client_span = traceparent()
    r = httpx.post(f"{stack.url}/v1/completions", headers={"traceparent": header}, timeout=10,
                   json={"model": "fake-model", "prompt": [1, 2, 3], "max_tokens": 2, "n": 2, "seed": 5,
                         "cache_salt": "flaky"})
    assert r.status_code == 200, r.text
    spans = rec.wait_for(trace_id, {"request"}, timeout=10)
    request = one(spans, "request", FE)
    assert request.parent_id == client_span
    assert request.attributes["gen_ai.request.choice.count"] == 2
    assert request.attributes["gen_ai.usage.output_tokens"] == 4
    assert request.attributes["gen_ai.response.finish_reasons"] == ["length", "length"]
    routes = [s for s in spans if s.name == "route"]
    assert all(s.parent_id == request.span_id for s in routes)
    # Each choice: d0 (fails before its first token), then d1.
    assert sorted((s.attributes["splitserve.route.attempt"], s.attributes["splitserve.decode.worker_id"])
                  for s in routes) == [(1, "d0"), (1, "d0"), (2, "d1"), (2, "d1")]
    assert "worker_failed" in request.events
    # Every decode call named the request span as its parent.
    sent = d0.traceparents[-2:] + d1.traceparents[-2:]
    assert sent == [f"00-{trace_id}-{request.span_id}-01"] * 4
