"""The linear kernels on every instruction set (scalar, AVX2, AVX-512): each
path this CPU runs is compared with torch and, bit for bit, with the others;
a path whose instructions the CPU lacks is skipped, saying so."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.cpu_attention import load_linear_kernel
from engine.layers.packed_linear import PackedLinear, PromptRows, q4_blocks, q8_blocks, row_runs

ISAS = ("scalar", "avx2", "avx512")


@pytest.fixture(scope="module")
def kernel():  # type: ignore[no-untyped-def]
    k = load_linear_kernel()
    assert k is not None, "the linear kernel must build on this machine"
    return k


@pytest.fixture(params=ISAS)
def isa(request, kernel) -> Iterator[str]:  # type: ignore[no-untyped-def]
    name = request.param
    if name not in kernel.supported_isas():
        pytest.skip(f"this CPU lacks the {name} instructions (it runs {kernel.supported_isas()})")
    before = kernel.isa()
    kernel.set_isa(name)
    try:
        yield name
    finally:
        kernel.set_isa(before)


def q4_weight(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """A weight as GGUF Q4_1 dequantizes: d * q + m per 32 inputs, d and m float16."""
    d = (torch.rand(n, k // 32, 1, generator=gen) * 0.1).half().float()
    m = (torch.randn(n, k // 32, 1, generator=gen) * 0.1).half().float()
    q = torch.randint(0, 16, (n, k // 32, 32), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15  # the quantizer puts each block's min at 0 and max at 15
    return (d * q + m).reshape(n, k)


def q8_weight(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """A weight as GGUF Q8_0 dequantizes: d * q per 32 inputs, |q| <= 127 with 127 reached."""
    d = (torch.rand(n, k // 32, 1, generator=gen) * 0.01).half().float()
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=gen).float()
    q[..., 0] = 127 * torch.where(torch.rand(n, k // 32, generator=gen) < 0.5, -1.0, 1.0)
    return (d * q).reshape(n, k)


def packed_layers(kernel, gen: torch.Generator) -> tuple[PackedLinear, PackedLinear]:  # type: ignore[no-untyped-def]
    """A 4-bit projection (96 -> 50, with a bias) and an 8-bit one without (96 -> 40,
    as the head), packed: the layers the decode-dtype options split rows for."""
    lin, lin8 = nn.Linear(96, 50), nn.Linear(96, 40, bias=False)
    with torch.no_grad():
        lin.weight.copy_(q4_weight(50, 96, gen))
        lin8.weight.copy_(q8_weight(40, 96, gen))
    return PackedLinear(lin, kernel), PackedLinear(lin8, kernel)


def assert_rows_on_their_paths(layer: PackedLinear, rows: PromptRows, x: torch.Tensor,
                               generated: torch.Tensor, exact: torch.Tensor) -> None:
    """With no prompt run every row is a generated one; with runs, each row equals
    what its path alone gives it (generated rows `generated`, prompt rows `exact`)."""
    assert torch.equal(layer.forward(x), generated)  # no runs: no prompt row
    rows.runs = row_runs([(1, 0), (1, 0), (20, 12), (18, 18)])
    mixed = layer.forward(x)
    for lo, hi, prompt in rows.runs:
        assert torch.equal(mixed[lo:hi], (exact if prompt else generated)[lo:hi])


def assert_prompt_rows_on_bf16_panels(kernel, layer: PackedLinear, rows: PromptRows,  # type: ignore[no-untyped-def]
                                      x: torch.Tensor, generated: torch.Tensor) -> None:
    """prefill_dtype=bfloat16 on too: prompt rows on the bfloat16 panels, the others as before."""
    layer.enable_bf16(rows)
    bf = kernel.bf16_linear(x, layer.bf16, layer.out_features, layer.bias)
    rows.runs = row_runs([(3, 0), (37, 30)])
    mixed = layer.forward(x)
    assert torch.equal(mixed[:3], generated[:3]) and torch.equal(mixed[3:33], bf[3:33])
    assert torch.equal(mixed[33:], generated[33:])


def product_case(kernel, make_weight, m: int, k_in: int, n: int,  # type: ignore[no-untyped-def]
                 seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A quantized weight (q4_weight or q8_weight) of n x k_in, its blocks, m rows
    of x and a bias, all from `seed`: (w, blocks, x, bias)."""
    gen = torch.Generator().manual_seed(seed)
    w = make_weight(n, k_in, gen)
    blocks = (q4_blocks if make_weight is q4_weight else q8_blocks)(w, kernel)
    assert blocks is not None
    return w, blocks, torch.randn(m, k_in, generator=gen), torch.randn(n, generator=gen)


# Rows around the wide (several panels at once) and the per-row-block kernels,
# columns that are and are not whole panels and groups of panels.
ROWS = (1, 2, 3, 4, 5, 13, 200)
SHAPES = ((64, 16), (96, 50), (128, 200), (576, 1536))


@pytest.mark.parametrize("n_in,n_out", SHAPES)
def test_every_format_matches_torch_and_is_exact_across_formats(kernel, isa: str, n_in: int,
                                                                n_out: int) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(n_in * 7 + n_out)
    for w in (q4_weight(n_out, n_in, gen), q8_weight(n_out, n_in, gen)):
        panels = kernel.pack_weight(w)
        q4, q8 = q4_blocks(w, kernel), q8_blocks(w, kernel)
        assert (q4 is None) != (q8 is None), "each test weight is exactly one of the formats"
        bias = torch.randn(n_out, generator=gen)
        for m in ROWS:
            x = torch.randn(m, n_in, generator=gen)
            y = kernel.packed_linear(x, panels, n_out, bias)
            torch.testing.assert_close(y, F.linear(x, w, bias), rtol=1e-4, atol=1e-4)
            if q4 is not None:  # factored sums: close to torch, and a row's result is its own
                y4 = kernel.q4_linear(x, q4, n_out, bias)
                torch.testing.assert_close(y4, F.linear(x, w, bias), rtol=1e-4, atol=1e-4)
                for i in (0, m // 2, m - 1):
                    assert torch.equal(kernel.q4_linear(x[i:i + 1], q4, n_out, bias)[0], y4[i]), \
                        f"q4, row {i} of {m} differs alone, {isa}"
            if q8 is not None:  # bit for bit: the same weights, the same order of sums
                assert torch.equal(kernel.q8_linear(x, q8, n_out, bias), y), f"q8, {m} rows, {isa}"


def test_q4_rows_are_their_own_around_the_span_and_tile_switches(kernel, isa: str) -> None:  # type: ignore[no-untyped-def]
    """Many rows read 4-bit panels decoded in spans (up to 64 rows, csrc/
    linear_isa.h's Q4F_SPAN_ROWS) or whole (more): every row's bits are its
    own alone, across row tiles, spans with a short last one (18 blocks of 32
    inputs) and panels left over."""
    gen = torch.Generator().manual_seed(11)
    w = q4_weight(200, 576, gen)
    q4 = q4_blocks(w, kernel)
    assert q4 is not None
    for m in (6, 7, 12, 13, 32, 64, 65):
        x = torch.randn(m, 576, generator=gen)
        y = kernel.q4_linear(x, q4, 200)
        torch.testing.assert_close(y, F.linear(x, w), rtol=1e-4, atol=1e-4)
        for i in range(m):
            assert torch.equal(kernel.q4_linear(x[i:i + 1], q4, 200)[0], y[i]), f"row {i} of {m}, {isa}"


def test_q4_few_rows_keep_their_bits_on_every_set_for_tiny_and_huge_inputs(kernel) -> None:  # type: ignore[no-untyped-def]
    """One or two rows of a 4-bit layer may read x pre-scaled by powers of two
    (AVX2: csrc/linear_isa.h, q4_prescale), exact only while the scaled values
    stay normal: inputs near the bottom of float32's range (subnormal, and
    normal ones that would scale below it), huge ones and zeros give every set
    the scalar kernel's bits."""
    gen = torch.Generator().manual_seed(17)
    w = q4_weight(96, 576, gen)
    q4 = q4_blocks(w, kernel)
    assert q4 is not None
    cases = []
    for special in (1e-40, 3e-31, 2.0 ** -100, 1e30, 0.0):
        x = torch.randn(2, 576, generator=gen)
        x[:, 1::8] = special  # inputs that are scaled (k % 8 == 1: by 2^-8) ...
        x[:, 3::16] = -special  # ... (k % 8 == 3: by 2^-24)
        cases += [x[:1], x]
    before = kernel.isa()
    try:
        kernel.set_isa("scalar")
        want = [kernel.q4_linear(x, q4, 96) for x in cases]
        for name in kernel.supported_isas():
            kernel.set_isa(name)
            for x, y in zip(cases, want, strict=True):
                assert torch.equal(kernel.q4_linear(x, q4, 96), y), f"{name}, {x.shape[0]} rows, x {x[0, 1]}"
    finally:
        kernel.set_isa(before)


def test_silu_and_mul_matches_torch_on_every_set(kernel, isa: str) -> None:  # type: ignore[no-untyped-def]
    """The MLP's silu(gate) * up, as wide as the set's vectors: close to torch,
    and an element's bits do not depend on its lane or on falling in the tail."""
    gate_up = torch.randn(9, 2 * 75, generator=torch.Generator().manual_seed(5)) * 6  # a tail at every width
    gate_up[0, :8] = torch.tensor([-200.0, -88.0, -20.0, -0.0, 0.0, 1e-30, 30.0, 200.0])  # exp's ends
    gate, up = gate_up.chunk(2, dim=-1)
    out = kernel.silu_and_mul(gate_up)
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=1e-5, atol=1e-5)
    shifted = kernel.silu_and_mul(torch.cat([gate[:, 5:], up[:, 5:]], dim=-1))
    assert torch.equal(shifted, out[:, 5:]), isa


def test_every_instruction_set_computes_the_same_bits(kernel) -> None:  # type: ignore[no-untyped-def]
    """A step's tokens never depend on the machine's kernel family: every set
    this CPU runs gives the same float32 results, for every format."""
    isas = kernel.supported_isas()
    if len(isas) < 2:
        pytest.skip(f"this CPU runs only {isas}: nothing to compare")
    gen = torch.Generator().manual_seed(3)
    w4, w8 = q4_weight(200, 576, gen), q8_weight(200, 576, gen)
    p4, p8 = kernel.pack_weight(w4), kernel.pack_weight(w8)
    b4, b8 = q4_blocks(w4, kernel), q8_blocks(w8, kernel)
    results: dict[str, list[torch.Tensor]] = {}
    before = kernel.isa()
    try:
        for name in isas:
            kernel.set_isa(name)
            results[name] = [f(torch.randn(m, 576, generator=torch.Generator().manual_seed(m)))
                             for m in ROWS
                             for f in (lambda x: kernel.packed_linear(x, p4, 200),
                                       lambda x: kernel.q4_linear(x, b4, 200),
                                       lambda x: kernel.packed_linear(x, p8, 200),
                                       lambda x: kernel.q8_linear(x, b8, 200),
                                       lambda x: kernel.silu_and_mul(x * 4),
                                       lambda x: kernel.silu_and_mul(x[:, :150] * 4))]
    finally:
        kernel.set_isa(before)
    first = isas[0]
    for name in isas[1:]:
        for a, b in zip(results[first], results[name], strict=True):
            assert torch.equal(a, b), f"{name} differs from {first}"


def test_the_best_set_is_picked_and_unknown_sets_are_refused(kernel) -> None:  # type: ignore[no-untyped-def]
    from engine.layers.cpu_features import has

    expect = ("avx512" if has("avx512f") and has("avx512bw") and has("avx512vl")
              else "avx2" if has("avx2") and has("fma") else "scalar")
    assert expect in kernel.supported_isas()
    if not os.environ.get("SPLITSERVE_LINEAR_ISA"):  # the override picks its own
        assert kernel.isa() == expect
    with pytest.raises(RuntimeError, match="not one of"):
        kernel.set_isa("sse9")
    missing = [name for name in ISAS if name not in kernel.supported_isas()]
    for name in missing:
        with pytest.raises(RuntimeError, match="lacks"):
            kernel.set_isa(name)


def test_q8_blocks_refuse_what_is_not_8_bit(kernel) -> None:  # type: ignore[no-untyped-def]
    assert q8_blocks(torch.randn(32, 64), kernel) is None  # arbitrary floats
    assert q8_blocks(torch.randn(32, 48), kernel) is None  # inputs not a multiple of 32
    w = q8_weight(16, 64, torch.Generator().manual_seed(1))
    w[3, 5] += 1e-4  # one weight off the grid
    assert q8_blocks(w, kernel) is None
