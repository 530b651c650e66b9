"""Maps requests to blocks: prefix-cache lookup, slot allocation, freeing.  Torch-free."""

from __future__ import annotations

from collections.abc import Sequence

from engine.block_pool import Block
from engine.block_tables import BlockTables
from engine.request import Request
from engine.vocab.cache_events import CacheEvent


class KVCacheManager(BlockTables):
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 prompt_blocks_only: bool = False) -> None:
        """prompt_blocks_only (prefill_dtype=bfloat16 or decode_dtype=int8):
        register only blocks full of the request's own prompt tokens.  Their
        KV came from the prompt path, a generated token's from another; a later prompt
        holding those generated tokens (the next turn of a chat) computes
        them as prompt tokens, so a hit on their blocks would give it other
        values than computing them would."""
        super().__init__(num_blocks, block_size, enable_caching)
        self.enable_caching = enable_caching
        self.prompt_blocks_only = prompt_blocks_only
        self._num_hashed: dict[str, int] = {}  # leading blocks already registered in the cache
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found in the cache

    def get_computed_blocks(self, req: Request) -> tuple[list[Block], int]:
        """Longest cached run of the request's leading full blocks.  At least
        one token is always left to compute, so the step has logits to sample.
        A request that still wants its prompt's logprobs takes no hits: every
        position is computed (as vLLM does), at the cost of its prefill."""
        if not self.enable_caching or req.prompt_logprobs is not None:
            return [], 0
        hashes = req.update_block_hashes(self.block_size)
        max_blocks = (req.num_tokens - 1) // self.block_size
        bs = self.block_size
        hits: list[Block] = []
        for i, h in enumerate(hashes[:max_blocks]):
            block = self.pool.lookup(h, req.all_token_ids[i * bs:(i + 1) * bs])
            if block is None:
                break
            hits.append(block)
        self.prefix_queries += req.num_tokens
        self.prefix_hits += len(hits) * bs
        return hits, len(hits) * bs

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[Block] = (), *,
                       cache: bool = True) -> list[Block] | None:
        """Reserve blocks for num_new_tokens more tokens after the request's
        computed ones (and after new_computed_blocks, prefix hits taken now).
        Returns the newly allocated blocks, or None if the pool can't supply
        them; then nothing changes.  cache=False: the KV will arrive from
        elsewhere, so nothing is registered in the prefix cache until it has
        (no other request may hit a block still being received)."""
        blocks = self._blocks.setdefault(req.request_id, [])
        assert not (blocks and new_computed_blocks), "prefix hits must lead the block table"
        num_computed = req.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total = num_computed + num_new_tokens
        num_new_blocks = self.blocks_needed(total) - len(blocks) - len(new_computed_blocks)
        # Hits nobody references sit in the free queue; taking them uses free slots.
        num_idle_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if max(num_new_blocks, 0) + num_idle_hits > self.pool.num_free_blocks:
            if not blocks:
                del self._blocks[req.request_id]
            return None
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.pool.allocate(num_new_blocks) if num_new_blocks > 0 else []
        blocks.extend(new_blocks)
        if cache:
            self.cache_full_blocks(req, total)
        return new_blocks

    def cache_full_blocks(self, req: Request, num_tokens: int) -> None:
        """Register the blocks that are full once num_tokens tokens are in the
        cache.  (In one process a step writes every layer's KV before any
        attention reads it, so a block may be shared from the step that fills it.)"""
        if not self.enable_caching:
            return
        bs = self.block_size
        done = self._num_hashed.get(req.request_id, 0)
        num_full = min(num_tokens, req.num_tokens) // bs
        if self.prompt_blocks_only:
            num_full = min(num_full, req.num_generated_from // bs)
        if num_full <= done:
            return
        hashes = req.update_block_hashes(bs)
        blocks = self._blocks[req.request_id]
        toks = [req.all_token_ids[i * bs:(i + 1) * bs] for i in range(done, num_full)]
        self.pool.cache_blocks(blocks[done:num_full], hashes[done:num_full], toks,
                               parent=hashes[done - 1] if done else None)
        self._num_hashed[req.request_id] = num_full

    def trim(self, req: Request, num_tokens: int) -> None:
        """Roll back to the first num_tokens tokens: free the tail blocks that
        hold none of them (rejected draft tokens).  Such blocks were never
        registered in the prefix cache: only blocks full of the request's
        accepted tokens are."""
        # (never more blocks hashed than held: trimming or not, this is the check)
        assert self._num_hashed.get(req.request_id, 0) <= self.blocks_needed(num_tokens), \
            "a cached block would be trimmed"
        self._trim_blocks(req.request_id, num_tokens)

    def free(self, req: Request) -> None:
        self._num_hashed.pop(req.request_id, None)
        self._free_blocks(req.request_id)

    def take_events(self) -> list[CacheEvent]:
        return self.pool.take_events()
