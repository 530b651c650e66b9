"""A decode worker SIGKILLed while grammar-constrained streams run on it: the
frontend resumes each on the other worker with prompt + the tokens already
sent, marked as output, so the new worker's grammar resumes where the old one
was (a fresh grammar would insist on a new "{").  Every stream ends as the
undisturbed one did: the same tokens, valid JSON."""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import httpx
import jsonschema
import pytest

from protos import pb

from . import forkserver
from .procs import Stream, free_port, start_all, wait_until
from .test_failover import health, start_named, worker_health

ROWS = {"type": "object", "properties": {"rows": {
    "type": "array", "minItems": 5, "maxItems": 5, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "name": {"type": "string", "maxLength": 8}},
        "required": ["id", "name"]}}}, "required": ["rows"]}
PROMPTS = [f"List {i}: five people with an id and a short name, as JSON." for i in range(6)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("guided-failover")
    ports = {name: free_port() for name in ("d0", "d1")}
    workers = {name: start_named(name, tmp, ports) for name in ports}
    frontend = None
    try:
        for w in workers.values():
            w.wait_ready()
        port, grpc_port = free_port(), free_port()
        with open(tmp / "frontend.log", "wb") as log:
            frontend = forkserver.popen(
                "services.frontend",
                ["--port", str(port),
                 "--grpc-port", str(grpc_port), "--log-level", "warning",
                 "--decode", f"{workers['d0'].address},{workers['d1'].address}"],
                env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=log.fileno())
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: health(url).get("healthy_decode_workers") == 2, 120,
                   "the frontend never saw d0, d1")
        yield url, f"127.0.0.1:{grpc_port}", workers
    finally:
        if frontend is not None and frontend.poll() is None:
            frontend.send_signal(signal.SIGTERM)
            frontend.wait(timeout=30)
        for w in workers.values():
            if w.popen.poll() is None:
                w.popen.send_signal(signal.SIGCONT)
            w.stop()


def run_all(address: str) -> list[Stream]:
    sampling = pb.SamplingParams(temperature=0, max_tokens=200,
                                 guided=pb.GuidedDecoding(json_schema=json.dumps(ROWS)))
    return start_all(Stream(address, p, sampling=sampling, timeout=300) for p in PROMPTS)


def migrated(url: str) -> float:
    lines = httpx.get(f"{url}/metrics", timeout=5).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith("splitserve_requests_migrated_total"))


def test_grammar_resumes_on_the_new_worker(stack: Any) -> None:
    url, address, workers = stack
    reference = run_all(address)
    for s in reference:
        s.join(300)
    for s in reference:
        assert s.error is None and s.finish_reason == "stop", (s.error, s.text)
        jsonschema.validate(json.loads(s.text), ROWS)

    workers["d1"].popen.send_signal(signal.SIGSTOP)  # every stream starts on d0
    wait_until(lambda: worker_health(url)["d1"] == "unhealthy", 10, "a frozen worker still looked healthy")
    streams = run_all(address)
    wait_until(lambda: all(len(s.tokens) >= 3 for s in streams), 120, "the streams never started")
    workers["d1"].popen.send_signal(signal.SIGCONT)
    wait_until(lambda: worker_health(url)["d1"] == "healthy", 10, "d1 never came back")
    workers["d0"].kill(signal.SIGKILL)
    cut = [len(s.tokens) for s in streams]
    for s in streams:
        s.join(300)
    assert any(n < len(ref.tokens) for n, ref in zip(cut, reference, strict=True))  # the kill cut streams
    for ref, s in zip(reference, streams, strict=True):
        assert s.error is None, s.error
        assert s.tokens == ref.tokens and s.finish_reason == "stop"
        jsonschema.validate(json.loads(s.text), ROWS)
    assert migrated(url) == sum(n < len(ref.tokens) for n, ref in zip(cut, reference, strict=True))
