"""What entered or left a worker's prefix cache.  Torch-free.

The block pool emits these; the workers stream them to the frontend, which
feeds the prefix index (embedded or Redis) that the router asks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.vocab.hashing import BlockHash


@dataclass
class CacheEvent:
    """What entered or left the prefix cache; published to the prefix index."""

    kind: str  # "stored" | "removed" | "cleared"
    block_hashes: list[BlockHash] = field(default_factory=list)
    parent: BlockHash | None = None
