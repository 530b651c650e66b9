"""No silent death (issue 14, acceptance 5): an error outside `step()` kills a
decode worker's engine thread (a test-only hook: the thread raises once a file
exists).  Health goes NOT_SERVING within a second, the request in flight there
gets an error instead of hanging, the worker exits non-zero, and the frontend
routes every later request to the other decode worker."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import pb, pb_grpc
from services.cluster_auth import ENV, sync_channel
from services.convert import sampling_to_proto

from ..faults import fault_env
from .procs import FrontendProc, address, free_port, start_worker

pytestmark = pytest.mark.timeout(300)

TOKEN = "engine-death-token-0123456789"
MODEL = "SmolLM2-135M-Instruct"


class HealthWatch(threading.Thread):
    """The worker's overall health as its Watch stream reports each change."""

    def __init__(self, addr: str) -> None:
        super().__init__(daemon=True)
        self.addr = addr
        self.statuses: list[int] = []
        self.serving, self.not_serving = threading.Event(), threading.Event()
        self.not_serving_at = 0.0
        self.error: grpc.RpcError | None = None
        self.start()

    def run(self) -> None:
        try:
            with grpc.insecure_channel(self.addr) as ch:
                for r in health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=120):
                    self.statuses.append(r.status)
                    if r.status == health_pb2.HealthCheckResponse.SERVING:
                        self.serving.set()
                    elif r.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                        self.not_serving_at = time.monotonic()
                        self.not_serving.set()
                        return
        except grpc.RpcError as e:  # the stream ended before NOT_SERVING: the test says so
            self.statuses.append(-1)
            self.error = e


def running(addr: str) -> int:
    stub = pb_grpc.DecodeStub(sync_channel(addr, TOKEN))
    return next(iter(stub.WatchLoad(pb.LoadRequest(interval_seconds=0.1), timeout=10))).running


def test_engine_thread_death_is_never_silent(tmp_path: Path) -> None:
    crash = tmp_path / "crash-engine-thread"
    env = {ENV: TOKEN}
    ports = {"d0": free_port(), "d1": free_port()}
    d0 = start_worker("decode", "d0", tmp_path, "--num-blocks", "64", "--grpc-port", str(ports["d0"]),
                      env={**env, **fault_env(crash_file=crash)})
    d1 = start_worker("decode", "d1", tmp_path, "--num-blocks", "64", "--grpc-port", str(ports["d1"]),
                      env=env)
    fe = FrontendProc(tmp_path, "frontend", "--decode", f"{address(ports['d0'])},{address(ports['d1'])}",
                      "--load-interval", "0.1", env=env)
    try:
        d0.wait_ready()
        d1.wait_ready()
        deadline = time.monotonic() + 120
        while fe.health() != 200:
            assert time.monotonic() < deadline, fe.tail()
            time.sleep(0.1)

        errors: list[grpc.RpcError] = []

        def stream() -> None:  # in flight on d0 when its engine thread dies
            req = pb.WorkerGenerateRequest(request_id="in-flight", prompt_token_ids=[1, 2, 3, 4, 5],
                                           sampling=sampling_to_proto_long())
            try:
                list(pb_grpc.DecodeStub(sync_channel(d0.address, TOKEN)).Generate(req, timeout=120))
            except grpc.RpcError as e:
                errors.append(e)

        t = threading.Thread(target=stream, daemon=True)
        t.start()
        deadline = time.monotonic() + 60
        while running(d0.address) != 1:
            assert time.monotonic() < deadline, d0.tail()
            time.sleep(0.05)

        # Health watched as it changes: the worker stops listening soon after it says
        # NOT_SERVING, so a probe per connection can miss the moment it said so.
        watch = HealthWatch(d0.address)
        assert watch.serving.wait(30), (watch.statuses, d0.tail())
        crash.touch()
        start = time.monotonic()
        assert watch.not_serving.wait(5), (watch.statuses, d0.tail())
        elapsed = watch.not_serving_at - start
        assert elapsed < 1.0, f"NOT_SERVING after {elapsed:.2f} s"

        t.join(timeout=30)
        assert not t.is_alive(), "the request in flight hangs"
        assert errors and errors[0].code() == grpc.StatusCode.UNAVAILABLE, errors
        assert d0.popen.wait(timeout=30) != 0, "a worker whose engine died must exit non-zero"
        assert "fault: engine thread crashes" in d0.tail(20000)  # the hook hit...
        assert "engine thread died" in d0.tail(20000)  # ...and the worker said what it did about it

        for i in range(6):  # all routed around the dead worker
            r = httpx.post(f"{fe.url}/v1/completions", timeout=120,
                           json={"model": MODEL, "prompt": f"Count to {i}:", "max_tokens": 4})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        fe.stop()
        d0.stop()
        d1.stop()


def sampling_to_proto_long() -> pb.SamplingParams:
    from engine import SamplingParams

    return sampling_to_proto(SamplingParams(temperature=0, max_tokens=900, ignore_eos=True))
