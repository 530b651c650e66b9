"""The bfloat16-input kernels (decode_dtype=bfloat16): 4-bit (and the head's
8-bit) blocks times x rounded to bfloat16, exact products summed in float32
(AVX512-BF16 with AVX512-VBMI), and the split of a step's rows between them
and the prompt path."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from engine.layers.cpu_attention import load_linear_kernel
from engine.layers.cpu_features import has
from engine.layers.packed_linear import PackedLinear, PromptRows, q4_blocks, q8_blocks
from tests.unit.test_linear_isa import (
    assert_prompt_rows_on_bf16_panels,
    assert_rows_on_their_paths,
    packed_layers,
    product_case,
    q4_weight,
    q8_weight,
)

Q4BF16_CPU = all(has(f) for f in ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512vbmi"))
needs_cpu = pytest.mark.skipif(not Q4BF16_CPU, reason="the CPU lacks AVX512-BF16 or AVX512-VBMI "
                                                      "(q4bf16_linear refuses to run there)")


@pytest.fixture(scope="module")
def kernel():  # type: ignore[no-untyped-def]
    k = load_linear_kernel()
    assert k is not None, "the linear kernel must build on this machine"
    return k


def test_support_follows_the_cpu_flags(kernel) -> None:  # type: ignore[no-untyped-def]
    assert kernel.q4bf16_supported() == Q4BF16_CPU
    if not Q4BF16_CPU:
        blocks = q4_blocks(q4_weight(16, 64, torch.Generator().manual_seed(0)), kernel)
        with pytest.raises(RuntimeError, match="q4bf16_linear: this CPU lacks AVX512-BF16 or AVX512-VBMI"):
            kernel.q4bf16_linear(torch.randn(1, 64), blocks, 16)


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x rounded to bfloat16 (to nearest even) times the exact weights, in float64."""
    y = x.bfloat16().double() @ w.double().T
    return y if b is None else y + b.double()


# Rows around the kernel's tiles (2 and 4 rows: several panels at once; more:
# tiles of up to 8) and the 192-row chunk; columns that are and are not whole
# groups of 4 panels.
@needs_cpu
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 17, 33, 192, 193])
@pytest.mark.parametrize("k_in,n", [(64, 16), (64, 50), (96, 200), (576, 48)])
def test_q4bf16_linear_is_the_rounded_product(kernel, m: int, k_in: int, n: int) -> None:  # type: ignore[no-untyped-def]
    w, blocks, x, b = product_case(kernel, q4_weight, m, k_in, n, m * 1000 + n)
    y = kernel.q4bf16_linear(x, blocks, n, b)
    ref = reference(x, w, b)
    assert y.shape == (m, n) and y.dtype == torch.float32
    # float32 sums of exact products: far inside bfloat16's rounding of x
    scale = (x.bfloat16().double().abs() @ w.double().abs().T).max().item()
    assert (y.double() - ref).abs().max().item() <= 1e-5 * scale
    exact = kernel.q4_linear(x, blocks, n, b)
    assert not torch.equal(y, exact)  # x was rounded: not the exact kernel's result
    # x exact in bfloat16 already: the exact kernel's result to float32's precision
    xb = x.bfloat16().float()
    assert torch.allclose(kernel.q4bf16_linear(xb, blocks, n, b), kernel.q4_linear(xb, blocks, n, b),
                          rtol=1e-5, atol=1e-5 * scale)


@needs_cpu
@pytest.mark.parametrize("m", [1, 5, 12, 13, 16, 17, 32, 33, 40, 193])
@pytest.mark.parametrize("k_in,n", [(64, 16), (64, 50), (576, 200)])
def test_q8bf16_linear_is_the_rounded_product(kernel, m: int, k_in: int, n: int) -> None:  # type: ignore[no-untyped-def]
    """8-bit blocks (the head): each block adds d * sum(x q), q exact in bfloat16."""
    w, blocks, x, b = product_case(kernel, q8_weight, m, k_in, n, m * 1000 + n + 1)
    y = kernel.q8bf16_linear(x, blocks, n, b)
    scale = (x.bfloat16().double().abs() @ w.double().abs().T).max().item()
    assert (y.double() - reference(x, w, b)).abs().max().item() <= 1e-5 * scale
    assert not torch.equal(y, kernel.q8_linear(x, blocks, n, b))
    with pytest.raises(RuntimeError, match="q8bf16_linear: blocks must be uint8"):
        kernel.q8bf16_linear(x, q4_blocks(q4_weight(n, k_in, torch.Generator().manual_seed(m)), kernel), n)


@needs_cpu
def test_a_rows_result_does_not_depend_on_its_batch(kernel) -> None:  # type: ignore[no-untyped-def]
    """One row, a few (several panels at once) or many (tiles of rows): a
    row's bits are the same (4-bit layers and the 8-bit head)."""
    gen = torch.Generator().manual_seed(7)
    blocks = q4_blocks(q4_weight(200, 128, gen), kernel)
    head = q8_blocks(q8_weight(200, 128, gen), kernel)
    x = torch.randn(200, 128, generator=gen)
    for f, w in ((kernel.q4bf16_linear, blocks), (kernel.q8bf16_linear, head)):
        whole = f(x, w, 200)
        for lo, hi in ((0, 1), (1, 3), (5, 9), (17, 40), (3, 200), (199, 200), (0, 4), (0, 8), (3, 10),
                       (0, 12), (0, 13), (0, 16), (0, 17), (0, 32), (0, 33), (5, 21)):
            assert torch.equal(f(x[lo:hi], w, 200), whole[lo:hi]), (f, lo, hi)


@needs_cpu
def test_nan_and_inf_reach_only_their_rows(kernel) -> None:  # type: ignore[no-untyped-def]
    """A NaN or an infinity in x reaches its row's outputs, never a silent
    finite number, and no other row of the tile."""
    gen = torch.Generator().manual_seed(9)
    blocks = q4_blocks(q4_weight(48, 128, gen), kernel)
    x = torch.randn(8, 128, generator=gen)
    clean = kernel.q4bf16_linear(x, blocks, 48)
    x[2, 100], x[5, 7], x[6, 64] = float("nan"), float("inf"), -float("inf")
    y = kernel.q4bf16_linear(x, blocks, 48)
    for r in (2, 5, 6):
        assert not torch.isfinite(y[r]).any(), r
    assert torch.isnan(y[2]).all()
    keep = [0, 1, 3, 4, 7]
    assert torch.equal(y[keep], clean[keep])


@needs_cpu
def test_packed_linear_splits_rows_between_the_paths(kernel) -> None:  # type: ignore[no-untyped-def]
    """Generated rows through q4bf16_linear, prompt rows exact (or on the
    bfloat16 panels where prefill_dtype=bfloat16 is on too): each row equals
    what its path alone gives it."""
    layer, head = packed_layers(kernel, torch.Generator().manual_seed(3))
    rows = PromptRows()
    layer.enable_bf16_decodes(rows)
    assert layer.bf16_decodes and not layer.int8
    x = torch.randn(40, 96, generator=torch.Generator().manual_seed(4))
    dec = kernel.q4bf16_linear(x, layer.q4, 50, layer.bias)
    assert_rows_on_their_paths(layer, rows, x, dec, kernel.q4_linear(x, layer.q4, 50, layer.bias))
    assert_prompt_rows_on_bf16_panels(kernel, layer, rows, x, dec)
    head.enable_bf16_decodes(PromptRows())  # an 8-bit layer (the head) takes q8bf16_linear
    assert head.bf16_decodes and head.q8 is not None
    assert torch.equal(head.forward(x), kernel.q8bf16_linear(x, head.q8, 40))
    plain = PackedLinear(nn.Linear(64, 20), kernel)  # float32 panels: keeps its exact path
    plain.enable_bf16_decodes(PromptRows())
    assert not plain.bf16_decodes and plain.q4 is None and plain.q8 is None


def assert_fused_inputs_give_the_separate_calls_bits(  # type: ignore[no-untyped-def]
        kernel, m: int, make_weight, fused: str, plain: tuple[str, str]) -> None:
    """kernel.<fused>_norm_linear is <plain> (the 4- or 8-bit one, by the
    weight) of rms_norm (its residual updated the same way), <fused>_silu_linear
    of silu_and_mul: bit for bit, with and without a bias."""
    w, blocks, x, b = product_case(kernel, make_weight, m, 96, 50, m * 10 + 5)
    f = getattr(kernel, plain[0] if make_weight is q4_weight else plain[1])
    norm_linear = getattr(kernel, f"{fused}_norm_linear")
    silu_linear = getattr(kernel, f"{fused}_silu_linear")
    gen = torch.Generator().manual_seed(m)
    norm_w, stream = torch.randn(96, generator=gen), torch.randn(m, 96, generator=gen)
    for bias in (None, b):
        assert torch.equal(norm_linear(x, blocks, 50, norm_w, 1e-5, bias=bias),
                           f(kernel.rms_norm(x, norm_w, 1e-5), blocks, 50, bias))
        fused_stream, separate_stream = stream.clone(), stream.clone()
        fused_y = norm_linear(x, blocks, 50, norm_w, 1e-6, fused_stream, bias)
        separate = f(kernel.rms_norm(x, norm_w, 1e-6, separate_stream), blocks, 50, bias)
        assert torch.equal(fused_y, separate) and torch.equal(fused_stream, separate_stream)
        assert torch.equal(fused_stream, stream + x)  # the residual add happened, in place
        gate_up = torch.randn(m, 192, generator=gen)
        assert torch.equal(silu_linear(gate_up, blocks, 50, bias),
                           f(kernel.silu_and_mul(gate_up), blocks, 50, bias))


@needs_cpu
@pytest.mark.parametrize("m", [1, 3, 5, 32, 193])
@pytest.mark.parametrize("make_weight", [q4_weight, q8_weight])
def test_fused_inputs_give_the_separate_calls_bits(kernel, m: int, make_weight) -> None:  # type: ignore[no-untyped-def]
    """bf16_rows_norm_linear and bf16_rows_silu_linear at every row count."""
    assert_fused_inputs_give_the_separate_calls_bits(kernel, m, make_weight, "bf16_rows",
                                                     ("q4bf16_linear", "q8bf16_linear"))


def assert_fused_inputs_check_their_shapes(kernel, fused: str) -> None:  # type: ignore[no-untyped-def]
    """kernel.<fused>_norm_linear and <fused>_silu_linear refuse bad shapes, naming themselves."""
    blocks = q4_blocks(q4_weight(16, 64, torch.Generator().manual_seed(0)), kernel)
    x = torch.randn(2, 64)
    norm_linear = getattr(kernel, f"{fused}_norm_linear")
    silu_linear = getattr(kernel, f"{fused}_silu_linear")
    with pytest.raises(RuntimeError, match=f"{fused}_silu_linear: x has 64 features, want 128"):
        silu_linear(x, blocks, 16)
    with pytest.raises(RuntimeError, match=f"{fused}_norm_linear: weight must be a contiguous float32"):
        norm_linear(x, blocks, 16, torch.ones(63), 1e-5)
    with pytest.raises(RuntimeError, match=f"{fused}_norm_linear: residual must be"):
        norm_linear(x, blocks, 16, torch.ones(64), 1e-5, torch.zeros(3, 64))
    bad_blocks = rf"{fused}_norm_linear: blocks must be uint8 \[P, K/32, 384\] \(4-bit\)"
    with pytest.raises(RuntimeError, match=bad_blocks):
        norm_linear(x, blocks[:, :, :100], 16, torch.ones(64), 1e-5)


@needs_cpu
def test_fused_inputs_check_their_shapes(kernel) -> None:  # type: ignore[no-untyped-def]
    assert_fused_inputs_check_their_shapes(kernel, "bf16_rows")


def fused_case(kernel) -> tuple[PackedLinear, PromptRows, Callable[[], None]]:  # type: ignore[no-untyped-def]
    """A 4-bit layer (96 -> 50, with a bias), the PromptRows it is given, and a
    check that its forward_normed / forward_silu equal forward after the
    separate call (rms_norm, silu_and_mul) on 9 rows."""
    layer, _ = packed_layers(kernel, torch.Generator().manual_seed(5))
    gen = torch.Generator().manual_seed(6)
    x, norm_w = torch.randn(9, 96, generator=gen), torch.randn(96, generator=gen)
    gate_up = torch.randn(9, 192, generator=gen)

    def check() -> None:
        normed = kernel.rms_norm(x, norm_w, 1e-5)
        assert torch.equal(layer.forward_normed(x, norm_w, 1e-5), layer.forward(normed))
        assert torch.equal(layer.forward_silu(gate_up), layer.forward(kernel.silu_and_mul(gate_up)))

    return layer, PromptRows(), check


@needs_cpu
def test_packed_linear_fuses_only_on_its_bfloat16_decode_path(kernel) -> None:  # type: ignore[no-untyped-def]
    """forward_normed / forward_silu equal forward after the separate call, on
    every path: fused where every row is a generated token in bfloat16, the
    separate calls where prompt rows are in the step or decodes are exact."""
    layer, rows, check = fused_case(kernel)
    check()  # exact decodes: no fused kernel bound
    assert layer._fused_inputs is None
    layer.enable_bf16_decodes(rows)
    assert layer._fused_inputs is not None
    check()
    rows.runs = ((0, 4, True), (4, 9, False))  # a prompt's rows in the step: the separate calls
    check()
