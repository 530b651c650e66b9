"""Ports picked for processes that bind them later stay out of the OS's
ephemeral range, where an outgoing connection could take them first."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from services import ports

ROOT = Path(__file__).resolve().parents[2]


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


def test_two_processes_picking_at_once_never_pick_the_same_port(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A narrow range (1,001 ports) and no binds: without the shared record
    of picks, 500 picks here and 400 in another process would overlap."""
    record = str(tmp_path / "picks")
    narrow = "lambda: (11001, 65000)"  # leaves 10000-11000 (the span above is too small to use)
    child = subprocess.run(
        [sys.executable, "-c", f"from services import ports\nports.RESERVATIONS = {record!r}\n"
                               f"ports.ephemeral_range = {narrow}\n"
                               "print(*(ports.free_port() for _ in range(500)))"],
        capture_output=True, text=True, check=True, cwd=ROOT)
    theirs = {int(p) for p in child.stdout.split()}
    monkeypatch.setattr(ports, "RESERVATIONS", record)
    monkeypatch.setattr(ports, "ephemeral_range", eval(narrow))
    mine = [ports.free_port() for _ in range(400)]
    assert len(theirs) == 500 and len(set(mine)) == 400
    assert all(10000 <= p <= 11000 for p in theirs | set(mine))
    assert not theirs & set(mine)
