"""Block bookkeeping of a draft model's own paged KV cache.  Torch-free.

Per request it records the token ids whose KV the draft cache holds.  Before
each proposal the draft rolls back to the longest prefix those share with the
request's real tokens (rejected drafts, or anything else that diverged), so
the two caches stay in step without the scheduler knowing about the draft.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.block_tables import BlockTables


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class DraftKVCache(BlockTables):
    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size, enable_caching=False)
        self._tokens: dict[str, list[int]] = {}

    def tokens(self, request_id: str) -> list[int]:
        return self._tokens.get(request_id, [])

    def rollback(self, request_id: str, num_tokens: int) -> None:
        """Keep the KV of the first num_tokens tokens; free blocks left empty."""
        toks = self._tokens.get(request_id)
        if toks is not None:
            del toks[num_tokens:]
        self._trim_blocks(request_id, num_tokens)

    def reserve(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Blocks for num_tokens tokens -> the block table, or None when the
        pool is short (then nothing changes; the request just isn't proposed for)."""
        blocks = self._blocks.setdefault(request_id, [])
        self._tokens.setdefault(request_id, [])
        need = self.blocks_needed(num_tokens) - len(blocks)
        if need > self.pool.num_free_blocks:
            return None
        if need > 0:
            blocks.extend(self.pool.allocate(need))
        return [b.block_id for b in blocks]

    def set_tokens(self, request_id: str, token_ids: list[int]) -> None:
        self._tokens[request_id] = token_ids

    def free(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)
        self._free_blocks(request_id)
