"""The one chained block hash (docs/ARCHITECTURE.md, invariant 1).

A block's hash is a fixed, process-independent function of its parent block's
hash, its token ids and the extra keys (model id, cache salt, LoRA id).  Only
full blocks are hashed.  Engine, prefix index and router all call this module.
Torch-free.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes  # 16 bytes of BLAKE2b

ROOT_HASH: BlockHash = hashlib.blake2b(b"splitserve/block-hash/v1", digest_size=16).digest()


def cache_model_key(model_id: str, dtype: str, kv_cache_dtype: str, prefill_dtype: str = "") -> str:
    """The model part of a block's extra keys.  model_id carries a digest of the
    weights (loader.model_id); the compute and KV dtypes make blocks of one model
    computed in float32 and bfloat16, or stored as fp8 and not, never share a
    hash, so no prefix-cache hit or route mixes them across workers; nor do
    blocks whose prompt tokens ran in bfloat16 (prefill_dtype) and those that did not."""
    key = f"{model_id}|{dtype}|{kv_cache_dtype}"
    return f"{key}|prefill-{prefill_dtype}" if prefill_dtype else key


def extra_keys(model_id: str, cache_salt: str | None = None, lora_id: str | None = None) -> bytes:
    """Encode the extra keys once per request; length-prefixed so no two
    different key tuples share an encoding."""
    out = bytearray()
    for key in (model_id, cache_salt or "", lora_id or ""):
        raw = key.encode("utf-8")
        out += struct.pack("<I", len(raw)) + raw
    return bytes(out)


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: bytes) -> BlockHash:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent if parent is not None else ROOT_HASH)
    h.update(struct.pack(f"<I{len(token_ids)}I", len(token_ids), *token_ids))
    h.update(extra)
    return h.digest()


def hash_blocks(token_ids: Sequence[int], block_size: int, extra: bytes,
                parent: BlockHash | None = None, start: int = 0) -> list[BlockHash]:
    """Hashes of every full block of token_ids[start:], chained from parent.
    `start` must be a multiple of block_size."""
    assert start % block_size == 0
    hashes: list[BlockHash] = []
    for i in range(start, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[i:i + block_size], extra)
        hashes.append(parent)
    return hashes
