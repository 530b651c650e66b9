"""The prefix-cache events a worker streams to frontends (WatchLoad)."""

from __future__ import annotations

from engine.vocab.cache_events import CacheEvent
from protos import pb


class CacheEventLog:
    """Prefix-cache events in order, on the asyncio loop; each WatchLoad stream
    reads from its own cursor.  Bounded: a stream that falls behind the trimmed
    head gets a fresh snapshot instead."""

    def __init__(self, limit: int = 50_000) -> None:
        self.limit = limit
        self._events: list[CacheEvent] = []
        self._base = 0  # sequence number of _events[0]

    @property
    def end(self) -> int:
        return self._base + len(self._events)

    def append(self, events: list[CacheEvent]) -> None:
        self._events.extend(events)
        if len(self._events) > self.limit:
            drop = len(self._events) - self.limit // 2
            del self._events[:drop]
            self._base += drop

    def since(self, cursor: int) -> list[CacheEvent] | None:
        """Events from `cursor` on; None when they were trimmed away."""
        if cursor < self._base:
            return None
        return self._events[cursor - self._base:]


def cache_events_proto(events: list[CacheEvent]) -> list[pb.CacheEvent]:
    return [pb.CacheEvent(kind=e.kind, block_hashes=e.block_hashes, parent=e.parent or b"")
            for e in events]
