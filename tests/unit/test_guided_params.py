"""Structured output without a model: spec validation (what the frontend
runs before dispatch) and the sampler's batched grammar mask."""

from __future__ import annotations

import random

import pytest
import torch

from engine.sampler import SamplingRow, apply_token_bitmask, compute_probs, sample
from engine.sampling_params import SamplingParams
from engine.vocab.guided_params import GuidedDecoding

V = 40  # two 32-bit words, the second one partial


def bitmask(allowed: set[int], vocab: int = V) -> torch.Tensor:
    words = [0] * ((vocab + 31) // 32)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    # int32 words: bit 31 set is a negative number
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def test_bitmask_masks_only_its_rows_and_every_word() -> None:
    logits = torch.randn(3, V)
    before = logits.clone()
    allowed = {0, 31, 33, 39}  # bit 31 is the sign bit of word 0
    out = apply_token_bitmask(logits.clone(), bitmask(allowed)[None], [1])
    assert torch.equal(out[0], before[0]) and torch.equal(out[2], before[2])
    finite = set(torch.nonzero(torch.isfinite(out[1])).flatten().tolist())
    assert finite == allowed
    assert torch.equal(out[1, sorted(allowed)], before[1, sorted(allowed)])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampler_draws_only_allowed_tokens(temperature: float) -> None:
    logits = torch.zeros(2, V)
    logits[:, 5] = 10.0  # the model's favourite, which the grammar forbids on row 0
    rows = [SamplingRow(SamplingParams(temperature=temperature, seed=i), [], [], random.Random(i),
                        frozenset({V - 1}), bitmask({7, 8}) if i == 0 else None) for i in range(2)]
    for _ in range(20):
        toks = [t.token_id for t in sample(logits, rows)]
        assert toks[0] in {7, 8}
    probs = compute_probs(logits, rows)
    assert set(torch.nonzero(probs[0] > 0).flatten().tolist()) <= {7, 8}
    assert probs[1, 5] > 0.5  # the unguided row is untouched


def test_min_tokens_does_not_fight_the_grammar() -> None:
    """The grammar allows only EOS; min_tokens would ban it: the grammar wins (no all -inf row)."""
    eos = V - 1
    row = SamplingRow(SamplingParams(temperature=0, min_tokens=5), [], [], random.Random(0),
                      frozenset({eos}), bitmask({eos}))
    assert sample(torch.randn(1, V), [row])[0].token_id == eos


@pytest.mark.parametrize("make, field", [
    (lambda: GuidedDecoding.json_schema({"type": "strin"}), "guided_json.type"),
    (lambda: GuidedDecoding.json_schema({"properties": {"a": {"minimum": "x"}}}),
     "guided_json.properties.a.minimum"),
    (lambda: GuidedDecoding.json_schema("{not json", "response_format.json_schema.schema"),
     "response_format.json_schema.schema"),
    (lambda: GuidedDecoding.json_schema([1]), "guided_json"),
    (lambda: GuidedDecoding.regex("[a-"), "guided_regex"),
    (lambda: GuidedDecoding.regex(""), "guided_regex"),
    (lambda: GuidedDecoding.choice([]), "guided_choice"),
    (lambda: GuidedDecoding.choice(["a", 3]), "guided_choice[1]"),
    (lambda: GuidedDecoding("yaml", ""), "guided.kind"),
    (lambda: GuidedDecoding("json", "{not json").validate("guided"), "guided"),
])
def test_invalid_specs_name_the_field(make, field: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError) as e:
        make()
    assert str(e.value).startswith(f"{field}:"), str(e.value)


def test_valid_specs_round_trip() -> None:
    g = GuidedDecoding.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    g.validate()
    assert g.key == ("json", '{"type":"object","properties":{"a":{"type":"integer"}}}')
    assert GuidedDecoding.choice(["yes", "no"]).choices == ["yes", "no"]
    assert SamplingParams(guided=g).guided is g
    with pytest.raises(ValueError, match="^guided:"):
        SamplingParams(guided={"json": {}})  # type: ignore[arg-type]
