"""Ports picked for processes that bind them later stay out of the OS's
ephemeral range, where an outgoing connection could take them first."""

from __future__ import annotations

import socket

from services import ports


def test_picks_are_bindable_and_outside_the_ephemeral_range() -> None:
    low, high = ports.ephemeral_range()
    assert 0 < low <= high <= 65535
    picked = {ports.free_port() for _ in range(50)}
    assert len(picked) > 40  # random, not one port over and over
    for port in picked:
        assert not low <= port <= high, (port, low, high)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_picked() -> None:
    held = []
    try:
        for _ in range(20):
            s = socket.socket()
            port = ports.free_port()
            s.bind(("127.0.0.1", port))  # free when picked
            held.append(s)
        in_use = {s.getsockname()[1] for s in held}
        assert not {ports.free_port() for _ in range(200)} & in_use
    finally:
        for s in held:
            s.close()
