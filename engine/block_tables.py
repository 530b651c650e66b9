"""Per-request block tables over one BlockPool: how many blocks tokens need, a
request's block ids, rolling a table back to its first tokens, freeing it.
Torch-free.  The common core of the target model's KV cache (kv_cache_manager.py:
prefix caching on top) and a draft model's (spec_decode/draft_cache.py: the
tokens it holds on top)."""

from __future__ import annotations

from engine.block_pool import Block, BlockPool


class BlockTables:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self._blocks: dict[str, list[Block]] = {}  # request id -> its blocks, in token order

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, ())]

    def holds_blocks(self, request_id: str) -> bool:
        return bool(self._blocks.get(request_id))

    def request_ids(self) -> list[str]:
        return list(self._blocks)

    def _trim_blocks(self, request_id: str, num_tokens: int) -> None:
        """Free the tail blocks that hold none of the first num_tokens tokens."""
        blocks = self._blocks.get(request_id)
        keep = self.blocks_needed(num_tokens)
        if blocks and len(blocks) > keep:
            tail = blocks[keep:]
            del blocks[keep:]
            self.pool.free(reversed(tail))  # the tail's last block is the first reused

    def _free_blocks(self, request_id: str) -> None:
        self.pool.free(reversed(self._blocks.pop(request_id, [])))
