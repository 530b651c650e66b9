"""Verification: the speculative sampling rule (Leviathan et al. 2023).

For each draft token d_j (j = 1..k) with target distribution p_j (the request's
processed distribution at that position, exactly as without speculation) and
proposal distribution q_j (from which d_j was drawn; one-hot for a
deterministic proposer such as n-gram lookup):

    accept d_j with probability min(1, p_j(d_j) / q_j(d_j))
    on the first rejection, emit a token from norm(max(0, p_j - q_j)) and stop
    if all k are accepted, emit a bonus token from p_{k+1}

Every emitted token is then distributed exactly as p (the rule is lossless).
Greedy requests have one-hot p and draw nothing (u = 0): a draft is accepted
iff it is the target's argmax, and the token after a rejection is the argmax.
A request with no drafts reduces to plain sampling with one uniform, the same
draw `sampler.sample` makes, so seeded requests without speculation keep their
tokens in a batch that speculates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.sampler import (
    SampledToken,
    SamplingRow,
    compute_probs,
    first_argmax,
    gather_logprobs,
    inverse_cdf,
    is_greedy,
    process_logits,
)


@dataclass
class VerifyItem:
    """One request's verification: k >= 0 drafts after its last token."""

    row: SamplingRow  # the request before this step
    draft_token_ids: list[int]
    # [k, V]: the distributions the drafts were drawn from; None: one-hot (deterministic proposer)
    draft_probs: Tensor | None = None
    # [k + 1, W] grammar masks after the last token and after each draft (structured output)
    bitmasks: Tensor | None = None

    @property
    def num_rows(self) -> int:
        return len(self.draft_token_ids) + 1


def position_rows(item: VerifyItem) -> list[SamplingRow]:
    """k + 1 sampling rows: row j sees drafts[:j] as already generated, so
    penalties and min_tokens apply exactly as they would without speculation.
    With a grammar, row j's mask is the one after drafts[:j]; a draft the
    grammar refuses has p = 0 there, so it is always rejected."""
    r, drafts = item.row, item.draft_token_ids
    outputs = list(r.output_token_ids)
    masks = item.bitmasks
    return [SamplingRow(r.params, r.prompt_token_ids, outputs + drafts[:j], r.rng, r.eos_token_ids,
                        None if masks is None else masks[j], r.num_resumed)
            for j in range(item.num_rows)]


def residual_probs(p: Tensor, q: Tensor) -> Tensor:
    """norm(max(0, p - q)) over the last dim.  Where p <= q everywhere (only
    possible when p == q, and then a rejection has probability 0), p itself."""
    residual = (p - q).clamp_min(0)
    mass = residual.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(1e-30), p)


def accepts(u: float, p_draft: float, q_draft: float) -> bool:
    """u ~ U[0, 1): accept with probability min(1, p/q).  q >= p: always accept."""
    return u * q_draft < p_draft


def rejection_sample(logits: Tensor, items: Sequence[VerifyItem]) -> list[list[SampledToken]]:
    """logits: [sum of num_rows, V] raw target logits, each item's rows in
    order -> per item, the accepted drafts followed by one sampled token."""
    rows = [r for item in items for r in position_rows(item)]
    assert logits.dim() == 2 and logits.shape[0] == len(rows), (tuple(logits.shape), len(rows))
    offsets = [0]
    for item in items:
        offsets.append(offsets[-1] + item.num_rows)
    if all(is_greedy(r.params) for r in rows):
        target = first_argmax(process_logits(logits, rows)[0]).tolist()  # first index on ties
        emitted = [_walk_greedy(item, target[off:off + item.num_rows])
                   for item, off in zip(items, offsets, strict=False)]
    else:
        emitted = _sample_rows(compute_probs(logits, rows), items, offsets)
    return _with_logprobs(logits, rows, items, offsets, emitted)


def _walk_greedy(item: VerifyItem, target: list[int]) -> list[int]:
    for j, d in enumerate(item.draft_token_ids):
        if d != target[j]:
            return [*item.draft_token_ids[:j], target[j]]
    return [*item.draft_token_ids, target[-1]]


def _sample_rows(probs: Tensor, items: Sequence[VerifyItem], offsets: list[int]) -> list[list[int]]:
    """probs: [N, V] target distributions (one-hot for greedy rows)."""
    device = probs.device
    p_draft, q_draft = _draft_token_probs(probs, items, offsets)
    accepted: list[int] = []
    final_rows: list[int] = []  # the row each item's last token is drawn from
    u_final: list[float] = []
    pos = 0
    for item, off in zip(items, offsets, strict=False):
        greedy = is_greedy(item.row.params)
        k = len(item.draft_token_ids)
        j = 0
        while j < k and accepts(0.0 if greedy else item.row.rng.random(), p_draft[pos + j], q_draft[pos + j]):
            j += 1
        pos += k
        accepted.append(j)
        final_rows.append(off + j)
        u_final.append(0.0 if greedy else item.row.rng.random())
    # q at each rejected position (zero where all were accepted: the residual is then p itself).
    q = torch.zeros(len(items), probs.shape[1], dtype=probs.dtype, device=device)
    for i, (item, j) in enumerate(zip(items, accepted, strict=True)):
        if j < len(item.draft_token_ids):
            if item.draft_probs is None:
                q[i, item.draft_token_ids[j]] = 1.0
            else:
                q[i] = item.draft_probs[j]
    finals = residual_probs(probs[final_rows], q)
    tokens = inverse_cdf(finals, torch.tensor(u_final, dtype=torch.float64, device=device))
    return [[*item.draft_token_ids[:a], t]
            for item, a, t in zip(items, accepted, tokens.tolist(), strict=True)]


def _draft_token_probs(probs: Tensor, items: Sequence[VerifyItem],
                       offsets: list[int]) -> tuple[list[float], list[float]]:
    """-> p(d) and q(d) of every draft token, items in order (q = 1 for one-hot proposals)."""
    rows = [off + j for item, off in zip(items, offsets, strict=False)
            for j in range(len(item.draft_token_ids))]
    toks = [d for item in items for d in item.draft_token_ids]
    if not rows:
        return [], []
    p_draft = probs[rows, toks].tolist()
    q_draft = [1.0] * len(toks)
    with_q = [(i, it) for i, it in enumerate(items) if it.draft_probs is not None and it.draft_token_ids]
    if with_q:
        q_rows = torch.cat([it.draft_probs for _, it in with_q])  # type: ignore[misc]
        q_toks = [d for _, it in with_q for d in it.draft_token_ids]
        values = iter(q_rows[range(len(q_toks)), q_toks].tolist())
        starts = [0]
        for it in items:
            starts.append(starts[-1] + len(it.draft_token_ids))
        for i, it in with_q:
            for j in range(len(it.draft_token_ids)):
                q_draft[starts[i] + j] = next(values)
    return p_draft, q_draft


def _with_logprobs(logits: Tensor, rows: list[SamplingRow], items: Sequence[VerifyItem],
                   offsets: list[int], emitted: list[list[int]]) -> list[list[SampledToken]]:
    """Logprobs are of the raw logits at each emitted token's own position."""
    if all(item.row.params.logprobs is None for item in items):
        return [[SampledToken(t, math.nan, 0) for t in toks] for toks in emitted]
    positions = [off + j for off, toks in zip(offsets, emitted, strict=False) for j in range(len(toks))]
    flat = [t for toks in emitted for t in toks]
    stats = gather_logprobs(logits[positions], torch.tensor(flat, device=logits.device),
                            [rows[i].params.logprobs or 0 for i in positions])
    out, it = [], iter(zip(flat, stats, strict=True))
    for toks in emitted:
        out.append([SampledToken(t, lp, rank, top) for t, (lp, rank, top) in
                    (next(it) for _ in toks)])
    return out
