"""Keep a set of child processes running, the way a process manager would: a
child that dies is started again with the same argv (same ports, so peers
reconnect to the same address) after an exponential back-off; a child that
keeps dying (more than `max_restarts` deaths within `window_s`) is a crash
loop, which stops everything.  Stopping goes in reverse start order."""

from __future__ import annotations

import collections
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 5  # deaths within the window that are restarted; one more is a crash loop
    window_s: float = 60.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    start_timeout_s: float = 300.0  # a restarted child not ready by then is killed (and counts as a death)

    def delay(self, recent_deaths: int) -> float:
        """Back-off before restart number `recent_deaths` (1, 2, ...) in the window:
        it doubles each time, and resets once the child stays up for a window."""
        return min(self.backoff_initial_s * 2 ** max(0, recent_deaths - 1), self.backoff_max_s)


class CrashLoop(RuntimeError):
    pass


@dataclass
class Child:
    name: str
    argv: list[str]
    popen: subprocess.Popen[bytes]
    ready_file: Path | None = None  # the file a worker writes once serving (removed before a restart)
    health_url: str | None = None  # or a URL that answers 200 once serving
    env: dict[str, str] | None = None
    deaths: collections.deque[float] = field(default_factory=collections.deque)
    restart_at: float | None = None  # set while dead and waiting out the back-off
    restarting: bool = False  # restarted and not yet ready
    started_at: float = 0.0
    restarts: int = 0


def _default_log(line: str) -> None:
    print(f"splitserve: {line}", file=sys.stderr, flush=True)


class Supervisor:
    def __init__(self, policy: RestartPolicy, log: Callable[[str], None] = _default_log,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.log = log
        self.clock = clock
        self.children: list[Child] = []
        self.stopping = False

    def spawn(self, name: str, argv: list[str], ready_file: Path | None = None,
              health_url: str | None = None, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        child = Child(name, argv, self._popen(argv, env), ready_file, health_url, env)
        self.children.append(child)
        return child.popen

    @staticmethod
    def _popen(argv: list[str], env: dict[str, str] | None) -> subprocess.Popen[bytes]:
        # New session: a Ctrl-C reaches only us, and we stop the children in order.
        return subprocess.Popen(argv, start_new_session=True, env=env)

    def check(self) -> None:
        """One supervision pass: notice deaths, restart those whose back-off is
        over, log children that came back.  Raises CrashLoop."""
        if self.stopping:
            return
        now = self.clock()
        for c in self.children:
            if c.restart_at is None and c.popen.poll() is not None:
                self._died(c, now)
            elif c.restart_at is not None and now >= c.restart_at:
                c.restart_at = None
                c.restarting = c.ready_file is not None or c.health_url is not None  # to log it back
                c.restarts += 1
                if c.ready_file is not None:
                    c.ready_file.unlink(missing_ok=True)  # its predecessor's
                c.popen, c.started_at = self._popen(c.argv, c.env), now
                self.log(f"{c.name} restarted (pid {c.popen.pid}, restart {c.restarts})")
            elif c.restarting and c.popen.poll() is None and _is_ready(c):
                c.restarting = False
                self.log(f"{c.name} is back (pid {c.popen.pid})")
            elif c.restarting and now - c.started_at > self.policy.start_timeout_s:
                c.restarting = False
                self.log(f"{c.name} (pid {c.popen.pid}) not ready {self.policy.start_timeout_s:.0f} s "
                         f"after its restart; killing it")
                c.popen.kill()  # the next pass counts the death

    def _died(self, c: Child, now: float) -> None:
        while c.deaths and now - c.deaths[0] > self.policy.window_s:
            c.deaths.popleft()
        c.deaths.append(now)
        c.restarting = False
        how = _exit_description(c.popen.returncode)
        if len(c.deaths) > self.policy.max_restarts:
            raise CrashLoop(f"{c.name} {how}; it died {len(c.deaths)} times within "
                            f"{self.policy.window_s:.0f} s (crash loop, limit --max-restarts "
                            f"{self.policy.max_restarts}); stopping the stack")
        delay = self.policy.delay(len(c.deaths))
        c.restart_at = now + delay
        self.log(f"{c.name} (pid {c.popen.pid}) {how}; restarting in {delay:.1f} s "
                 f"({len(c.deaths)} of {self.policy.max_restarts} restarts within "
                 f"{self.policy.window_s:.0f} s)")

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to every running child, latest started first (the frontend
        stops taking requests before the workers drain); SIGKILL after `grace_s`."""
        self.stopping = True
        for c in reversed(self.children):
            if c.popen.poll() is None:
                c.popen.send_signal(signal.SIGTERM)
        deadline = self.clock() + grace_s
        for c in self.children:
            try:
                c.popen.wait(timeout=max(0.1, deadline - self.clock()))
            except subprocess.TimeoutExpired:
                c.popen.kill()
                c.popen.wait()


def _is_ready(c: Child) -> bool:
    if c.ready_file is not None:
        return c.ready_file.exists()
    if c.health_url is not None:
        try:
            with urllib.request.urlopen(c.health_url, timeout=0.5, context=own_tls()) as r:
                return bool(r.status == 200)
        except OSError:
            return False
    return False


def own_tls() -> ssl.SSLContext:
    """For polling our own frontend's /health: its certificate names the public
    host, not the address polled, and may be self-signed."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _exit_description(returncode: int | None) -> str:
    if returncode is not None and returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with {returncode}"
