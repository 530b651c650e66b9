"""The head's argmax taken in its kernel (bf16_linear_argmax, vdpbf16ps):
torch.argmax of the outputs bf16_linear (or bf16_q4_linear, bf16_q8_linear)
gives, without writing them: the first column of the largest, a NaN above
every number, for any rows and columns; and PackedLinear's gate on it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.layers.cpu_attention import load_linear_kernel
from engine.layers.packed_linear import PackedLinear, PromptRows, q4_blocks, q8_blocks, row_runs
from tests.unit.test_linear_isa import q4_weight, q8_weight


@pytest.fixture(scope="module")
def kernel():  # type: ignore[no-untyped-def]
    k = load_linear_kernel()
    assert k is not None, "the linear kernel must build on this machine"
    if not k.bf16_supported():
        pytest.skip("this CPU lacks AVX512-BF16 (lscpu: no avx512_bf16), which bf16_linear_argmax needs")
    before = k.set_amx(False) if k.amx_supported() else None  # vdpbf16ps: the argmax's kernel
    assert k.bf16_argmax_supported()
    yield k
    if before is not None:
        k.set_amx(before)


def outputs_argmax(kernel, x: torch.Tensor, panels: torch.Tensor, n: int,  # type: ignore[no-untyped-def]
                   blocks: torch.Tensor | None = None) -> torch.Tensor:
    """torch's argmax of the outputs the unfused call writes."""
    if blocks is None:
        return kernel.bf16_linear(x, panels, n).argmax(-1)
    fn = kernel.bf16_q4_linear if blocks.shape[-1] == 384 else kernel.bf16_q8_linear
    return fn(x, panels, blocks, n).argmax(-1)


# Rows around the 12-row tile and the 192-row chunk; columns that are and are
# not whole panels and pairs of panels (the head's 49,152 too).
@pytest.mark.parametrize("m", [1, 5, 12, 13, 32, 193])
@pytest.mark.parametrize("k_in,n", [(64, 16), (64, 33), (96, 200), (22, 7), (576, 1000), (576, 49152)])
def test_argmax_is_torchs_over_the_outputs(kernel, m: int, k_in: int, n: int) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(m * 1000 + n)
    x, w = torch.randn(m, k_in, generator=gen), torch.randn(n, k_in, generator=gen) * 0.05
    panels = kernel.pack_bf16(w)
    got = kernel.bf16_linear_argmax(x, panels, n)
    assert got.dtype == torch.int64 and got.shape == (m,)
    assert torch.equal(got, outputs_argmax(kernel, x, panels, n))
    assert torch.equal(kernel.bf16_linear_argmax(x[:1].view(1, 1, k_in), panels, n), got[:1].view(1, 1))


def test_ties_nan_and_negative_outputs(kernel) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(7)
    n, k_in = 1000, 64
    x = torch.rand(6, k_in, generator=gen) + 0.5  # positive
    w = torch.randn(n, k_in, generator=gen) * 0.01
    # ties: equal largest outputs in one panel, in two, and 890 columns apart
    # (another pair of panels, likely another thread's piece): the first wins
    w[900] = w[21] = w[5] = 1.0
    panels = kernel.pack_bf16(w)
    y = kernel.bf16_linear(x, panels, n)
    assert (y[:, 5] == y[:, 900]).all() and (y[:, 5] == y[:, 21]).all() and (y.argmax(-1) == 5).all()
    assert torch.equal(kernel.bf16_linear_argmax(x, panels, n), torch.full((6,), 5))
    # a NaN is above every number (the first NaN); a row of NaNs: column 0
    w[700, 3], w[40, 9] = float("nan"), float("nan")
    x[2, 0] = float("nan")
    panels = kernel.pack_bf16(w)
    want = outputs_argmax(kernel, x, panels, n)
    assert want.tolist() == [40, 40, 0, 40, 40, 40]
    assert torch.equal(kernel.bf16_linear_argmax(x, panels, n), want)
    # every output negative, columns not a whole panel: the padded lanes
    # (sums of zero columns) never win
    for cols in (7, 33):
        neg = -(torch.rand(cols, k_in, generator=gen) + 0.1)
        p = kernel.pack_bf16(neg)
        want = outputs_argmax(kernel, x[:2] if cols == 7 else x[3:], p, cols)
        assert (want < cols).all()
        assert torch.equal(kernel.bf16_linear_argmax(x[:2] if cols == 7 else x[3:], p, cols), want)
    # infinities: +inf above every number, -inf rows still name a column
    x2 = torch.randn(3, k_in, generator=gen)
    x2[0, 1], x2[1, 1] = float("inf"), float("-inf")
    p = kernel.pack_bf16(torch.randn(48, k_in, generator=gen))
    assert torch.equal(kernel.bf16_linear_argmax(x2, p, 48), outputs_argmax(kernel, x2, p, 48))


# One tile of x (12 rows, the pairs made from the blocks) and past it (the panels).
@pytest.mark.parametrize("m", [1, 12, 13, 32])
@pytest.mark.parametrize("bits", [4, 8])
def test_argmax_from_the_blocks_follows_the_unfused_call(kernel, m: int, bits: int) -> None:  # type: ignore[no-untyped-def]
    """With the blocks the panels were rounded from, the argmax reads what
    bf16_q4_linear / bf16_q8_linear read: blocks of another weight move both
    alike up to blocks_max_rows rows, neither past them."""
    gen = torch.Generator().manual_seed(m + bits)
    n, k_in = 200, 576
    make, pack = (q4_weight, q4_blocks) if bits == 4 else (q8_weight, q8_blocks)
    w, other = make(n, k_in, gen), make(n, k_in, gen)
    blocks, other_blocks = pack(w, kernel), pack(other, kernel)
    assert blocks is not None and other_blocks is not None
    panels = kernel.pack_bf16(w)
    x = torch.randn(m, k_in, generator=gen)
    fused = kernel.bf16_linear_argmax(x, panels, n, blocks)
    assert torch.equal(fused, outputs_argmax(kernel, x, panels, n))
    moved = kernel.bf16_linear_argmax(x, panels, n, other_blocks)
    assert torch.equal(moved, outputs_argmax(kernel, x, panels, n, other_blocks))
    limit = kernel.blocks_max_rows()
    assert not torch.equal(moved, fused) if m <= limit else torch.equal(moved, fused)


def test_packed_linear_takes_its_argmax_only_on_the_bfloat16_decode_path(kernel) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(3)
    lin = nn.Linear(64, 40, bias=False)
    lin.weight.data = q8_weight(40, 64, gen)
    layer = PackedLinear(lin, kernel)
    x = torch.randn(5, 64, generator=gen)
    assert not layer.fuses_argmax(False)  # exact decodes: the float32 panels
    with pytest.raises(RuntimeError, match="argmax: not on this layer's path"):
        layer.argmax(x)
    rows = PromptRows()
    layer.enable_bf16_weights(rows)
    layer.prompt_rows = rows
    assert layer.fuses_argmax(False) and not layer.fuses_argmax(True)
    assert torch.equal(layer.argmax(x), layer.forward(x).argmax(-1))
    rows.runs = row_runs([(2, 1), (3, 0)])  # a prompt token's row: its exact path, not the panels
    with pytest.raises(RuntimeError, match="argmax: not on this layer's path"):
        layer.argmax(x)
    # prompt rows on the same panels (enable_bf16 too): one path, one argmax for the step
    layer.enable_bf16(rows)
    assert layer.fuses_argmax(True)
    assert torch.equal(layer.argmax(x), layer.forward(x).argmax(-1))
    rows.runs = ()
    biased = PackedLinear(nn.Linear(64, 40), kernel)
    biased.enable_bf16_weights(PromptRows())
    assert not biased.fuses_argmax(False)


def test_refused_on_amx_tiles(kernel) -> None:  # type: ignore[no-untyped-def]
    """Where AMX runs bf16_linear, the argmax (a vdpbf16ps kernel) is not
    offered and refuses to run: the head then writes its logits."""
    if not kernel.amx_supported():
        pytest.skip("this CPU lacks AMX (lscpu: no amx_bf16 / amx_tile): nothing to refuse")
    kernel.set_amx(True)
    try:
        assert not kernel.bf16_argmax_supported()
        with pytest.raises(RuntimeError, match="no argmax on AMX tiles"):
            kernel.bf16_linear_argmax(torch.randn(2, 64), kernel.pack_bf16(torch.randn(16, 64)), 16)
    finally:
        kernel.set_amx(False)
