import pytest

from engine.block_pool import BlockPool
from engine.vocab.hashing import hash_blocks


def test_allocate_takes_from_front_and_counts() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    assert [b.block_id for b in a] == [0, 1]
    assert [b.ref_cnt for b in a] == [1, 1]
    assert pool.num_free_blocks == 2
    with pytest.raises(RuntimeError):
        pool.allocate(3)
    pool.free(reversed(a))
    # uncached blocks go to the front, tail-first freeing keeps order 0, 1
    assert pool.free_block_ids() == [0, 1, 2, 3]


def test_cached_blocks_evicted_lru_last() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    hashes = hash_blocks(list(range(6)), 2, b"")
    toks = [[0, 1], [2, 3], [4, 5]]
    pool.cache_blocks(blocks[:2], hashes[:2], toks[:2], parent=None)
    pool.free(reversed(blocks))
    # block 2 (no hash) first, then the untouched block 3, then cached tail-first: 1, 0
    assert pool.free_block_ids() == [2, 3, 1, 0]
    assert pool.lookup(hashes[0], [0, 1]) is blocks[0]
    assert pool.lookup(hashes[0], [0, 9]) is None  # hit double-checked against tokens
    got = pool.allocate(3)
    assert [b.block_id for b in got] == [2, 3, 1]
    assert pool.lookup(hashes[1], [2, 3]) is None  # block 1 was evicted
    events = pool.take_events()
    assert [e.kind for e in events] == ["stored", "removed"]
    assert events[1].block_hashes == [hashes[1]]


def test_touch_and_ref_counts() -> None:
    pool = BlockPool(3)
    b = pool.allocate(1)
    h = hash_blocks([7, 7], 2, b"")
    pool.cache_blocks(b, h, [[7, 7]], parent=None)
    pool.free(b)
    assert pool.num_free_blocks == 3
    hit = pool.lookup(h[0], [7, 7])
    pool.touch([hit, hit])
    assert hit.ref_cnt == 2 and pool.num_free_blocks == 2
    pool.free([hit])
    assert pool.num_free_blocks == 2
    pool.free([hit])
    assert pool.num_free_blocks == 3
    with pytest.raises(AssertionError):
        pool.free([hit])


def test_duplicate_hash_stays_with_first_block() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    h = hash_blocks([1, 1], 2, b"")
    pool.cache_blocks([a], h, [[1, 1]], parent=None)
    pool.cache_blocks([b], h, [[1, 1]], parent=None)
    assert b.block_hash is None and pool.lookup(h[0], [1, 1]) is a


def test_reset_prefix_cache() -> None:
    pool = BlockPool(2)
    a = pool.allocate(1)
    pool.cache_blocks(a, hash_blocks([1, 1], 2, b""), [[1, 1]], parent=None)
    assert not pool.reset_prefix_cache()
    pool.free(a)
    assert pool.reset_prefix_cache() and pool.num_cached_blocks == 0


def test_new_blocks_leave_in_order_and_on_fresh_hears_each_rise() -> None:
    """Whatever was freed and where it went (front: no hash, back: cached),
    the blocks never handed out leave the queue in their order: high_water
    is the edge of what was ever handed out (huge_pages.Prefault fills the
    cache's pages past it)."""
    pool = BlockPool(8)
    heard: list[int] = []
    pool.on_fresh = heard.append
    a = pool.allocate(3)
    assert pool.high_water == 3 and heard == [3]
    pool.cache_blocks(a[:1], hash_blocks([0, 1], 2, b""), [[0, 1]], parent=None)
    pool.free(reversed(a))  # 1 and 2 to the front, cached 0 to the back
    assert [b.block_id for b in pool.allocate(2)] == [1, 2]  # reused: no rise
    assert pool.high_water == 3 and heard == [3]
    assert [b.block_id for b in pool.allocate(4)] == [3, 4, 5, 6]
    assert pool.high_water == 7 and heard == [3, 7]
    assert [b.block_id for b in pool.allocate(2)] == [7, 0]  # the last new one, then the cached one
    assert pool.high_water == 8 and heard == [3, 7, 8]
