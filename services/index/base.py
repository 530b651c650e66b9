"""The `PrefixIndex` contract, shared by the embedded and the Redis index.

Contract (tests/unit/test_prefix_index.py is its spec):
- A worker's entries count only while its heartbeat is live; a worker that
  never sent a heartbeat, or whose last one is older than its TTL, matches
  nothing.  Its entries are dropped lazily later, or at once by
  `remove_worker` or a "cleared" event.
- `longest_prefix` counts, per worker, the LEADING blocks of the query that the
  worker holds consecutively from block 0; the first missing block ends that
  worker's run.  Workers with a run of 0 are left out.
- A worker that (re)starts calls `remove_worker(own id)` (or applies a
  "cleared" event) before its first "stored", so a restarted worker starts empty.
- Every failure to reach the backing store raises `IndexUnavailable` and
  nothing else; the router then routes by load only.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

from engine.vocab.cache_events import CacheEvent
from engine.vocab.hashing import BlockHash


class IndexUnavailable(Exception):
    """The index cannot answer now (store down, slow, or refusing)."""


class PrefixIndex(abc.ABC):
    @abc.abstractmethod
    def apply(self, worker_id: str, events: Sequence[CacheEvent]) -> None:
        """Apply one engine step's cache events of one worker, in order."""

    @abc.abstractmethod
    def heartbeat(self, worker_id: str, ttl_s: float) -> None:
        """Mark worker_id live for the next ttl_s seconds."""

    @abc.abstractmethod
    def remove_worker(self, worker_id: str) -> None:
        """Forget the worker: its liveness and every entry it reported."""

    @abc.abstractmethod
    def longest_prefix(self, block_hashes: Sequence[BlockHash],
                       worker_ids: Sequence[str] | None = None) -> dict[str, int]:
        """worker id -> leading blocks of block_hashes it holds consecutively,
        over live workers (restricted to worker_ids when given); 0 is omitted."""

    def close(self) -> None:  # noqa: B027 - nothing to release by default
        """Release connections; the index must not be used afterwards."""
