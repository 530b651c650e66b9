"""Transfer counters; the services turn them into Prometheus metrics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Direction = Literal["send", "recv"]
Outcome = Literal["ok", "failed", "timed_out", "rejected", "cancelled"]


@dataclass(frozen=True)
class TransferRecord:
    """One finished transfer, as handed to KVTransport's `on_transfer` callback."""

    direction: Direction
    transfer_id: str
    outcome: Outcome
    nbytes: int  # payload bytes; 0 unless the outcome is "ok"
    seconds: float  # send: call to return; recv: header arrival (or expect) to the end


@dataclass
class DirectionStats:
    bytes: int = 0  # payload of completed transfers
    ok: int = 0
    failed: int = 0
    timed_out: int = 0
    rejected: int = 0
    cancelled: int = 0
    layout_mismatches: int = 0  # connections refused at the handshake
    bad_tokens: int = 0  # headers of an expected transfer refused for a missing or wrong token
    off_host_connections: int = 0  # connections refused for arriving off the listen host
    seconds_total: float = 0.0  # summed over completed transfers
    last_seconds: float = 0.0

    def record(self, rec: TransferRecord) -> None:
        setattr(self, rec.outcome, getattr(self, rec.outcome) + 1)
        if rec.outcome == "ok":
            self.bytes += rec.nbytes
            self.seconds_total += rec.seconds
            self.last_seconds = rec.seconds


@dataclass
class TransportStats:
    sent: DirectionStats
    received: DirectionStats
