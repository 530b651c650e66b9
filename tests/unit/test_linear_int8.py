"""The int8 linear kernels (decode_dtype=int8): 4-bit and 8-bit blocks times x
quantized to int8 per block of 32 inputs, their AVX512-VNNI and portable forms,
and the split of a step's rows between them and the prompt path (PackedLinear)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from engine.config import ModelConfig
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
from tests.unit.test_linear_q4bf16 import (
    assert_fused_inputs_check_their_shapes,
    assert_fused_inputs_give_the_separate_calls_bits,
)
from tests.unit.test_linear_q4bf16 import needs_cpu as needs_q4bf16

VNNI_CPU = all(has(f) for f in ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512vbmi"))


@pytest.fixture(scope="module")
def kernel():  # type: ignore[no-untyped-def]
    k = load_linear_kernel()
    assert k is not None, "the linear kernel must build on this machine"
    return k


@pytest.fixture
def restore_isa(kernel) -> Iterator[None]:  # type: ignore[no-untyped-def]
    before = kernel.isa()
    try:
        yield
    finally:
        kernel.set_isa(before)


def quantized(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> (the int8 values as floats, their scale, the blocks' exact sums),
    per block of 32 inputs [M, K/32, 32] / [M, K/32, 1], as the kernel quantizes."""
    xb = x.view(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return torch.round(xb * inv), amax / 127, xb.double().sum(-1, keepdim=True)


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's arithmetic in float64: each block adds d * dx * sum(q xq) + m * sum(x)."""
    n, k = w.shape
    w3 = w.view(n, k // 32, 32)
    m = w3.amin(-1)
    d = ((w3.amax(-1) - m) / 15).half().float()
    q = ((w3 - m[..., None]) / torch.where(d == 0, 1, d)[..., None]).round()
    xq, dx, sx = quantized(x)
    dots = torch.einsum("mbk,nbk->mnb", xq.double(), q.double())  # [M, N, K/32]
    y = (dots * (d.double()[None] * dx.double().squeeze(-1)[:, None])).sum(-1) + sx.squeeze(-1) @ m.double().T
    return y if b is None else y + b.double()


# Rows around the few-rows tiles (4, 16) and the decoded tiles (6) and the
# 192-row chunk; columns that are and are not whole groups of 4 panels.
@pytest.mark.parametrize("m", [1, 3, 4, 5, 16, 17, 25, 192, 193])
@pytest.mark.parametrize("k_in,n", [(64, 16), (64, 50), (96, 200), (576, 48)])
def test_q4i8_linear_is_the_int8_product(kernel, m: int, k_in: int, n: int) -> None:  # type: ignore[no-untyped-def]
    w, blocks, x, b = product_case(kernel, q4_weight, m, k_in, n, m * 1000 + n)
    y = kernel.q4i8_linear(x, blocks, n, b)
    ref = reference(x, w, b)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5), (y.double() - ref).abs().max()
    exact = kernel.q4_linear(x, blocks, n, b)
    assert not torch.equal(y, exact)  # x was quantized: not the exact kernel's result
    assert torch.allclose(y, exact, rtol=0.05, atol=0.05 * exact.abs().max().item())


@pytest.mark.parametrize("m", [1, 4, 5, 17, 193])
@pytest.mark.parametrize("k_in,n", [(64, 16), (64, 50), (576, 200)])
def test_q8i8_linear_is_the_int8_product(kernel, m: int, k_in: int, n: int) -> None:  # type: ignore[no-untyped-def]
    """8-bit blocks (the head): each block adds d * dx * sum(q xq), exact integers."""
    w, blocks, x, b = product_case(kernel, q8_weight, m, k_in, n, m * 1000 + n + 1)
    gen = torch.Generator().manual_seed(m)
    y = kernel.q8i8_linear(x, blocks, n, b)
    xq, dx, _ = quantized(x)
    ref = (xq * dx).view(m, k_in).double() @ w.double().T + b.double()
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5), (y.double() - ref).abs().max()
    assert not torch.equal(y, kernel.q8_linear(x, blocks, n, b))
    with pytest.raises(RuntimeError, match="q8i8_linear: blocks must be uint8"):
        kernel.q8i8_linear(x, q4_blocks(q4_weight(n, k_in, gen), kernel), n)


def test_every_instruction_set_and_vnni_compute_the_same_bits(kernel, restore_isa) -> None:  # type: ignore[no-untyped-def]
    """Integer sums are exact and every form folds them in the same order: the
    VNNI kernel (AVX-512 where the CPU has VNNI and VBMI) and the portable one of
    each set give the same bits."""
    assert kernel.i8_vnni_supported() == VNNI_CPU  # the CPU's flags, not the build's luck
    gen = torch.Generator().manual_seed(5)
    blocks = q4_blocks(q4_weight(200, 576, gen), kernel)
    head = q8_blocks(q8_weight(200, 576, gen), kernel)
    outs: dict[str, list[torch.Tensor]] = {}
    for name in kernel.supported_isas():
        kernel.set_isa(name)
        xs = [torch.randn(m, 576, generator=torch.Generator().manual_seed(m)) for m in (1, 4, 7, 16, 17, 40)]
        pairs = ((kernel.q4i8_linear, blocks), (kernel.q8i8_linear, head))
        outs[name] = [f(x, w, 200) for x in xs for f, w in pairs]
    first = next(iter(outs.values()))
    for name, ys in outs.items():
        assert all(torch.equal(a, b) for a, b in zip(ys, first, strict=True)), name
    if len(outs) == 1:
        pytest.skip(f"this CPU runs only {list(outs)}: one form compared with itself")


def test_a_rows_result_does_not_depend_on_its_batch(kernel) -> None:  # type: ignore[no-untyped-def]
    """Few rows read the blocks as they go, more rows decode them once first:
    either way a row's bits are the same (4-bit layers and the 8-bit head)."""
    gen = torch.Generator().manual_seed(7)
    blocks = q4_blocks(q4_weight(96, 128, gen), kernel)
    head = q8_blocks(q8_weight(96, 128, gen), kernel)
    x = torch.randn(200, 128, generator=gen)
    for f, w in ((kernel.q4i8_linear, blocks), (kernel.q8i8_linear, head)):
        whole = f(x, w, 96)
        for lo, hi in ((0, 1), (5, 9), (17, 40), (3, 200), (199, 200), (0, 16), (0, 17), (0, 32)):
            assert torch.equal(f(x[lo:hi], w, 96), whole[lo:hi]), (f, lo, hi)


def test_zero_blocks_nan_and_inf(kernel) -> None:  # type: ignore[no-untyped-def]
    """A block of zeros adds nothing (scale 0, no division by zero); a NaN or an
    infinity in x comes out NaN or infinite, never a silent finite number."""
    gen = torch.Generator().manual_seed(9)
    w = q4_weight(16, 64, gen)
    blocks = q4_blocks(w, kernel)
    x = torch.randn(3, 64, generator=gen)
    x[0, :32] = 0
    y = kernel.q4i8_linear(x, blocks, 16)
    assert torch.allclose(y.double(), reference(x, w), rtol=1e-5, atol=1e-5)
    x[1, 3], x[2, 40] = float("nan"), float("inf")
    y = kernel.q4i8_linear(x, blocks, 16)
    assert torch.isnan(y[1]).all() and not torch.isfinite(y[2]).any()
    assert torch.isfinite(y[0]).all()
    head = q8_blocks(q8_weight(16, 64, gen), kernel)  # no block sums there: the scale carries it
    y8 = kernel.q8i8_linear(x, head, 16)
    assert torch.isnan(y8[1]).all() and not torch.isfinite(y8[2]).any() and torch.isfinite(y8[0]).all()


@pytest.mark.parametrize("name", ["q4i8_linear", pytest.param("q4bf16_linear", marks=needs_q4bf16)])
def test_out_writes_only_its_rows_and_bad_input_is_refused(kernel, name: str) -> None:  # type: ignore[no-untyped-def]
    """The int8 kernel and decode_dtype=bfloat16's (tests/unit/test_linear_q4bf16.py)."""
    f = getattr(kernel, name)
    gen = torch.Generator().manual_seed(11)
    w = q4_weight(40, 64, gen)
    blocks = q4_blocks(w, kernel)
    x = torch.randn(6, 64, generator=gen)
    y = torch.full((10, 40), 7.0)
    f(x, blocks, 40, out=y[2:8])
    assert torch.equal(y[2:8], f(x, blocks, 40))
    assert (y[:2] == 7).all() and (y[8:] == 7).all()
    with pytest.raises(RuntimeError, match=f"{name}: x has 32 features, the weight 64"):
        f(torch.randn(2, 32), blocks, 40)
    with pytest.raises(RuntimeError, match=f"{name}: float32 activations only"):
        f(x.double(), blocks, 40)
    with pytest.raises(RuntimeError, match=f"{name}: blocks must be uint8"):
        f(x, blocks.float(), 40)
    with pytest.raises(RuntimeError, match=f"{name}: N does not match the panels"):
        f(x, blocks, 80)


def test_packed_linear_splits_rows_between_the_paths(kernel) -> None:  # type: ignore[no-untyped-def]
    """Generated rows through the int8 kernel, prompt rows exact (or bfloat16
    where both are on): each row equals what its path alone gives it."""
    layer, head = packed_layers(kernel, torch.Generator().manual_seed(3))
    rows = PromptRows()
    layer.enable_int8(rows)
    assert layer.int8
    x = torch.randn(40, 96, generator=torch.Generator().manual_seed(4))
    int8 = kernel.q4i8_linear(x, layer.q4, 50, layer.bias)
    exact = kernel.q4_linear(x, layer.q4, 50, layer.bias)
    assert_rows_on_their_paths(layer, rows, x, int8, exact)
    rows.runs = ((0, 40, True),)
    assert torch.equal(layer.forward(x), exact)
    if kernel.bf16_supported():  # both options: prompt rows bfloat16, the others int8
        assert_prompt_rows_on_bf16_panels(kernel, layer, rows, x, int8)
    # an 8-bit layer (the head) takes q8i8_linear; one of float32 panels keeps its exact path
    head.enable_int8(PromptRows())
    assert head.int8 and head.q8 is not None
    assert torch.equal(head.forward(x), kernel.q8i8_linear(x, head.q8, 40))
    plain = PackedLinear(nn.Linear(64, 20), kernel)
    plain.enable_int8(PromptRows())
    assert not plain.int8 and plain.q4 is None and plain.q8 is None


@pytest.mark.parametrize("m", [1, 3, 5, 32, 193])
@pytest.mark.parametrize("make_weight", [q4_weight, q8_weight])
def test_fused_inputs_give_the_separate_calls_bits(  # type: ignore[no-untyped-def]
        kernel, m: int, make_weight) -> None:
    """int8_norm_linear and int8_silu_linear at every row count."""
    assert_fused_inputs_give_the_separate_calls_bits(kernel, m, make_weight, "int8",
                                                     ("q4i8_linear", "q8i8_linear"))


def test_fused_inputs_check_their_shapes(kernel) -> None:  # type: ignore[no-untyped-def]
    assert_fused_inputs_check_their_shapes(kernel, "int8")


def test_packed_linear_fuses_the_norm_and_gate_into_its_int8_rows(kernel) -> None:  # type: ignore[no-untyped-def]
    """On the int8 path, a step of generated rows only norms (or gates) each
    row as it is quantized: forward_normed and forward_silu give the separate
    calls' bits and take the fused kernels."""
    layer, _ = packed_layers(kernel, torch.Generator().manual_seed(5))
    layer.enable_int8(PromptRows())
    gen = torch.Generator().manual_seed(6)
    x, norm_w = torch.randn(20, 96, generator=gen), torch.randn(96, generator=gen)
    stream = torch.randn(20, 96, generator=gen)
    assert layer._fused_now() is not None
    separate_stream = stream.clone()
    assert torch.equal(layer.forward_normed(x, norm_w, 1e-5, stream),
                       kernel.q4i8_linear(kernel.rms_norm(x, norm_w, 1e-5, separate_stream), layer.q4, 50,
                                          layer.bias))
    assert torch.equal(stream, separate_stream)
    gate_up = torch.randn(20, 192, generator=gen)
    assert torch.equal(layer.forward_silu(gate_up),
                       kernel.q4i8_linear(kernel.silu_and_mul(gate_up), layer.q4, 50, layer.bias))


def test_the_option_is_named_when_wrong() -> None:
    with pytest.raises(ValueError, match="decode_dtype: must be one of auto, int8, bfloat16, "
                                         "bfloat16-weights, got 'int4'"):
        ModelConfig(decode_dtype="int4")
