"""Picking a port for a process that binds it later.

The OS hands out ports from its ephemeral range for every outgoing connection
and every bind to port 0.  A port picked there and bound a second later by a
worker can be taken in between (a gRPC client's source port, another
worker's UCX listener); on a busy machine that happened.  So ports are picked
below that range, at random, and checked free.

A pick is also free for another process picking at the same time (two
launchers, two test processes) until its own process binds it, seconds
later.  So each pick is written down for RESERVE_S in a file every process
on the machine reads under a lock, and nobody else picks it meanwhile."""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import tempfile
import time
from collections.abc import Iterator

_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_LOWEST = 10000  # below: the well-known and registered services most machines run
RESERVE_S = 120.0  # long enough for the slowest worker to start and bind its port
RESERVATIONS = os.path.join(tempfile.gettempdir(), f"splitserve-ports-{os.getuid()}")


def ephemeral_range() -> tuple[int, int]:
    """The OS's ephemeral port range (Linux's default where it cannot be read)."""
    try:
        with open(_RANGE_FILE) as f:
            low, high = (int(v) for v in f.read().split())
            return low, high
    except (OSError, ValueError):
        return 32768, 60999


@contextlib.contextmanager
def _reservations() -> Iterator[dict[int, float]]:
    """The machine's recent picks (port -> when), locked; what the block adds
    is written back.  Where the file cannot be used, an empty dict: picks are
    then only checked free."""
    try:
        f = open(RESERVATIONS, "a+")  # noqa: SIM115 - held open across the yield
    except OSError:
        yield {}
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        now = time.time()
        taken: dict[int, float] = {}
        for line in f.read().split():
            port, _, at = line.partition("@")
            with contextlib.suppress(ValueError):
                if now - float(at) < RESERVE_S:
                    taken[int(port)] = float(at)
        yield taken
        f.seek(0)
        f.truncate()
        f.write("".join(f"{port}@{at:.3f}\n" for port, at in taken.items()))


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, outside the OS's ephemeral range where
    there is room (else one the OS picks), and picked by no other process on
    this machine in the last RESERVE_S seconds."""
    low, high = ephemeral_range()
    spans = [(a, b) for a, b in ((_LOWEST, low - 1), (high + 1, 65535)) if b - a >= 1000]
    rng = random.SystemRandom()
    with _reservations() as taken:
        for _ in range(200 if spans else 0):
            a, b = rng.choice(spans)
            port = rng.randint(a, b)
            if port in taken:
                continue
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            taken[port] = time.time()
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
