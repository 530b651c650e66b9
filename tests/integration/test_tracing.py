"""Traces across the real stack (issue 6, acceptance 1): `splitserve up
--otlp-endpoint` at an OTLP gRPC receiver in this process.  One request's spans
from frontend, decode and prefill share the client's trace id, form one tree
under the client's span, and carry the gen_ai and splitserve attributes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest

from protos import pb, pb_grpc
from tests.otlp_receiver import Receiver, one, serve_receiver, traceparent

from .procs import ROOT, free_port

MODEL = "SmolLM2-135M-Instruct"
THRESHOLD = 16
LONG_PROMPT = "Explain, step by step and with care, why the sky looks blue during the day. " * 2


@pytest.fixture(scope="module")
def receiver() -> Iterator[tuple[Receiver, int]]:
    with serve_receiver() as r:
        yield r


@pytest.fixture(scope="module")
def stack(receiver, tmp_path_factory):  # type: ignore[no-untyped-def]
    _, otlp_port = receiver
    log = tmp_path_factory.mktemp("tracing") / "up.log"
    port, grpc_port = free_port(), free_port()
    argv = [sys.executable, "-m", "services.cli", "up", "--prefill", "1", "--decode", "1",
            "--port", str(port), "--grpc-port", str(grpc_port), "--dtype", "float32",
            "--num-blocks", "64", "--max-model-len", "512", "--num-threads", "1",
            "--local-prefill-threshold", str(THRESHOLD), "--otlp-endpoint", f"http://127.0.0.1:{otlp_port}"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OTEL_BSP_SCHEDULE_DELAY="100")
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while b"splitserve is up" not in log.read_bytes():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}", f"127.0.0.1:{grpc_port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]


def test_one_trace_across_the_stack(stack, receiver) -> None:  # type: ignore[no-untyped-def]
    url, _ = stack
    rec, _ = receiver
    header, trace_id, client_span = traceparent()
    r = httpx.post(f"{url}/v1/completions", headers={"traceparent": header}, timeout=120,
                   json={"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 5, "temperature": 0.5,
                         "top_p": 0.9, "seed": 1})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    spans = rec.wait_for(trace_id, {"request", "route", "queue", "prefill", "kv_transfer", "decode",
                                    "splitserve.v1.Decode/Generate", "splitserve.v1.Prefill/Prefill"})
    assert {s.service for s in spans} == {"splitserve-frontend", "splitserve-decode", "splitserve-prefill"}

    # One tree: the frontend's request span is the only child of the client's span,
    # and every other span's parent is a span of this trace.
    ids = {s.span_id for s in spans}
    assert len(ids) == len(spans)
    assert [s.name for s in spans if s.parent_id == client_span] == ["request"]
    assert all(s.parent_id in ids for s in spans if s.name != "request"), \
        [(s.name, s.parent_id) for s in spans]
    request = one(spans, "request", "splitserve-frontend")
    call = one(spans, "splitserve.v1.Decode/Generate", "splitserve-decode")
    prefill_call = one(spans, "splitserve.v1.Prefill/Prefill", "splitserve-prefill")
    route = one(spans, "route", "splitserve-frontend")
    assert route.parent_id == request.span_id and call.parent_id == request.span_id
    assert one(spans, "queue", "splitserve-decode").parent_id == call.span_id
    assert one(spans, "decode", "splitserve-decode").parent_id == call.span_id
    assert prefill_call.parent_id == call.span_id
    prefill = one(spans, "prefill", "splitserve-prefill")
    transfer = one(spans, "kv_transfer", "splitserve-prefill")
    assert prefill.parent_id == transfer.parent_id == prefill_call.span_id

    a = request.attributes
    assert a["gen_ai.request.model"] == MODEL
    assert a["gen_ai.request.max_tokens"] == 5
    assert a["gen_ai.request.temperature"] == pytest.approx(0.5)
    assert a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"] >= THRESHOLD
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 5
    assert a["splitserve.usage.cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert {"first_token", "finish"} <= request.events.keys()
    assert route.attributes["splitserve.decode.worker_id"] == "decode-0"
    assert call.attributes["splitserve.worker_id"] == "decode-0"
    assert route.attributes["splitserve.prefill.worker_id"] == "prefill-0"
    assert prefill_call.attributes["splitserve.worker_id"] == "prefill-0"
    assert prefill.attributes["splitserve.prefill.chunks"] >= 1
    assert transfer.attributes["splitserve.kv.blocks"] >= 1
    assert transfer.attributes["splitserve.kv.bytes"] > 0
    assert transfer.attributes["splitserve.kv.seconds"] > 0
    decode = one(spans, "decode", "splitserve-decode")
    assert decode.attributes["gen_ai.usage.output_tokens"] == 5
    assert {"first_token", "finish"} <= decode.events.keys()


def test_grpc_traceparent_and_new_traces(stack, receiver) -> None:  # type: ignore[no-untyped-def]
    url, grpc_address = stack
    rec, _ = receiver
    header, trace_id, client_span = traceparent()
    with grpc.insecure_channel(grpc_address) as ch:
        req = pb.GenerateRequest(model=MODEL, text="Hi", sampling=pb.SamplingParams(max_tokens=2))
        list(pb_grpc.FrontendStub(ch).Generate(req, timeout=60, metadata=[("traceparent", header)]))
    spans = rec.wait_for(trace_id, {"request", "decode", "prefill"})
    request = one(spans, "request", "splitserve-frontend")
    assert request.parent_id == client_span
    # A short prompt: prefilled on the decode worker, no prefill worker in the trace.
    assert one(spans, "prefill", "splitserve-decode").attributes["splitserve.prefill.location"] == "decode"
    assert {s.service for s in spans} == {"splitserve-frontend", "splitserve-decode"}

    # No traceparent: the request starts a trace of its own.
    before = {s.trace_id for s in rec.spans}
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200
    deadline = time.monotonic() + 30
    while True:
        new = [s for s in list(rec.spans) if s.name == "request" and s.trace_id not in before]
        if new or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(new) == 1 and new[0].parent_id == ""
