"""The PrefixIndex contract, run here on the embedded index and, by
tests/integration/test_prefix_index_redis.py, on a real Redis."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from engine.vocab.cache_events import CacheEvent
from engine.vocab.hashing import extra_keys, hash_blocks
from services.index import EmbeddedPrefixIndex, PrefixIndex

TTL_S = 30.0
SHORT_TTL_S = 0.05

# 4 chained blocks of one prompt, and 2 blocks of an unrelated prompt.
H = hash_blocks(list(range(64)), 16, extra_keys("test-model"))
OTHER = hash_blocks(list(range(100, 132)), 16, extra_keys("test-model"))


def stored(*hashes: bytes) -> CacheEvent:
    return CacheEvent("stored", list(hashes))


def removed(*hashes: bytes) -> CacheEvent:
    return CacheEvent("removed", list(hashes))


class PrefixIndexContract:
    """Subclasses provide an `index` fixture: empty, and with any lazy sweep of
    dead workers running on every heartbeat."""

    @pytest.fixture
    def index(self) -> Iterator[PrefixIndex]:
        raise NotImplementedError

    def live(self, index: PrefixIndex, *workers: str, ttl_s: float = TTL_S) -> None:
        for w in workers:
            index.heartbeat(w, ttl_s)

    def test_empty(self, index: PrefixIndex) -> None:
        assert index.longest_prefix(H) == {}
        assert index.longest_prefix([]) == {}

    def test_stored_counts_leading_blocks(self, index: PrefixIndex) -> None:
        self.live(index, "p0")
        index.apply("p0", [stored(H[0], H[1]), stored(H[2], H[3])])
        assert index.longest_prefix(H) == {"p0": 4}
        assert index.longest_prefix(H[:2]) == {"p0": 2}
        assert index.longest_prefix(H + [OTHER[1]]) == {"p0": 4}

    def test_a_gap_ends_the_run(self, index: PrefixIndex) -> None:
        self.live(index, "p0", "p1")
        index.apply("p0", [stored(H[0], H[1], H[3])])
        index.apply("p1", [stored(H[1], H[2], H[3])])  # no block 0: matches nothing
        assert index.longest_prefix(H) == {"p0": 2}

    def test_several_workers(self, index: PrefixIndex) -> None:
        self.live(index, "p0", "p1", "d0")
        index.apply("p0", [stored(*H)])
        index.apply("p1", [stored(H[0], H[1])])
        index.apply("d0", [stored(OTHER[0], OTHER[1])])
        assert index.longest_prefix(H) == {"p0": 4, "p1": 2}
        assert index.longest_prefix(OTHER) == {"d0": 2}

    def test_shared_first_block(self, index: PrefixIndex) -> None:
        shared = hash_blocks(list(range(16)) + [7] * 16, 16, extra_keys("test-model"))
        assert shared[0] == H[0] and shared[1] != H[1]
        self.live(index, "p0")
        index.apply("p0", [stored(*H)])
        assert index.longest_prefix(shared) == {"p0": 1}

    def test_worker_filter(self, index: PrefixIndex) -> None:
        self.live(index, "p0", "p1")
        index.apply("p0", [stored(*H)])
        index.apply("p1", [stored(*H[:3])])
        assert index.longest_prefix(H, ["p1"]) == {"p1": 3}
        assert index.longest_prefix(H, ["p1", "nobody"]) == {"p1": 3}
        assert index.longest_prefix(H, []) == {}

    def test_removed(self, index: PrefixIndex) -> None:
        self.live(index, "p0", "p1")
        index.apply("p0", [stored(*H)])
        index.apply("p1", [stored(*H)])
        index.apply("p0", [removed(H[2])])
        assert index.longest_prefix(H) == {"p0": 2, "p1": 4}
        index.apply("p0", [removed(H[0]), removed(H[0])])  # removing twice is harmless
        assert index.longest_prefix(H) == {"p1": 4}

    def test_events_apply_in_order(self, index: PrefixIndex) -> None:
        self.live(index, "p0")
        index.apply("p0", [stored(*H), removed(H[1]), stored(H[1])])
        assert index.longest_prefix(H) == {"p0": 4}
        index.apply("p0", [stored(H[0]), CacheEvent("cleared"), stored(H[0], H[1])])
        assert index.longest_prefix(H) == {"p0": 2}

    def test_cleared(self, index: PrefixIndex) -> None:
        self.live(index, "p0", "p1")
        index.apply("p0", [stored(*H)])
        index.apply("p1", [stored(*H[:2])])
        index.apply("p0", [CacheEvent("cleared")])
        assert index.longest_prefix(H) == {"p1": 2}
        index.apply("p0", [stored(H[0])])
        assert index.longest_prefix(H) == {"p0": 1, "p1": 2}

    def test_unknown_event_kind(self, index: PrefixIndex) -> None:
        with pytest.raises(ValueError, match="unknown"):
            index.apply("p0", [CacheEvent("evicted", [H[0]])])

    def test_no_heartbeat_no_match(self, index: PrefixIndex) -> None:
        index.apply("p0", [stored(*H)])
        assert index.longest_prefix(H) == {}
        self.live(index, "p0")
        assert index.longest_prefix(H) == {"p0": 4}

    def test_heartbeat_expiry(self, index: PrefixIndex) -> None:
        self.live(index, "p0")
        self.live(index, "p1", ttl_s=SHORT_TTL_S)
        index.apply("p0", [stored(*H[:2])])
        index.apply("p1", [stored(*H)])
        assert index.longest_prefix(H) == {"p0": 2, "p1": 4}
        time.sleep(SHORT_TTL_S * 2)
        assert index.longest_prefix(H) == {"p0": 2}  # stops counting at once, before any sweep

    def test_dead_worker_entries_are_swept(self, index: PrefixIndex) -> None:
        self.live(index, "p1", ttl_s=SHORT_TTL_S)
        index.apply("p1", [stored(*H)])
        time.sleep(SHORT_TTL_S * 2)
        self.live(index, "p0")  # any live worker's heartbeat sweeps the dead
        self.live(index, "p1")  # back, but its old entries are gone
        assert index.longest_prefix(H) == {}

    def test_remove_worker(self, index: PrefixIndex) -> None:
        self.live(index, "p0", "p1")
        index.apply("p0", [stored(*H)])
        index.apply("p1", [stored(*H[:1])])
        index.remove_worker("p0")
        index.remove_worker("never-seen")
        assert index.longest_prefix(H) == {"p1": 1}
        self.live(index, "p0")  # a restarted worker starts empty
        assert index.longest_prefix(H) == {"p1": 1}


class TestEmbeddedPrefixIndex(PrefixIndexContract):
    @pytest.fixture
    def index(self) -> Iterator[PrefixIndex]:
        idx = EmbeddedPrefixIndex()
        yield idx
        idx.close()

    def test_expiry_by_injected_clock(self) -> None:
        now = [100.0]
        idx = EmbeddedPrefixIndex(clock=lambda: now[0])
        idx.heartbeat("p0", 1.0)
        idx.apply("p0", [stored(*H)])
        now[0] = 100.999
        assert idx.longest_prefix(H) == {"p0": 4}
        now[0] = 101.0
        assert idx.longest_prefix(H) == {}
