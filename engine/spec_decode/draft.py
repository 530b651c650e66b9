"""Draft-model proposals: a small model (or the target's first layers) run
autoregressively over its own paged KV cache, batched across requests.

One proposal for a batch is k draft forwards: the first catches each request
up on the tokens the draft cache lacks (after a rollback to what still matches
the real tokens) and samples draft 1 from its last position; each next one
feeds the previous draft as a decode.  Drafts are drawn from the draft's
distribution processed with the request's own sampling parameters (greedy:
its argmax), and that distribution q is kept for the verification rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from engine.model_inputs import Chunk, build_inputs
from engine.models.llama import AttentionFn, LlamaForCausalLM
from engine.request import Request
from engine.sampler import (
    SamplingRow,
    compute_probs,
    draw_uniforms,
    first_argmax,
    inverse_cdf,
    is_greedy,
    process_logits,
)
from engine.spec_decode.draft_cache import DraftKVCache, common_prefix_len

Proposal = tuple[list[int], Tensor | None]  # drafts, their distributions [k, V] (None: one-hot)

# Catch-up chunks up to this long attend as one-token rows (the batched decode path).
EXPAND_MAX_TOKENS = 8


@dataclass
class _DraftSeq:
    req: Request
    k: int
    start: int  # draft cache positions kept
    table: list[int]
    drafts: list[int] = field(default_factory=list)
    probs: list[Tensor] = field(default_factory=list)  # sampled requests only

    @property
    def pending(self) -> list[int]:
        return self.req.all_token_ids[self.start:]


class DraftProposer:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, attn: AttentionFn) -> None:
        s = model.spec
        self.model = model
        self.device = device
        self.attn = attn
        self.block_size = block_size
        # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], like the target's.
        self.kv_cache = torch.zeros(num_blocks, s.num_layers, 2, block_size, s.num_kv_heads,
                                    s.head_dim, dtype=dtype, device=device)
        self.cache = DraftKVCache(num_blocks, block_size)

    @torch.inference_mode()
    def propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> dict[str, Proposal]:
        seqs = self._plan(reqs, ks)
        if not seqs:
            return {}
        seqs.sort(key=lambda d: len(d.pending) > EXPAND_MAX_TOKENS)  # decode-like rows first
        chunks = [Chunk(d.pending, d.start, d.table, expand=len(d.pending) <= EXPAND_MAX_TOKENS)
                  for d in seqs]
        self._sample(seqs, self._forward(chunks))
        for j in range(1, max(d.k for d in seqs)):
            active = [d for d in seqs if d.k > j]
            # draft j sits at position num_tokens + j - 1
            chunks = [Chunk([d.drafts[-1]], d.req.num_tokens + j - 1, d.table, expand=True) for d in active]
            self._sample(active, self._forward(chunks))
        out: dict[str, Proposal] = {}
        for d in seqs:
            rid = d.req.request_id
            # The last draft was never fed: the cache holds the real tokens and drafts[:k-1].
            self.cache.set_tokens(rid, d.req.all_token_ids + d.drafts[:-1])
            out[rid] = (d.drafts, torch.stack(d.probs) if d.probs else None)
        return out

    def _plan(self, reqs: Sequence[Request], ks: Sequence[int]) -> list[_DraftSeq]:
        """Roll each request's draft cache back to what matches its real
        tokens (at least one token is left to feed) and reserve room for the
        rest plus k - 1 drafts."""
        seqs = []
        for req, k in zip(reqs, ks, strict=True):
            rid = req.request_id
            keep = min(common_prefix_len(self.cache.tokens(rid), req.all_token_ids), req.num_tokens - 1)
            self.cache.rollback(rid, keep)
            table = self.cache.reserve(rid, req.num_tokens + k - 1)
            if table is not None:
                seqs.append(_DraftSeq(req, k, keep, table))
        return seqs

    def _forward(self, chunks: list[Chunk]) -> Tensor:
        """-> draft logits [B, V] at each chunk's last token."""
        input_ids, positions, meta = build_inputs(chunks, self.block_size, self.device)
        hidden = self.model(input_ids, positions, self.kv_cache, meta, self.attn)
        ends: list[int] = []
        for c in chunks:
            ends.append((ends[-1] if ends else 0) + len(c.token_ids))
        return self.model.compute_logits(hidden[[e - 1 for e in ends]])

    def _sample(self, seqs: list[_DraftSeq], logits: Tensor) -> None:
        rows = [SamplingRow(d.req.params, d.req.prompt_token_ids, d.req.output_token_ids + d.drafts,
                            d.req.rng, d.req.eos_token_ids, num_resumed=d.req.num_resumed_tokens)
                for d in seqs]
        if all(is_greedy(r.params) for r in rows):
            tokens = first_argmax(process_logits(logits, rows)[0]).tolist()
            probs = None
        else:
            probs = compute_probs(logits, rows)
            u = torch.tensor(draw_uniforms(rows), dtype=torch.float64, device=logits.device)
            tokens = inverse_cdf(probs, u).tolist()
        for i, (d, t) in enumerate(zip(seqs, tokens, strict=True)):
            d.drafts.append(t)
            if probs is not None and not is_greedy(d.req.params):
                d.probs.append(probs[i])

    def free(self, request_id: str) -> None:
        self.cache.free(request_id)
