"""Start the tests' service processes fast: each is forked from a process that
has already imported torch and the other heavy libraries, instead of a fresh
`python -m` importing them again (on 2 cores about 3 of a worker's 5 s of
start-up, paid some 80 times a suite run).

The child then runs its module as `python -m MODULE ARGS` would: a new
session, its own stdout/stderr, environment and working directory,
`runpy.run_module(..., "__main__")`, and the interpreter's normal exit (its
threads joined, its atexit handlers run).  What a fresh interpreter fixes at
start-up or when the preloaded libraries are imported (OpenMP's wait policy,
PYTHON*, LD_*, UCX_*, HF_* ...) must come out as this process's did: the same
values, or none where the preload only filled in a default (OpenMP's wait
policy, the UCX settings), as a fresh worker would.  A spawn whose environment
differs there returns None and the caller starts it the usual way.

Parent side: `spawn()` returns a `Forked`, which answers the part of
subprocess.Popen the tests use (pid, returncode, poll, wait, send_signal,
kill, terminate).  The server reaps its children and reports each exit status.
"""

from __future__ import annotations

import array
import atexit
import contextlib
import gc
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# engine first: its OpenMP setting must come before torch loads OpenMP, as in a worker.
PRELOAD = ("engine", "torch", "numpy", "grpc", "google.protobuf", "prometheus_client", "redis", "ucxx",
           "opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
           "transformers", "tokenizers")
# Read once at start-up or at a preloaded import: a spawn must agree on these.
FIXED_PREFIXES = ("OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "TORCH", "PYTORCH", "PYTHON", "LD_", "CUDA",
                  "MALLOC", "UCX", "HF_", "TRANSFORMERS", "TOKENIZERS", "GRPC_", "OTEL_", "PROMETHEUS")
# ... but these are read when a module the preload leaves out is imported, so a child reads its own
# (torch's inductor sets its cache directory in os.environ the first time it compiles, in the test process).
LAZY_PREFIXES = ("TORCHINDUCTOR_",)
MAX_MESSAGE = 1 << 20


def fixed(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(FIXED_PREFIXES) and not k.startswith(LAZY_PREFIXES)}


def differing(env: Mapping[str, str], before: Mapping[str, str], after: Mapping[str, str]) -> list[str]:
    """The fixed settings where a fresh process started with `env` would not
    end up as a server started with `before` did after its preload (`after`):
    the preload only fills in defaults, so a key it added may be absent or the same."""
    filled = {k: v for k, v in after.items() if k not in before}
    mine = fixed(env)
    return sorted(k for k in {*mine, *after} if mine.get(k, filled.get(k)) != after.get(k))


def send(sock: socket.socket, message: dict[str, object], fds: Sequence[int] = ()) -> None:
    data = json.dumps(message).encode()
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sock.sendmsg([data], ancillary)


def receive(sock: socket.socket, max_fds: int = 0) -> tuple[dict[str, object] | None, list[int]]:
    """A message and the descriptors sent with it; (None, []) once the peer is gone."""
    fds = array.array("i")
    space = socket.CMSG_SPACE(max_fds * fds.itemsize) if max_fds else 0
    data, ancillary, _, _ = sock.recvmsg(MAX_MESSAGE, space)
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    return (json.loads(data) if data else None), list(fds)


class Forked:
    """A process the server forked: the subset of subprocess.Popen the tests use."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid, self.args = pid, args
        self.returncode: int | None = None
        self._exited = threading.Event()

    def _set_exit(self, code: int) -> None:
        self.returncode = code
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # exited; its status is on its way
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Client:
    """One server per test process, started at first use and kept till its end."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        argv = [sys.executable, "-m", "tests.integration.forkserver", str(theirs.fileno())]
        self.server = subprocess.Popen(argv, cwd=ROOT, env=self.env, pass_fds=[theirs.fileno()],
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        theirs.close()
        self.sock = ours
        self.lock = threading.Lock()  # one spawn at a time: its reply is the next "pid" message
        self.replies: list[dict[str, object]] = []
        self.reply = threading.Condition()
        self.children: dict[int, Forked] = {}
        self.early: dict[int, int] = {}  # exits reported before spawn() saw the pid
        self.alive = True
        self.after: dict[str, str] | None = None  # the server's fixed settings once it has preloaded
        threading.Thread(target=self._read, name="forkserver-reader", daemon=True).start()
        atexit.register(self.close)

    def _read(self) -> None:
        while True:
            try:
                message, _ = receive(self.sock)
            except OSError:
                message = None
            if message is None:
                break
            if "preloaded" in message:
                with self.reply:
                    self.after = dict(message["preloaded"])  # type: ignore[call-overload]
                    self.reply.notify_all()
            elif "exit" in message:
                pid, code = int(message["exit"]), int(message["code"])  # type: ignore[call-overload]
                with self.reply:
                    child = self.children.pop(pid, None)
                    if child is None:
                        self.early[pid] = code
                if child is not None:
                    child._set_exit(code)
            else:
                with self.reply:
                    self.replies.append(message)
                    self.reply.notify_all()
        with self.reply:  # the server is gone: nothing more will be reported
            self.alive = False
            self.reply.notify_all()
            orphans = list(self.children.values())
            self.children.clear()
        for child in orphans:
            child._set_exit(-signal.SIGKILL if _gone(child.pid) else 255)

    def spawn(self, module: str, args: Sequence[str], *, env: Mapping[str, str], cwd: Path, stdout: int,
              stderr: int) -> Forked | None:
        """`python -m module args` in a new session, or None where it must start the usual way."""
        with self.lock:
            with self.reply:
                self.reply.wait_for(lambda: self.after is not None or not self.alive, timeout=120)
                if not self.alive or self.after is None:
                    return None
                keys = differing(env, fixed(self.env), self.after)
                if keys:
                    # Slower, still correct; the warnings summary names what made the spawns start fresh.
                    warnings.warn(f"forkserver: {module} starts fresh: {', '.join(keys)} differ from the "
                                  "server's", stacklevel=3)
                    return None
            try:
                send(self.sock, {"module": module, "args": list(args), "env": dict(env), "cwd": str(cwd)},
                     [stdout, stderr])
            except OSError:
                return None
            with self.reply:
                self.reply.wait_for(lambda: self.replies or not self.alive, timeout=60)
                if not self.replies:
                    return None
                message = self.replies.pop(0)
                if "pid" not in message:
                    raise RuntimeError(f"forkserver: {message.get('error')}")
                child = Forked(int(message["pid"]), [module, *args])  # type: ignore[call-overload]
                code = self.early.pop(child.pid, None)
                if code is None:
                    self.children[child.pid] = child
            if code is not None:
                child._set_exit(code)
            return child

    def close(self) -> None:
        self.sock.close()  # the server sees its end and exits; its children live on, as Popen's would
        try:
            self.server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.server.kill()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


_client: Client | None = None
_client_lock = threading.Lock()


def client() -> Client:
    global _client
    with _client_lock:
        if _client is None or not _client.alive:
            _client = Client()
        return _client


def popen(module: str, args: Sequence[str], *, env: Mapping[str, str], stdout: int,
          prefix: Sequence[str] = ()) -> subprocess.Popen[bytes] | Forked:
    """`python -m module args` from ROOT in a new session, stdout and stderr to
    `stdout`: forked from the server where it can be, else started the usual way
    (a `prefix` such as `ip netns exec HOST`, or an environment the server cannot match)."""
    if not prefix and not os.environ.get("SPLITSERVE_TEST_NO_FORKSERVER"):
        child = client().spawn(module, args, env=env, cwd=ROOT, stdout=stdout, stderr=stdout)
        if child is not None:
            return child
    return subprocess.Popen([*prefix, sys.executable, "-m", module, *args], cwd=ROOT, env=dict(env),
                            stdout=stdout, stderr=subprocess.STDOUT, start_new_session=True)


# The server --------------------------------------------------------------------------------------


def serve(sock: socket.socket) -> tuple[dict[str, object], list[int]] | None:
    """Preload, then fork a child per request.  Returns in a child (its request
    and descriptors); returns None in the server once the client has gone."""
    from kvtransfer.ucx_env import apply_ucx_env_defaults

    apply_ucx_env_defaults()  # before UCX loads, which reads some at once, as a worker does
    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    # The preloaded objects out of the collector's reach: a child's full collection
    # would otherwise walk them all (about 0.2 s on 2 cores, a stall a fresh frontend,
    # which never imports torch, does not have).
    gc.freeze()
    send(sock, {"preloaded": fixed(os.environ)})
    while True:
        readable, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in readable:
            os.read(wake_r, 4096)
            while True:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})
        if sock in readable:
            request, fds = receive(sock, max_fds=2)
            if request is None:
                return None
            try:
                pid = os.fork()
            except OSError as e:
                send(sock, {"error": str(e)})
                continue
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (wake_r, wake_w):
                    os.close(fd)
                sock.close()
                return request, fds
            for fd in fds:
                os.close(fd)
            send(sock, {"pid": pid})


def become(request: dict[str, object], fds: list[int]) -> str:
    """In the child: take on the request's session, descriptors, directory and
    environment; returns the module to run."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in (null, *fds):
        os.close(fd)
    os.chdir(str(request["cwd"]))
    env = {k: v for k, v in dict(request["env"]).items() if k not in fixed(os.environ)}  # type: ignore[call-overload]
    env.update(fixed(os.environ))  # as the preloaded imports left them (e.g. OMP_WAIT_POLICY)
    os.environ.clear()
    os.environ.update(env)
    module = str(request["module"])
    sys.argv = [module, *list(request["args"])]  # type: ignore[call-overload]
    return module


if __name__ == "__main__":
    started = serve(socket.socket(fileno=int(sys.argv[1])))
    if started is None:
        sys.exit(0)
    import runpy

    runpy.run_module(become(*started), run_name="__main__", alter_sys=True)
