"""The speculative sampling rule (engine/spec_decode/rejection.py) on a tiny
vocabulary, no model: the residual exactly, the rule's output distribution
exactly, then the whole verification path (with the sampler's penalties,
temperature and top_k) against plain sampling in a chi-square test."""

from __future__ import annotations

import random

import torch

from engine.sampler import SamplingRow, compute_probs, sample
from engine.sampling_params import SamplingParams
from engine.spec_decode.rejection import VerifyItem, accepts, position_rows, rejection_sample, residual_probs

# Every statistical test here rejects a correct implementation with
# probability ALPHA (fixed seeds make them deterministic in practice).
ALPHA = 1e-3


def chi2_pvalue(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson goodness of fit over the bins with nonzero expected mass."""
    keep = expected_probs > 0
    obs, exp = observed[keep].double(), expected_probs[keep].double()
    exp = exp / exp.sum() * obs.sum()
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = torch.tensor(float(keep.sum() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, stat / 2))  # survival function of chi2(dof)


def item(params: SamplingParams, drafts: list[int], q: torch.Tensor | None = None,
         rng: random.Random | None = None, prompt: list[int] | None = None,
         output: list[int] | None = None) -> VerifyItem:
    row = SamplingRow(params, prompt or [], output or [], rng or random.Random(0), frozenset())
    return VerifyItem(row, drafts, q)


def test_residual_is_normalized_positive_part_of_p_minus_q() -> None:
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.1, 0.6, 0.1, 0.2])
    assert torch.allclose(residual_probs(p, q), torch.tensor([0.8, 0.0, 0.2, 0.0]))
    # Deterministic proposer (q one-hot at the draft): p without the draft, renormalized.
    assert torch.allclose(residual_probs(p, torch.tensor([1.0, 0, 0, 0])), torch.tensor([0, 0.6, 0.4, 0]))
    # p == q: rejection has probability 0; the residual falls back to p, never NaN.
    assert torch.equal(residual_probs(p, p), p)


def test_acceptance_is_min_one_p_over_q() -> None:
    assert accepts(0.999, 0.5, 0.5) and accepts(0.0, 0.3, 0.9)  # q <= p: always
    assert accepts(0.33, 0.3, 0.9) and not accepts(0.34, 0.3, 0.9)  # p/q = 1/3
    assert not accepts(0.0, 0.0, 0.5)  # the target never emits this token


def test_rule_reproduces_p_exactly() -> None:
    """sum_d q(d) [min(1, p/q) 1{x=d} + (1 - min(1, p/q)) residual(x)] == p(x)."""
    g = torch.Generator().manual_seed(7)
    for _ in range(20):
        p = torch.rand(6, generator=g, dtype=torch.float64) ** 3
        q = torch.rand(6, generator=g, dtype=torch.float64) ** 3
        p[torch.randint(6, (1,), generator=g)] = 0  # the target may exclude tokens (top_k)
        p, q = p / p.sum(), q / q.sum()
        accept = torch.minimum(torch.ones_like(p), p / q)
        out = q * accept + (q * (1 - accept)).sum() * residual_probs(p, q)
        assert torch.allclose(out, p, atol=1e-12), (out, p)


def test_greedy_accepts_argmax_prefix_and_draws_nothing() -> None:
    logits = torch.full((4, 8), -1.0)
    for pos, tok in enumerate([3, 5, 1, 6]):  # target argmax per position
        logits[pos, tok] = 2.0
    rng = random.Random(0)
    state = rng.getstate()
    greedy = SamplingParams(temperature=0)

    def emitted(drafts: list[int]) -> list[int]:
        out = rejection_sample(logits[:len(drafts) + 1], [item(greedy, drafts, rng=rng)])
        return [t.token_id for t in out[0]]

    assert emitted([3, 5, 2]) == [3, 5, 1]  # the third draft is rejected: the argmax instead
    assert emitted([3, 5, 1]) == [3, 5, 1, 6]  # all accepted: the bonus token
    assert emitted([0]) == [3]
    assert rng.getstate() == state


def test_without_drafts_it_is_plain_sampling_with_the_same_draw() -> None:
    """A non-speculating seeded request keeps its tokens in a batch that speculates."""
    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=0.9, top_k=6, seed=11)
    plain = sample(logits, [SamplingRow(params, [], [], random.Random(11), frozenset())])[0].token_id
    out = rejection_sample(logits, [item(params, [], rng=random.Random(11))])
    assert [t.token_id for t in out[0]] == [plain]


def test_rejected_position_emits_from_the_residual() -> None:
    """A draft the target never emits (outside top_k) is always rejected, and
    the replacement follows p without it, exactly in the limit."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -3.0, 1.5]]).expand(2, 5)
    params = SamplingParams(temperature=1.0, top_k=4)  # token 3 is out
    rng = random.Random(5)
    n = 10_000
    items = [item(params, [3], rng=rng) for _ in range(n)]
    out = rejection_sample(logits.repeat(n, 1), items)
    assert all(len(toks) == 1 for toks in out)
    counts = torch.bincount(torch.tensor([toks[0].token_id for toks in out]), minlength=5)
    p = compute_probs(logits[:1], position_rows(items[0])[:1])[0]
    assert counts[3] == 0
    assert chi2_pvalue(counts, p) > ALPHA


def test_verification_is_lossless_against_plain_sampling() -> None:
    """10,000 seeded requests, 2 drafts each drawn from a draft distribution q
    that differs from the target.  Penalties, temperature and top_k make the
    target depend on the drafts before each position, as in the engine.
    Position 1's token must follow p_1; given an accepted first draft x,
    position 2's token must follow p_2(. | x), the distribution plain
    sampling would use after x.  Chi-square, significance ALPHA per test."""
    vocab, n = 6, 10_000
    base = torch.tensor([1.0, 0.2, 0.8, -0.5, 0.3, -2.0])
    logits = torch.stack([base, base.flip(0), base.roll(2)])  # [3 positions, V]
    params = SamplingParams(temperature=0.8, top_k=4, repetition_penalty=1.5, presence_penalty=0.5)
    prompt = [0, 2]
    q = torch.tensor([[0.05, 0.3, 0.1, 0.3, 0.2, 0.05]] * 2)  # [k, V]
    drafts = torch.multinomial(q[0], 2 * n, replacement=True,
                               generator=torch.Generator().manual_seed(1)).view(n, 2).tolist()
    items = [item(params, d, q, rng=random.Random(i), prompt=prompt, output=[1])
             for i, d in enumerate(drafts)]
    out = rejection_sample(logits.repeat(n, 1), items)

    def target(drafts: list[int], pos: int) -> torch.Tensor:
        rows = position_rows(item(params, drafts, prompt=prompt, output=[1]))
        return compute_probs(logits[pos:pos + 1], rows[pos:pos + 1])[0]

    first = torch.bincount(torch.tensor([toks[0].token_id for toks in out]), minlength=vocab)
    p1 = target([0, 0], 0)
    assert first[p1 == 0].sum() == 0
    assert chi2_pvalue(first, p1) > ALPHA, (first, p1)
    worst = 1.0
    for x in range(vocab):
        second = [toks[1].token_id for toks in out if len(toks) > 1 and toks[0].token_id == x]
        if len(second) < 300:
            continue
        counts = torch.bincount(torch.tensor(second), minlength=vocab)
        p2 = target([x, 0], 1)
        assert counts[p2 == 0].sum() == 0
        worst = min(worst, chi2_pvalue(counts, p2))
    # Bonferroni over the (at most 6) prefixes tested.
    assert worst > ALPHA / vocab
    accepted = sum(len(toks) - 1 for toks in out) / n
    assert 0.3 < accepted < 2  # drafts were both accepted and rejected


def test_logprobs_are_raw_at_each_emitted_position() -> None:
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(4))
    target = logits.argmax(dim=-1).tolist()
    out = rejection_sample(logits, [item(SamplingParams(temperature=0, logprobs=2), target[:2])])[0]
    assert [t.token_id for t in out] == target
    raw = logits.log_softmax(dim=-1)
    for pos, tok in enumerate(out):
        assert abs(tok.logprob - float(raw[pos, tok.token_id])) < 1e-5 and tok.rank == 1
        assert len(tok.top_logprobs) == 2
