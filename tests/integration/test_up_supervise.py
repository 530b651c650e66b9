"""`splitserve up` supervises its processes (issue 13): a decode worker
SIGKILLed while a stream runs on it is restarted on the same port and rejoins
(the frontend reconnects to the same address; the new process serves again),
the stream fails over to the other worker meanwhile and requests keep being
answered; a SIGKILLed frontend comes back on the same ports; a worker that
cannot start again (its port taken) is a crash loop that stops the stack with
a clear message and a non-zero exit."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.faults import fault_env

from .procs import ROOT, Stream, free_port, start_all, wait_until

PROMPT = "A lighthouse keeper finds a message in a bottle. Tell what it says and what happens next."
MAX_TOKENS = 96  # long enough that the kill lands mid-stream


class Up:
    """One `splitserve up` process and its log."""

    def __init__(self, tmp: Path, *flags: str) -> None:
        self.log = tmp / "up.log"
        self.slow_steps = tmp / "slow-steps"  # while it exists every worker's steps wait (tests/faults.py)
        self.port, self.grpc_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.grpc_address = f"127.0.0.1:{self.grpc_port}"
        argv = [sys.executable, "-m", "services.cli", "up", "--prefill", "0", "--port", str(self.port),
                "--grpc-port", str(self.grpc_port), "--dtype", "float32", "--num-blocks", "128",
                "--max-model-len", "1024", "--num-threads", "1", "--cpu-affinity", "off", *flags]
        with open(self.log, "wb") as out:
            self.popen = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                          env=dict(os.environ, PYTHONUNBUFFERED="1",
                                                   **fault_env(step_slow_file=self.slow_steps)),
                                          start_new_session=True)
        wait_until(lambda: "splitserve is up" in self.text(), 300, self.text,
                   lambda: self.popen.poll() is None)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def workers(self) -> dict[str, dict[str, Any]]:
        return {w["id"]: w for w in httpx.get(f"{self.url}/cluster", timeout=5).json()["workers"]}

    def child_pids(self, module: str) -> list[int]:
        """This launcher's children running `python -m <module>`."""
        with open(f"/proc/{self.popen.pid}/task/{self.popen.pid}/children") as f:
            pids = [int(p) for p in f.read().split()]
        out = []
        for pid in pids:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if module.encode() in f.read().split(b"\0"):
                        out.append(pid)
            except FileNotFoundError:
                pass
        return out

    def close(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)

def quietly(fn: Callable[[], bool]) -> Callable[[], bool]:
    """`fn`, False while the frontend is not answering."""
    def call() -> bool:
        try:
            return fn()
        except (httpx.TransportError, ValueError, KeyError):
            return False
    return call


def counter(metrics: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(name))


@pytest.fixture(scope="module")
def up(tmp_path_factory) -> Iterator[Up]:  # type: ignore[no-untyped-def]
    stack = Up(tmp_path_factory.mktemp("up-supervise"), "--decode", "2", "--routing", "round-robin")
    yield stack
    stack.close()
    assert stack.popen.returncode == 0, stack.text()[-3000:]


def test_killed_decode_worker_fails_over_restarts_and_rejoins(up: Up) -> None:
    reference = Stream(up.grpc_address, PROMPT, MAX_TOKENS)
    reference.start()
    expected = reference.result()

    # Steps of 30 ms from here, so that the kill lands mid-stream on any machine.
    up.slow_steps.write_text("0.03")
    try:
        stream = Stream(up.grpc_address, PROMPT, MAX_TOKENS)
        stream.start()
        # The victim: the worker that reports the stream running, once tokens flow.
        wait_until(lambda: bool(stream.tokens) and any(w["running"] >= 1 and w["inflight"] >= 1
                                                       for w in up.workers().values()), 60,
                   "the stream never ran", lambda: stream.is_alive())
        victim = next(w for w in up.workers().values() if w["running"] >= 1 and w["inflight"] >= 1)
        os.kill(victim["pid"], signal.SIGKILL)
        cut_at = len(stream.tokens)
        assert cut_at < MAX_TOKENS
        result = stream.result()
    finally:
        up.slow_steps.unlink()
    assert "fault: each step waits" in up.text()  # the stream was slowed
    assert result == expected  # resumed on the survivor: nothing lost or repeated
    metrics = httpx.get(f"{up.url}/metrics", timeout=5).text
    assert counter(metrics, "splitserve_requests_migrated_total") == 1  # the kill did cut this stream
    answered = [Stream(up.grpc_address, f"Request {i}: name a colour.", 8) for i in range(3)]
    for s in answered:  # while the victim is down or restarting
        assert len(s.complete()) == 8

    wait_until(quietly(lambda: up.workers()[victim["id"]]["health"] == "healthy"
                       and up.workers()[victim["id"]]["pid"] != victim["pid"]), 180,
               lambda: f"{victim['id']} never came back:\n{up.text()[-3000:]}")
    new_pid = up.workers()[victim["id"]]["pid"]
    assert f"{victim['id']} (pid {victim['pid']}) was killed by SIGKILL; restarting in" in up.text()
    # The supervisor polls: its "is back" line may follow the frontend's health probe.
    wait_until(lambda: f"{victim['id']} is back (pid {new_pid})" in up.text(), 10, up.text)
    # Rejoined: requests at once are spread over both workers again (the frontend counts
    # its own in-flight requests as it routes them; one at a time, a tie on load and
    # cache can go to the survivor every time), and it generates (counters restarted at 0).
    again = start_all(Stream(up.grpc_address, f"Again {i}: name a fruit.", 32) for i in range(4))
    assert all(len(s.result()) == 32 for s in again)
    wait_until(quietly(lambda: up.workers()[victim["id"]]["counters"]["generation_tokens"] > 0), 10,
               "the restarted worker took no work")


def test_killed_frontend_is_restarted_on_the_same_ports(up: Up) -> None:
    [pid] = up.child_pids("services.frontend")
    os.kill(pid, signal.SIGKILL)
    health = f"{up.url}/health"
    wait_until(quietly(lambda: httpx.get(health, timeout=1).json()["healthy_decode_workers"] == 2), 120,
               lambda: f"the frontend never came back:\n{up.text()[-3000:]}")
    [new_pid] = up.child_pids("services.frontend")
    assert new_pid != pid
    assert f"frontend (pid {pid}) was killed by SIGKILL; restarting in" in up.text()
    assert len(Stream(up.grpc_address, "Hello again.", 8).complete()) == 8
    wait_until(lambda: f"frontend is back (pid {new_pid})" in up.text(), 10, up.text)


def test_worker_that_cannot_start_again_stops_the_stack(tmp_path: Path) -> None:
    stack = Up(tmp_path, "--decode", "1", "--max-restarts", "1", "--restart-window", "600")
    try:
        [worker] = stack.workers().values()
        [frontend] = stack.child_pids("services.frontend")
        host, port = worker["grpc_address"].rsplit(":", 1)
        blocker = socket.socket()  # no SO_REUSEPORT: the restarted worker's bind fails
        blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        os.kill(worker["pid"], signal.SIGKILL)
        wait_until(lambda: _try_bind(blocker, host, int(port)), 10, "the killed worker's port stayed taken")
        blocker.listen()
        assert stack.popen.wait(timeout=300) == 1, stack.text()[-3000:]
        blocker.close()
        log = stack.text()
        assert f"decode-0 (pid {worker['pid']}) was killed by SIGKILL; restarting in 0.5 s" in log
        assert "decode-0 exited with 1; it died 2 times within 600 s (crash loop, limit --max-restarts 1); " \
               "stopping the stack" in log
        with pytest.raises(ProcessLookupError):  # the frontend is gone too
            os.kill(frontend, 0)
    finally:
        stack.close()


def _try_bind(sock: socket.socket, host: str, port: int) -> bool:
    try:
        sock.bind((host, port))
        return True
    except OSError:
        return False
