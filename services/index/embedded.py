"""In-process prefix index: the default of `splitserve up` without --redis-url.

Thread-safe (one lock): workers report from their own threads while the
router looks up from the event loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from engine.vocab.cache_events import CacheEvent
from engine.vocab.hashing import BlockHash
from services.index.base import PrefixIndex


class EmbeddedPrefixIndex(PrefixIndex):
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._holders: dict[BlockHash, set[str]] = {}  # block hash -> workers holding it
        self._held: dict[str, set[BlockHash]] = {}  # worker -> hashes it holds
        self._deadline: dict[str, float] = {}  # worker -> monotonic time its heartbeat lapses

    def apply(self, worker_id: str, events: Sequence[CacheEvent]) -> None:
        with self._lock:
            for event in events:
                if event.kind == "stored":
                    held = self._held.setdefault(worker_id, set())
                    for h in event.block_hashes:
                        self._holders.setdefault(h, set()).add(worker_id)
                        held.add(h)
                elif event.kind == "removed":
                    held = self._held.get(worker_id, set())
                    for h in event.block_hashes:
                        held.discard(h)
                        self._drop_holder(h, worker_id)
                elif event.kind == "cleared":
                    self._drop_entries(worker_id)
                else:
                    raise ValueError(f"CacheEvent.kind: unknown {event.kind!r}")

    def heartbeat(self, worker_id: str, ttl_s: float) -> None:
        with self._lock:
            now = self._clock()
            self._deadline[worker_id] = now + ttl_s
            # Lazy cleanup: entries of workers whose heartbeat lapsed.
            for dead in [w for w, t in self._deadline.items() if t <= now]:
                del self._deadline[dead]
                self._drop_entries(dead)

    def remove_worker(self, worker_id: str) -> None:
        with self._lock:
            self._deadline.pop(worker_id, None)
            self._drop_entries(worker_id)

    def longest_prefix(self, block_hashes: Sequence[BlockHash],
                       worker_ids: Sequence[str] | None = None) -> dict[str, int]:
        if not block_hashes:
            return {}
        with self._lock:
            now = self._clock()
            running = {w for w in self._holders.get(block_hashes[0], ())
                       if self._deadline.get(w, now) > now}
            if worker_ids is not None:
                running &= set(worker_ids)
            counts = dict.fromkeys(running, 1)
            # Each worker's run ends at its first missing block; stop when none run.
            for h in block_hashes[1:]:
                running &= self._holders.get(h, set())
                if not running:
                    break
                for w in running:
                    counts[w] += 1
            return counts

    def _drop_holder(self, block_hash: BlockHash, worker_id: str) -> None:
        holders = self._holders.get(block_hash)
        if holders is not None:
            holders.discard(worker_id)
            if not holders:
                del self._holders[block_hash]

    def _drop_entries(self, worker_id: str) -> None:
        for h in self._held.pop(worker_id, set()):
            self._drop_holder(h, worker_id)
