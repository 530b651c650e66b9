"""Start real service processes on free loopback ports for tests, and stop them."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import grpc

from protos import pb, pb_grpc
from services.ports import free_port
from tests.integration import forkserver

ROOT = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"
T = TypeVar("T")
WORKER_FLAGS = ["--dtype", "float32", "--num-threads", "1", "--block-size", "16", "--max-model-len", "1024"]


class Proc:
    """`python -m ARGV` with a ready file and a log; `prefix` runs it elsewhere
    (e.g. `ip netns exec HOST`), `env` adds to the environment."""

    def __init__(self, name: str, argv: list[str], tmp: Path, prefix: Sequence[str] = (),
                 env: Mapping[str, str] | None = None) -> None:
        self.name = name
        self.ready = tmp / f"{name}.addr"
        self.log = tmp / f"{name}.log"
        self.ready.unlink(missing_ok=True)  # a restart must not see its predecessor's
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(self.log, "wb") as log:  # the child keeps its own copy of the descriptor
            self.popen = forkserver.popen(argv[0], [*argv[1:], "--ready-file", str(self.ready)], env=env,
                                          stdout=log.fileno(), prefix=prefix)
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


def stop_all(procs: Iterable[Proc]) -> None:
    """Stop several workers at once: SIGTERM to all, then wait for each (their
    shutdowns overlap instead of adding up)."""
    procs = list(procs)
    for p in procs:
        if p.popen.poll() is None:
            p.popen.send_signal(signal.SIGTERM)
    for p in procs:
        p.stop()


def terminate(popen: subprocess.Popen[bytes] | forkserver.Forked, timeout: float) -> None:
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


def start_peers(tmp: Path, workers: Mapping[str, Sequence[str]],
                env: Mapping[str, Mapping[str, str]] | None = None,
                ports: Mapping[str, int] | None = None) -> dict[str, Proc]:
    """Start workers (name -> extra flags; names starting with "p" are prefill
    workers, the rest decode workers) on ports chosen first, so each knows
    every worker of the other role from its flags.  `env`: per name; `ports`:
    fixed ones (a restart on the same address).  Waits until all are ready;
    stops them all if one fails to start."""
    ports = {name: (ports or {}).get(name) or free_port() for name in workers}
    procs: dict[str, Proc] = {}
    try:
        for name, extra in workers.items():
            role = "prefill" if name.startswith("p") else "decode"
            peers = [address(ports[n]) for n in workers if n.startswith("p") != (role == "prefill")]
            procs[name] = start_worker(role, name, tmp, "--grpc-port", str(ports[name]), *extra,
                                       *peer_flag(role, peers), env=(env or {}).get(name))
        for proc in procs.values():
            proc.wait_ready()
    except BaseException:
        for proc in procs.values():
            proc.stop()
        raise
    return procs


def start_pair(tmp: Path, prefill_flags: Sequence[str] = (),
               decode_flags: Sequence[str] = ()) -> tuple[Proc, Proc]:
    """One prefill worker p0 and one decode worker d0 that know each other; ready."""
    procs = start_peers(tmp, {"p0": prefill_flags, "d0": decode_flags})
    return procs["p0"], procs["d0"]



def wait_until(cond: Callable[[], T], timeout: float, what: str | Callable[[], str] = "condition not reached",
               still: Callable[[], bool] = lambda: True) -> T:
    """Poll `cond` every 50 ms until it returns something true, and return that.
    Fails with `what` once `timeout` seconds pass, or at once when `still()` is
    false (the process the caller waits on has died)."""
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        assert still() and time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(0.05)
    return value

def wait_for_file(path: Path, timeout: float, proc: Proc | None = None) -> str:
    """The contents of `path` once it exists (a fault hook's signal)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc is not None and proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}):\n{proc.tail()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path.name} never appeared in {timeout} s"
                                 + (f":\n{proc.tail()}" if proc is not None else ""))
        time.sleep(0.02)
    return path.read_text()


class FrontendProc:
    """`python -m services.frontend` on free ports; `healthy()` once /health says 200."""

    def __init__(self, tmp: Path, name: str, *args: str, env: Mapping[str, str] | None = None,
                 ports: tuple[int, int] | None = None) -> None:
        """ports: (HTTP, gRPC), e.g. a predecessor's; free ones by default."""
        self.port, self.grpc_port = ports or (free_port(), free_port())
        self.grpc_address = f"127.0.0.1:{self.grpc_port}"
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"{name}.log"
        with open(self.log, "wb") as log:
            self.popen = forkserver.popen(
                "services.frontend", ["--port", str(self.port), "--grpc-port", str(self.grpc_port),
                                      "--log-level", "info", *args],
                env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})), stdout=log.fileno())

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


class Stream(threading.Thread):
    """One streamed completion through a frontend's gRPC Generate: `start()`
    it in a thread, or `complete()` it here.  Collects token ids, text and
    arrival times as they come; a failure is kept in `error`, not raised.
    prompt: text or token ids; sampling: greedy, max_tokens, ignore_eos unless given."""

    def __init__(self, grpc_address: str, prompt: str | Sequence[int], max_tokens: int = 40, *,
                 sampling: pb.SamplingParams | None = None, timeout: float = 180) -> None:
        super().__init__(daemon=True)
        self.address, self.prompt, self.max_tokens, self.timeout = grpc_address, prompt, max_tokens, timeout
        self.sampling = sampling or pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        self.tokens: list[int] = []
        self.text = ""
        self.arrivals: list[float] = []  # monotonic time of each message
        self.finish_reason = ""
        self.error: BaseException | None = None

    def run(self) -> None:
        if isinstance(self.prompt, str):
            req = pb.GenerateRequest(model=MODEL, text=self.prompt, sampling=self.sampling)
        else:
            req = pb.GenerateRequest(model=MODEL, token_ids=pb.TokenIds(ids=list(self.prompt)),
                                     sampling=self.sampling)
        try:
            with grpc.insecure_channel(self.address) as ch:
                for r in pb_grpc.FrontendStub(ch).Generate(req, timeout=self.timeout):
                    self.tokens.extend(r.token_ids)
                    self.text += r.text
                    self.arrivals.append(time.monotonic())
                    self.finish_reason = r.finish_reason or self.finish_reason
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def result(self) -> list[int]:
        """The tokens of a started stream, once it has finished well."""
        self.join(self.timeout)
        return self._checked()

    def complete(self) -> list[int]:
        """Run here, not in a thread, to the end."""
        self.run()
        return self._checked()

    def _checked(self) -> list[int]:
        assert self.error is None and self.finish_reason == "length", (self.error, self.finish_reason)
        return self.tokens


def start_all(streams: Iterable[Stream]) -> list[Stream]:
    started = list(streams)
    for s in started:
        s.start()
    return started


def thread_policies(pid: int) -> dict[int, tuple[str, int]]:
    """TID -> (name, scheduling policy) of every thread of process `pid`."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                out[int(tid)] = (f.read().strip(), os.sched_getscheduler(int(tid)))
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            pass
    return out
