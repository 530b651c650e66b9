"""Start real service processes on free loopback ports for tests, and stop them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
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
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def start_worker(role: str, name: str, tmp: Path, *extra: str, prefix: Sequence[str] = (),
                 env: Mapping[str, str] | None = None) -> Proc:
    return Proc(name, [f"services.{role}", "--worker-id", name, *WORKER_FLAGS, *extra], tmp, prefix, env)
