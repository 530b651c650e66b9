"""Start real service processes on free loopback ports for tests, and stop them."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKER_FLAGS = ["--dtype", "float32", "--num-threads", "1", "--block-size", "16", "--max-model-len", "1024"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    """`python -m ARGV` with a ready file and a log; `prefix` runs it elsewhere
    (e.g. `ip netns exec HOST`), `env` adds to the environment."""

    def __init__(self, name: str, argv: list[str], tmp: Path, prefix: Sequence[str] = (),
                 env: Mapping[str, str] | None = None) -> None:
        self.name = name
        self.ready = tmp / f"{name}.addr"
        self.log = tmp / f"{name}.log"
        self.ready.unlink(missing_ok=True)  # a restart must not see its predecessor's
        argv = [*prefix, sys.executable, "-m", *argv, "--ready-file", str(self.ready)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(self.log, "wb") as log:  # the child keeps its own copy of the descriptor
            self.popen = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)
        self.address = ""

    def wait_ready(self, timeout: float = 180) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.popen.returncode}):\n{self.tail()}")
            if self.ready.exists():
                self.address = self.ready.read_text().strip()
                return self.address
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} not ready in {timeout} s:\n{self.tail()}")

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
        self.popen.wait(timeout=30)

    def stop(self) -> None:
        terminate(self.popen, 20)


def terminate(popen: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM, then SIGKILL after `timeout` seconds."""
    if popen.poll() is None:
        popen.send_signal(signal.SIGTERM)
        try:
            popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()


def start_worker(role: str, name: str, tmp: Path, *extra: str, prefix: Sequence[str] = (),
                 env: Mapping[str, str] | None = None) -> Proc:
    return Proc(name, [f"services.{role}", "--worker-id", name, *WORKER_FLAGS, *extra], tmp, prefix, env)


def peer_flag(role: str, peers: Iterable[str]) -> list[str]:
    """The flag naming the workers a `role` worker may contact: a decode worker's
    prefill workers, a prefill worker's decode workers (gRPC host:port each)."""
    addresses = ",".join(peers)
    if not addresses:
        return []
    return ["--prefill" if role == "decode" else "--decode", addresses]


def address(port: int) -> str:
    return f"127.0.0.1:{port}"


class FrontendProc:
    """`python -m services.frontend` on free ports; `healthy()` once /health says 200."""

    def __init__(self, tmp: Path, name: str, *args: str, env: Mapping[str, str] | None = None) -> None:
        self.port, self.grpc_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"{name}.log"
        with open(self.log, "wb") as log:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "services.frontend", "--port", str(self.port), "--grpc-port",
                 str(self.grpc_port), "--log-level", "info", *args],
                cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})), stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def health(self) -> int:
        import httpx

        assert self.popen.poll() is None, f"frontend exited ({self.popen.returncode}):\n{self.tail()}"
        try:
            return httpx.get(f"{self.url}/health", timeout=1).status_code
        except httpx.TransportError:
            return 0

    def stop(self) -> None:
        terminate(self.popen, 30)


class UpProc:
    """`splitserve up ARGS` on free REST and gRPC ports, started and waited for
    ("splitserve is up"); `stop()` sends SIGTERM and wants exit status 0."""

    def __init__(self, tmp: Path, *args: str, timeout: float = 300) -> None:
        self.port, self.grpc_port = free_port(), free_port()
        self.url, self.grpc_address = f"http://127.0.0.1:{self.port}", address(self.grpc_port)
        self.log = tmp / "up.log"
        with open(self.log, "wb") as out:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "services.cli", "up", "--port", str(self.port),
                 "--grpc-port", str(self.grpc_port), *args],
                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                start_new_session=True)
        deadline = time.monotonic() + timeout
        while b"splitserve is up" not in self.log.read_bytes():
            assert self.popen.poll() is None, self.tail()
            assert time.monotonic() < deadline, self.tail()
            time.sleep(0.5)

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        self.popen.send_signal(signal.SIGTERM)
        assert self.popen.wait(timeout=60) == 0, self.tail()


class Listener:
    """A TCP socket standing in for an attacker's address: nobody should ever connect."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"

    def connected(self, within: float) -> bool:
        readable, _, _ = select.select([self.sock], [], [], within)
        return bool(readable)

    def close(self) -> None:
        self.sock.close()
