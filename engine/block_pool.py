"""Blocks, reference counts, the hash -> block map and the free queue.

Pure bookkeeping: no torch.  The free queue is LRU-ordered: blocks at the front
are handed out first.  A freed block that holds a cached prefix goes to the back
(evicted last); a freed block with no hash goes to the front (used first, so
cached prefixes survive as long as possible).

Blocks never handed out leave the front in their order (the queue starts as
0, 1, 2, ...; a freed block goes to the front or the back, never between
them): every block below `high_water` was handed out at least once, and the
next new ones are those just above it.  `on_fresh(high_water)` hears each
rise (engine/layers/huge_pages.py's Prefault fills the cache's pages there
before a step writes them).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from engine.vocab.cache_events import CacheEvent
from engine.vocab.hashing import BlockHash


@dataclass(eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # Kept to double-check a hash hit against the actual tokens.
    token_ids: tuple[int, ...] = ()


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, Block] = {}
        self._events: list[CacheEvent] = []
        self.high_water = 0  # blocks [0, high_water) were handed out at least once
        self.on_fresh: Callable[[int], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def free_block_ids(self) -> list[int]:
        """Free queue order, front (next handed out) first."""
        return list(self._free)

    def allocate(self, n: int) -> list[Block]:
        if n > len(self._free):
            raise RuntimeError(f"allocate: asked for {n} blocks, {len(self._free)} free")
        out = []
        high = self.high_water
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
            high = max(high, block_id + 1)
        if high > self.high_water:
            self.high_water = high
            if self.on_fresh is not None:
                self.on_fresh(high)
        return out

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> Block | None:
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on cache hits (pulling them off the free queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference each; pass a request's blocks tail first so its
        last blocks are evicted before its first ones."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def cache_blocks(self, blocks: Sequence[Block], hashes: Sequence[BlockHash],
                     token_ids: Sequence[Sequence[int]], parent: BlockHash | None) -> None:
        """Register newly full blocks under their hashes.  A hash that another
        block already holds stays with that block; this one stays uncached."""
        if not self.enable_caching:
            return
        stored = []
        for block, h, toks in zip(blocks, hashes, token_ids, strict=True):
            if block.block_hash is not None or h in self._cached:
                continue
            block.block_hash = h
            block.token_ids = tuple(toks)
            self._cached[h] = block
            stored.append(h)
        if stored:
            self._events.append(CacheEvent("stored", stored, parent))

    def _evict(self, block: Block) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
            self._events.append(CacheEvent("removed", [block.block_hash]))
        block.block_hash = None
        block.token_ids = ()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self._cached.values():
            block.block_hash = None
            block.token_ids = ()
        self._cached.clear()
        self._events.append(CacheEvent("cleared"))
        return True

    def cached_hashes(self) -> list[BlockHash]:
        return list(self._cached)

    def take_events(self) -> list[CacheEvent]:
        events, self._events = self._events, []
        return events
