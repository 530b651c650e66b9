"""Picking a port for a process that binds it later.

The OS hands out ports from its ephemeral range for every outgoing connection
and every bind to port 0.  A port picked there and bound a second later by a
worker can be taken in between (a gRPC client's source port, another
worker's UCX listener); on a busy machine that happened.  So ports are picked
below that range, at random, and checked free."""

from __future__ import annotations

import random
import socket

_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_LOWEST = 10000  # below: the well-known and registered services most machines run


def ephemeral_range() -> tuple[int, int]:
    """The OS's ephemeral port range (Linux's default where it cannot be read)."""
    try:
        with open(_RANGE_FILE) as f:
            low, high = (int(v) for v in f.read().split())
            return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, outside the OS's ephemeral range where
    there is room (else one the OS picks)."""
    low, high = ephemeral_range()
    spans = [(a, b) for a, b in ((_LOWEST, low - 1), (high + 1, 65535)) if b - a >= 1000]
    rng = random.SystemRandom()
    for _ in range(200 if spans else 0):
        a, b = rng.choice(spans)
        port = rng.randint(a, b)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
