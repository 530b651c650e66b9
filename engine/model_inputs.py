"""Flattened model inputs and attention metadata for one forward over the paged cache."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.layers.attention import AttentionMetadata


@dataclass
class Chunk:
    """One sequence's query tokens in a forward."""

    token_ids: list[int]
    start: int  # position of token_ids[0]; the cache holds positions < start
    block_ids: list[int]
    # Attend as len(token_ids) one-token rows (row j: a decode of length
    # start + j + 1 over the same block table).  All of a chunk's KV is written
    # before attention reads any, so this equals causal attention, and short
    # chunks (verification of drafts) take the batched decode path.
    expand: bool = False
    # Prompt tokens: attended as a prefill even when the chunk is one token (a
    # prompt's last token after a cached prefix, or a chunk boundary), so a
    # prompt's logits never depend on how it was chunked or cached (the
    # decode kernel's bits are not the prefill kernel's).
    prompt: bool = False

    @property
    def num_rows(self) -> int:
        return len(self.token_ids) if self.expand else 1


def build_inputs(chunks: Sequence[Chunk], block_size: int, device: torch.device,
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """-> input_ids [T], positions [T], metadata.  The attention path batches
    the leading one-token rows as decodes: put expanded and one-token chunks
    (but prompts') first."""
    bs = block_size
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    qsl = [0]
    tables: list[list[int]] = []
    seq_lens: list[int] = []
    as_prefill: list[bool] = []  # per row of the attention: a prompt's, whatever its length
    for c in chunks:
        end = c.start + len(c.token_ids)
        ids += c.token_ids
        pos += range(c.start, end)
        slots += [c.block_ids[p // bs] * bs + p % bs for p in range(c.start, end)]
        if c.expand:
            for p in range(c.start, end):
                qsl.append(qsl[-1] + 1)
                tables.append(c.block_ids)
                seq_lens.append(p + 1)
                as_prefill.append(False)
        else:
            qsl.append(qsl[-1] + len(c.token_ids))
            tables.append(c.block_ids)
            seq_lens.append(end)
            as_prefill.append(c.prompt)
    query_lens = [b - a for a, b in zip(qsl, qsl[1:], strict=False)]
    num_decodes = next((i for i, n in enumerate(query_lens) if n != 1 or as_prefill[i]), len(query_lens))
    max_nb = max(len(t) for t in tables)
    padded = [t + [0] * (max_nb - len(t)) for t in tables]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        query_lens=query_lens, seq_lens_host=seq_lens, num_decodes=num_decodes)
    return (torch.tensor(ids, dtype=torch.int64, device=device),
            torch.tensor(pos, dtype=torch.int64, device=device), meta)
