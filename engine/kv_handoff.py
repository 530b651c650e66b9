"""The prefill -> decode handoff: what a decode engine reserved for a prompt
whose KV a prefill worker computes and sends (docs/ARCHITECTURE.md, invariants 2,
3 and 7).  The PrefillRequest's `dst_block_ids`, `first_block`, `layout` and
`lora` mirror it (services/kv_layout.py converts)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.vocab.lora_request import LoRARequest
from kvtransfer.layout import KVLayout, check_compatible


@dataclass(frozen=True)
class KVHandoff:
    request_id: str
    # The decode worker's whole block table for the prompt, in prompt order.
    block_ids: tuple[int, ...]
    # Blocks before this one the decode worker holds already (its local prefix
    # hit): they are not sent.
    first_block: int
    # What the decode worker's blocks are (LLMEngine.kv_layout): the KV lands in
    # them byte for byte, so the prefill worker's must be the same.
    layout: KVLayout
    # The LoRA adapter the prompt runs with (None: the base model) and its digest
    # here: the prefill worker must prefill with the very same weights.
    lora: LoRARequest | None = None
    lora_digest: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.first_block <= len(self.block_ids):
            raise ValueError(f"first_block: {self.first_block} is not in [0, {len(self.block_ids)}]")

    @property
    def blocks_to_fill(self) -> tuple[int, ...]:
        """The blocks the prefill worker's KV lands in."""
        return self.block_ids[self.first_block:]

    def check_layout(self, local: KVLayout) -> None:
        """The prefill worker's own layout against the decode worker's: LayoutMismatch
        (a ValueError naming every field that differs) when its blocks cannot land
        in the decode worker's byte for byte (invariant 7)."""
        check_compatible(local, self.layout)

    def pair(self, src_block_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """The prefill worker's own block table for the same prompt -> the
        (source, destination) block ids that travel.  ValueError when the two
        tables are not for the same prompt length."""
        if len(src_block_ids) != len(self.block_ids):
            raise ValueError(f"dst_block_ids: {len(self.block_ids)} blocks for a prompt of "
                             f"{len(src_block_ids)}")
        return list(src_block_ids[self.first_block:]), list(self.blocks_to_fill)
