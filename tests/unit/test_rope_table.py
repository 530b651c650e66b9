"""The CPU rope's table (engine/models/llama.py RopeTable) and the head's row
pick (model_runner.take_rows): the values and rows computed directly, whatever
positions or rows a step asks for."""

from __future__ import annotations

import pytest
import torch

from engine.model_runner import take_rows
from engine.models.llama import RopeTable, rope_values


def inverse_frequencies(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_are_the_values_computed_per_step(dtype: torch.dtype) -> None:
    table, inv = RopeTable(), inverse_frequencies(64, 10000.0)
    for positions in ([0, 1, 2, 3], [4095], [17, 4096, 9000, 5], [70000, 0], list(range(40))):
        pos = torch.tensor(positions)
        cos, sin = table.rows(inv, pos, dtype)
        want_cos, want_sin = rope_values(inv, pos.float(), dtype)
        assert cos.shape == (len(positions), 1, 32) and cos.dtype == dtype
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)


def test_each_inverse_frequency_has_its_own_table() -> None:
    table = RopeTable()
    near, far = inverse_frequencies(64, 10000.0), inverse_frequencies(64, 1000000.0)
    pos = torch.tensor([3, 300, 3000])
    f32 = torch.float32
    assert torch.equal(table.rows(near, pos, f32)[0], rope_values(near, pos.float(), f32)[0])
    assert torch.equal(table.rows(far, pos, f32)[0], rope_values(far, pos.float(), f32)[0])
    assert not torch.equal(table.rows(near, pos, f32)[0], table.rows(far, pos, f32)[0])


def test_take_rows_is_the_rows_asked_for() -> None:
    x = torch.randn(6, 5)
    assert take_rows(x, list(range(6))) is x  # every row in order: no copy
    for rows in ([5, 0, 2], [0, 1, 2], [3], [1, 1, 4], []):
        assert torch.equal(take_rows(x, rows), x[rows])
