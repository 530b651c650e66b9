"""Sampler: each processing rule checked numerically on a tiny vocab, no model."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import pytest
import torch

from engine import sampler as S
from engine.sampler import SamplingRow, compute_probs, first_argmax, inverse_cdf, sample
from engine.sampling_params import SamplingParams

V = 16
EOS = frozenset({V - 1})


def row(
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    rng: random.Random | None = None,
    eos: frozenset[int] = EOS,
    **params: object,
) -> SamplingRow:
    p = SamplingParams(**params)  # type: ignore[arg-type]
    if rng is None:
        rng = random.Random(p.seed if p.seed is not None else 0)
    return SamplingRow(p, list(prompt), list(output), rng, eos)


def logits_for(seed: int, batch: int = 1, vocab: int = V) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=g) * 2  # [B, V]


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # torch.testing takes a second to import; this is all these tests need.
    assert torch.allclose(actual, expected, rtol=1e-5, atol=1e-6), (actual, expected)


def support(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs > 0).flatten().tolist())


# ---------------------------------------------------------------- greedy


def test_greedy_is_argmax_and_draws_nothing() -> None:
    logits = logits_for(0, batch=4)
    rngs = [random.Random(i) for i in range(4)]
    states = [r.getstate() for r in rngs]
    out = sample(logits, [row(temperature=0.0, rng=r) for r in rngs])
    assert [t.token_id for t in out] == logits.argmax(dim=-1).tolist()
    assert [r.getstate() for r in rngs] == states  # greedy rows consume no randomness
    probs = compute_probs(logits, [row(temperature=0.0) for _ in range(4)])
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), V).float())


def test_greedy_ties_pick_first_index() -> None:
    logits = torch.zeros(1, V)
    logits[0, [3, 7]] = 5.0
    assert sample(logits, [row(temperature=0.0)])[0].token_id == 3


def test_greedy_uses_processed_logits() -> None:
    logits = torch.zeros(1, V)
    logits[0, 2] = 1.0
    r = row(temperature=0.0, logit_bias={5: 2.0})
    assert sample(logits, [r])[0].token_id == 5


def test_tiny_temperature_is_greedy_not_nan() -> None:
    logits = logits_for(1) * 50
    probs = compute_probs(logits, [row(temperature=1e-30)])
    assert not probs.isnan().any()
    assert probs.argmax().item() == logits.argmax().item() and probs.max().item() == 1.0


# ---------------------------------------------------------------- penalties and bias


def test_temperature_scales_logits() -> None:
    logits = logits_for(2)
    probs = compute_probs(logits, [row(temperature=0.5)])
    assert_close(probs, (logits / 0.5).softmax(-1))


def test_repetition_penalty_hf_rule_over_prompt_and_output() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, 0.0, 3.0, -3.0]])
    r = row(prompt=[0, 1], output=[2, 3, 3], eos=frozenset(), repetition_penalty=2.0)
    expected = torch.tensor([[1.0, -4.0, 0.5, -2.0, 0.5, 0.0, 3.0, -3.0]])
    assert_close(compute_probs(logits, [r]), expected.softmax(-1))


def test_presence_and_frequency_penalties_over_output_only() -> None:
    logits = torch.zeros(1, 8)
    # token 1 only in the prompt: untouched; 2 once and 3 three times in the output.
    r = row(prompt=[1, 2], output=[2, 3, 3, 3], eos=frozenset(),
            presence_penalty=0.5, frequency_penalty=0.25)
    expected = torch.zeros(1, 8)
    expected[0, 2] = -(0.5 + 0.25 * 1)
    expected[0, 3] = -(0.5 + 0.25 * 3)
    assert_close(compute_probs(logits, [r]), expected.softmax(-1))


def test_negative_presence_penalty_encourages() -> None:
    logits = torch.zeros(1, 8)
    r = row(output=[4], eos=frozenset(), presence_penalty=-1.0)
    expected = torch.zeros(1, 8)
    expected[0, 4] = 1.0
    assert_close(compute_probs(logits, [r]), expected.softmax(-1))


def test_penalties_then_bias_per_row() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]] * 3)
    rows = [
        row(prompt=[0], eos=frozenset(), repetition_penalty=2.0, logit_bias={0: 1.0}),
        row(prompt=[0], eos=frozenset()),  # no penalty in this row despite the batch
        row(output=[3], eos=frozenset(), frequency_penalty=1.0, logit_bias={1: -1.5, 99: 5.0}),
    ]
    expected = torch.tensor([
        [2.0 / 2 + 1.0, 1.0, 0.0, -1.0],
        [2.0, 1.0, 0.0, -1.0],
        [2.0, 1.0 - 1.5, 0.0, -1.0 - 1.0 * 1],  # frequency 1 x count 1; id 99 ignored
    ])
    assert_close(compute_probs(logits, rows), expected.softmax(-1))


def test_processing_leaves_the_callers_logits_as_they_were() -> None:
    """Penalties write into the logits in place, on a copy: the caller's tensor
    (the model's output, gathered again for logprobs) keeps its values."""
    logits = logits_for(5, batch=2)
    before = logits.clone()
    argmax_logits, _ = S.process_logits(logits, [row(prompt=[0, 1], repetition_penalty=2.0), row()])
    assert torch.equal(logits, before)
    assert not torch.equal(argmax_logits, before)  # the penalty did change the row it applies to
    assert torch.equal(argmax_logits[1], before[1])


def test_no_penalties_in_batch_builds_no_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("token_counts called without penalties")

    monkeypatch.setattr(S, "token_counts", boom)
    sample(logits_for(3, batch=2), [row(output=[1, 2]), row(temperature=0.0, logit_bias={1: 1.0})])


# ---------------------------------------------------------------- min_tokens


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(1, V)
    eos = frozenset({V - 1, V - 2})
    before = compute_probs(logits, [row(output=[1], eos=eos, min_tokens=2, stop_token_ids=[4])])
    assert support(before[0]) == set(range(V)) - {V - 1, V - 2, 4}
    reached = compute_probs(logits, [row(output=[1, 2], eos=eos, min_tokens=2, stop_token_ids=[4])])
    assert support(reached[0]) == set(range(V))


def test_min_tokens_with_ignore_eos_masks_only_stop_ids() -> None:
    probs = compute_probs(torch.zeros(1, V), [row(min_tokens=1, stop_token_ids=[3], ignore_eos=True)])
    assert support(probs[0]) == set(range(V)) - {3}


def test_min_tokens_greedy_never_returns_eos() -> None:
    logits = torch.zeros(1, V)
    logits[0, V - 1] = 10.0
    out = sample(logits, [row(temperature=0.0, min_tokens=1)])
    assert out[0].token_id != V - 1


# ---------------------------------------------------------------- truncation


def test_top_k_support() -> None:
    logits = torch.arange(V, dtype=torch.float32)[None]
    probs = compute_probs(logits, [row(top_k=3)])
    assert support(probs[0]) == {V - 1, V - 2, V - 3}
    assert_close(probs[0, -3:], logits[0, -3:].softmax(-1))
    assert support(compute_probs(logits, [row(top_k=10 * V)])[0]) == set(range(V))


def test_top_k_keeps_ties_with_kth() -> None:
    logits = torch.tensor([[5.0, 4.0, 4.0, 1.0]])
    assert support(compute_probs(logits, [row(top_k=2, eos=frozenset())])[0]) == {0, 1, 2}


def test_top_p_keeps_smallest_prefix_reaching_mass() -> None:
    probs_in = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625])
    logits = probs_in.log()[None]
    rows = lambda p: [row(top_p=p, eos=frozenset())]  # noqa: E731
    assert support(compute_probs(logits, rows(0.5))[0]) == {0}
    assert support(compute_probs(logits, rows(0.6))[0]) == {0, 1}
    assert support(compute_probs(logits, rows(0.8))[0]) == {0, 1, 2}
    assert support(compute_probs(logits, rows(1.0))[0]) == {0, 1, 2, 3, 4}
    kept = compute_probs(logits, rows(0.8))[0]
    assert_close(kept[:3], probs_in[:3] / probs_in[:3].sum())


def test_min_p_drops_below_fraction_of_max() -> None:
    probs_in = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probs_in.log()[None]
    # threshold 0.45 * 0.4 = 0.18: 0.2 stays, 0.1 goes.
    assert support(compute_probs(logits, [row(min_p=0.45, eos=frozenset())])[0]) == {0, 1, 2}
    assert support(compute_probs(logits, [row(min_p=0.76, eos=frozenset())])[0]) == {0}


def test_truncation_is_per_row() -> None:
    logits = torch.arange(V, dtype=torch.float32).expand(4, V)
    rows = [row(top_k=2), row(), row(temperature=0.0), row(top_k=5, top_p=0.5, min_p=0.01)]
    probs = compute_probs(logits, rows)
    assert support(probs[0]) == {V - 1, V - 2}
    assert support(probs[1]) == set(range(V))
    assert support(probs[2]) == {V - 1}
    # softmax of 0..15: the top token alone holds ~63% of the mass.
    assert support(probs[3]) == {V - 1}
    assert_close(probs.sum(-1), torch.ones(4))


# ---------------------------------------------------------------- drawing


def test_inverse_cdf_never_picks_zero_probability_tokens() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4)
    u = torch.tensor([0.0, 0.5, 1.0 - 2**-53, 0.9999999], dtype=torch.float64)
    assert inverse_cdf(probs, u).tolist() == [1, 3, 3, 3]
    # Mass that doesn't sum to exactly 1 (float32 rounding) still stays in range.
    odd = torch.tensor([[0.3, 0.3, 0.3, 0.0]])
    assert inverse_cdf(odd, torch.tensor([1.0 - 2**-53], dtype=torch.float64)).tolist() == [2]


def test_each_sampled_row_draws_exactly_one_uniform() -> None:
    rng, ref = random.Random(7), random.Random(7)
    sample(logits_for(4, batch=1), [row(rng=rng, top_k=4, repetition_penalty=1.2, output=[1])])
    ref.random()
    assert rng.getstate() == ref.getstate()


def _generate(rows_per_step: int, position: int, seed: int, steps: int = 12) -> list[int]:
    """Sample `steps` tokens for a seeded request that sits at `position` in a
    batch of `rows_per_step` rows whose other rows differ in every way."""
    target = row(seed=seed, temperature=0.9, top_p=0.95, presence_penalty=0.3)
    others = [row(rng=random.Random(100 + i), temperature=0.5 + i, top_k=i + 1)
              for i in range(rows_per_step - 1)]
    tokens: list[int] = []
    for step in range(steps):
        rows = list(others)
        rows.insert(position, target)
        batch_logits = logits_for(1000 + step, batch=rows_per_step)
        batch_logits[position] = logits_for(step)[0]  # the request's own logits
        out = sample(batch_logits, rows)
        tokens.append(out[position].token_id)
        target.output_token_ids.append(out[position].token_id)  # type: ignore[attr-defined]
    return tokens


def test_seeded_request_is_independent_of_batch() -> None:
    alone = _generate(1, 0, seed=42)
    assert _generate(5, 0, seed=42) == alone
    assert _generate(5, 3, seed=42) == alone
    assert _generate(8, 7, seed=42) == alone
    assert _generate(1, 0, seed=43) != alone  # the seed actually matters


def test_sampling_frequencies_match_probabilities() -> None:
    # Pearson chi-square goodness of fit, 3 degrees of freedom: the 0.1%
    # upper critical value is 16.266, so a correct sampler fails this fixed-seed
    # test with probability 0.001 (and with this seed, never).
    target = torch.tensor([0.1, 0.2, 0.3, 0.4])
    draws = 20_000
    rng = random.Random(1234)
    params = SamplingParams()
    rows = [SamplingRow(params, [], [], rng, frozenset()) for _ in range(draws)]
    out = sample(target.log().expand(draws, 4), rows)
    counts = torch.bincount(torch.tensor([t.token_id for t in out]), minlength=4).double()
    expected = target.double() * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.266, (counts.tolist(), chi2)


def test_sampling_frequencies_after_top_k_and_temperature() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, -5.0]])
    draws = 20_000
    rng = random.Random(99)
    params = SamplingParams(temperature=2.0, top_k=3)
    rows = [SamplingRow(params, [], [], rng, frozenset()) for _ in range(draws)]
    out = sample(logits.expand(draws, 5), rows)
    counts = torch.bincount(torch.tensor([t.token_id for t in out]), minlength=5).double()
    assert counts[0] == 0 and counts[4] == 0
    expected = (logits[0, 1:4] / 2.0).softmax(-1).double() * draws
    chi2 = float(((counts[1:4] - expected) ** 2 / expected).sum())
    assert chi2 < 13.816, (counts.tolist(), chi2)  # 2 dof, 0.1% level


# ---------------------------------------------------------------- logprobs


def test_logprobs_rank_and_top_are_of_raw_logits() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0, -1.0, 2.5]])
    # Processing would move token 0 to the top; logprobs must not see that.
    r = row(temperature=0.0, logit_bias={0: 10.0}, logprobs=3, eos=frozenset())
    out = sample(logits, [r])[0]
    raw = logits.log_softmax(-1)[0]
    assert out.token_id == 0
    assert out.logprob == pytest.approx(raw[0].item())
    assert out.rank == 4  # 3.0, 2.5 and 2.0 are above it
    assert list(out.top_logprobs) == [1, 5, 2]
    for tok, lp in out.top_logprobs.items():
        assert lp == pytest.approx(raw[tok].item())


def test_top_logprobs_count_per_row() -> None:
    logits = logits_for(5, batch=3)
    rows = [row(temperature=0.0, logprobs=None), row(temperature=0.0, logprobs=0),
            row(temperature=0.0, logprobs=20)]
    out = sample(logits, rows)
    assert out[0].top_logprobs == {} and out[1].top_logprobs == {}
    assert len(out[2].top_logprobs) == V  # 20 > V: every token
    for o, lg in zip(out, logits, strict=True):
        assert o.rank == 1  # greedy without processing picks the raw argmax
        assert o.logprob == pytest.approx(lg.log_softmax(-1).max().item())
        assert math.isfinite(o.logprob)


@pytest.mark.parametrize("rows,vocab", [(1, 49152), (3, 49152), (4, 49152), (32, 49152), (40, 128256),
                                        (8, 1000), (8, 151936), (5, 100)])
def test_first_argmax_is_torchs_argmax(rows: int, vocab: int) -> None:
    """The chunked argmax greedy rows take: torch's answer, ties (the first
    wins), NaNs (the first NaN wins) and rows of -inf included."""
    gen = torch.Generator().manual_seed(rows * vocab)
    x = torch.randn(rows, vocab, generator=gen)
    x[0, vocab // 3] = x[0, vocab - 1] = 50.0  # a tie across chunks
    if rows > 1:
        x[1, 7] = x[1, 900 % vocab] = float("nan")
    if rows > 2:
        x[2] = float("-inf")
        x[2, vocab // 2] = -1e30
    if rows > 3:
        x[3, 1] = x[3, 2] = 60.0  # a tie inside one chunk
    assert torch.equal(first_argmax(x), x.argmax(dim=-1))
