"""The bfloat16 linear kernel (prefill_dtype=bfloat16, AVX512-BF16) and the
split of a step's rows between it and the exact path (PackedLinear)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.config import ModelConfig
from engine.layers.cpu_attention import load_linear_kernel
from engine.layers.packed_linear import PackedLinear, PromptRows, q8_blocks, row_runs
from kvtransfer.layout import KVLayout, LayoutMismatch, check_compatible
from tests.unit.test_linear_isa import assert_rows_on_their_paths, packed_layers, q4_weight, q8_weight
from tests.unit.test_linear_q4bf16 import fused_case


# Each test runs on both bfloat16 kernels where the CPU has them: vdpbf16ps
# (AVX512-BF16) and AMX tiles (amx_bf16, amx_tile; K a multiple of 32).
@pytest.fixture(scope="module", params=["vdpbf16ps", "amx"])
def kernel(request):  # type: ignore[no-untyped-def]
    k = load_linear_kernel()
    assert k is not None, "the linear kernel must build on this machine"
    if not k.bf16_supported():
        pytest.skip("this CPU lacks AVX512-BF16 (lscpu: no avx512_bf16), which bf16_linear needs")
    if request.param == "amx" and not k.amx_supported():
        pytest.skip("this CPU lacks AMX (lscpu: no amx_bf16 / amx_tile), which the AMX kernel needs")
    before = k.set_amx(request.param == "amx") if k.amx_supported() else None
    yield k
    if before is not None:
        k.set_amx(before)


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x and w rounded to bfloat16 (nearest even), products summed in float64."""
    y = x.bfloat16().double() @ w.bfloat16().double().T
    return y if b is None else y + b.double()


# Rows around the 12-row tile and the 192-row chunk; columns that are and are
# not whole panels and pairs of panels; inputs that are even but not a multiple of 32.
@pytest.mark.parametrize("m", [1, 4, 5, 11, 12, 13, 25, 191, 192, 193, 400])
@pytest.mark.parametrize("k_in,n", [(64, 16), (64, 33), (96, 200), (22, 7), (576, 48)])
def test_bf16_linear_is_the_bfloat16_product(kernel, m: int, k_in: int, n: int) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(m * 1000 + n)
    x, w = torch.randn(m, k_in, generator=gen), torch.randn(n, k_in, generator=gen)
    b = torch.randn(n, generator=gen)
    panels = kernel.pack_bf16(w)
    assert panels.dtype == torch.bfloat16 and panels.shape == ((n + 15) // 16, k_in // 2, 16, 2)
    # float32 sums of exact products: within a few float32 roundings of the float64 sum
    tol = 1e-5 * (x.bfloat16().double().abs() @ w.bfloat16().double().abs().T) + 1e-6
    for bias in (None, b):
        y = kernel.bf16_linear(x, panels, n, bias)
        assert y.dtype == torch.float32 and y.shape == (m, n)
        assert ((y.double() - reference(x, w, bias)).abs() <= tol).all()


def test_pack_bf16_holds_the_rounded_weight(kernel) -> None:  # type: ignore[no-untyped-def]
    w = torch.randn(37, 64)
    w[0, :4] = torch.tensor([1.00390625, 1.01171875, -3e38, 1e-40])  # ties to even, large, subnormal
    panels = kernel.pack_bf16(w)
    unpacked = panels.permute(0, 2, 1, 3).reshape(-1, 64)[:37]
    assert torch.equal(unpacked.view(torch.int16), w.bfloat16().view(torch.int16))
    assert not panels.permute(0, 2, 1, 3).reshape(-1, 64)[37:].float().any()  # the padding is zero


def test_a_rows_result_does_not_depend_on_its_batch(kernel) -> None:  # type: ignore[no-untyped-def]
    """Each output is one sum over the pairs in order, whatever the rows around it
    (the tile it falls in, the chunk, the thread): prompt rows keep batch invariance."""
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(230, 576, generator=gen), torch.randn(100, 576, generator=gen)
    panels = kernel.pack_bf16(w)
    whole = kernel.bf16_linear(x, panels, 100)
    for lo, hi in ((0, 1), (5, 6), (11, 14), (100, 137), (191, 230), (17, 29)):
        assert torch.equal(kernel.bf16_linear(x[lo:hi], panels, 100), whole[lo:hi])


def test_many_rows_and_panels_give_a_few_rows_bits(kernel) -> None:  # type: ignore[no-untyped-def]
    """A call of a chunk's rows or more on AMX takes 8 panels a task and K in
    passes (K of 576: two), its sums stored and loaded back between them;
    fewer rows take one pass.  Either way the same bits, with and without a
    bias, a last panel not whole, and gate and up gated in the same call."""
    gen = torch.Generator().manual_seed(45)
    x, w, b = torch.randn(400, 576, generator=gen), torch.randn(200, 576, generator=gen), torch.randn(200)
    panels = kernel.pack_bf16(w)
    tol = 1e-5 * (x.bfloat16().double().abs() @ w.bfloat16().double().abs().T) + 1e-6
    for bias in (None, b):
        whole = kernel.bf16_linear(x, panels, 200, bias)
        assert ((whole.double() - reference(x, w, bias)).abs() <= tol).all()
        for lo, hi in ((0, 1), (0, 40), (150, 191), (380, 400)):
            assert torch.equal(kernel.bf16_linear(x[lo:hi], panels, 200, bias), whole[lo:hi])
    # gate and up 144 outputs each: 9 panels, tasks of 8 and of 1
    gate_up = kernel.pack_bf16(torch.randn(288, 576, generator=gen))
    norm_w = torch.rand(576, generator=gen) + 0.5
    gated = kernel.bf16_norm_silu_linear(x, gate_up, None, 288, norm_w, 1e-6)
    assert gated.shape == (400, 144)
    assert torch.equal(gated, kernel.silu_and_mul(kernel.bf16_norm_linear(x, gate_up, None, 288, norm_w,
                                                                          1e-6)).to(gated.dtype))
    for lo, hi in ((0, 1), (0, 40), (150, 191), (380, 400)):
        assert torch.equal(kernel.bf16_norm_silu_linear(x[lo:hi], gate_up, None, 288, norm_w, 1e-6),
                           gated[lo:hi])


def test_out_writes_only_its_rows(kernel) -> None:  # type: ignore[no-untyped-def]
    x, w = torch.randn(9, 64), torch.randn(20, 64)
    panels, y = kernel.pack_bf16(w), torch.full((12, 20), 7.0)
    got = kernel.bf16_linear(x, panels, 20, out=y[2:11])
    assert got.data_ptr() == y[2:11].data_ptr()
    assert torch.equal(y[2:11], kernel.bf16_linear(x, panels, 20))
    assert (y[:2] == 7).all() and (y[11:] == 7).all()
    with pytest.raises(RuntimeError, match="out must be a contiguous"):
        kernel.bf16_linear(x, panels, 20, out=torch.empty(9, 21))
    with pytest.raises(RuntimeError, match="panels must be bfloat16"):
        kernel.bf16_linear(x, panels.float(), 20)


def test_nan_and_inf_inputs_come_out_nan_and_inf(kernel) -> None:  # type: ignore[no-untyped-def]
    w = torch.ones(16, 32)
    x = torch.zeros(3, 32)
    x[0, 3], x[1, 4] = float("nan"), float("inf")
    y = kernel.bf16_linear(x, kernel.pack_bf16(w), 16)
    assert y[0].isnan().all() and (y[1] == float("inf")).all() and (y[2] == 0).all()


def rounding_edges(n: int, gen: torch.Generator) -> torch.Tensor:
    """n float32 values at bfloat16's rounding edges (normal ones): bfloat16
    values, the ties between neighbours and the float32s either side of
    them, signs mixed."""
    b = (torch.randn(n, generator=gen) * 100).bfloat16().float()
    nxt = (b.view(torch.int32) + 0x10000).view(torch.float32)  # the next bfloat16 up (in magnitude)
    tie = ((b.double() + nxt.double()) / 2).float()
    bits = tie.view(torch.int32)
    pick = torch.randint(0, 4, (n,), generator=gen)
    edges = torch.stack([b, tie, (bits - 1).view(torch.float32), (bits + 1).view(torch.float32)])
    return edges[pick, torch.arange(n)]


# 64 and 96 inputs: whole groups of 16 pairs (and one more row of a tile); 22: a tail alone.
@pytest.mark.parametrize("k_in", [22, 64, 96])
@pytest.mark.parametrize("m", [1, 13])
def test_rows_round_to_nearest_even_as_torch_does(kernel, k_in: int, m: int) -> None:  # type: ignore[no-untyped-def]
    """Each input is rounded to bfloat16 as torch rounds it, ties to even, bit
    for bit (through the identity, each output is its input so rounded), a
    NaN a NaN and infinities infinite: the kernels' x in tiles of pairs, and
    the 8-bit blocks' rows (q8bf16_linear) where the CPU runs them."""
    gen = torch.Generator().manual_seed(k_in + m)
    x = rounding_edges(m * k_in, gen).view(m, k_in)
    eye = torch.eye(k_in)
    want = x.bfloat16().float()
    assert torch.equal(kernel.bf16_linear(x, kernel.pack_bf16(eye), k_in), want)
    if kernel.q4bf16_supported() and k_in % 32 == 0:
        blocks = q8_blocks(eye * 127, kernel)  # 8-bit blocks of d = 1, q = 127 (exact products)
        assert blocks is not None
        assert torch.equal(kernel.q8bf16_linear(x, blocks, k_in), want * 127)
    # A NaN whose low bits alone are set stays a NaN (not rounded up into an
    # infinity); infinities stay infinite: summed by a weight of ones.
    odd = torch.zeros(3, k_in)
    odd.view(torch.int32)[0, -1] = 0x7F800001
    odd.view(torch.int32)[1, 0] = -0x7FFFFF  # 0xFF800001: a NaN, sign set
    odd[2, k_in // 2] = float("-inf")
    y = kernel.bf16_linear(odd, kernel.pack_bf16(torch.ones(16, k_in)), 16)
    assert y[:2].isnan().all() and (y[2] == float("-inf")).all()


def test_row_runs() -> None:
    assert row_runs([]) == ()
    assert row_runs([(1, 0), (1, 0)]) == ()  # decodes only: no split
    assert row_runs([(1, 0), (1, 0), (40, 40)]) == ((0, 2, False), (2, 42, True))
    # a recompute after a preemption: its prompt, then its output tokens again
    runs = ((0, 1, False), (1, 21, True), (21, 31, False), (31, 39, True))
    assert row_runs([(1, 0), (30, 20), (8, 8)]) == runs
    assert row_runs([(5, 5), (3, 3)]) == ((0, 8, True),)


def test_packed_linear_splits_rows_between_the_paths(kernel) -> None:  # type: ignore[no-untyped-def]
    """Prompt rows through bfloat16 panels, the rest exact: each row equals what its
    path alone gives it."""
    gen = torch.Generator().manual_seed(3)
    lin = nn.Linear(96, 50)
    with torch.no_grad():
        lin.weight.copy_(q4_weight(50, 96, gen))
    layer = PackedLinear(lin, kernel)
    assert layer.q4 is not None
    rows = PromptRows()
    layer.enable_bf16(rows)
    x = torch.randn(40, 96, generator=gen)
    exact = layer.forward(x)  # no runs: every row exact
    bf = kernel.bf16_linear(x, layer.bf16, 50, layer.bias)
    rows.runs = row_runs([(1, 0), (1, 0), (20, 12), (18, 18)])
    mixed = layer.forward(x)
    for lo, hi, prompt in rows.runs:
        assert torch.equal(mixed[lo:hi], (bf if prompt else exact)[lo:hi])
    assert not torch.equal(bf[2:14], exact[2:14])  # the paths do differ
    rows.runs = ((0, 40, True),)
    assert torch.equal(layer.forward(x), bf)


def test_generated_rows_on_the_bf16_panels(kernel) -> None:  # type: ignore[no-untyped-def]
    """decode_dtype=bfloat16-weights: generated rows through the bfloat16 panels,
    prompt rows exact (or on the same panels, one copy, under prefill_dtype=
    bfloat16); a 4-bit layer, an 8-bit head and a plain float32 one alike."""
    gen = torch.Generator().manual_seed(5)
    layer, head = packed_layers(kernel, gen)
    plain = PackedLinear(nn.Linear(96, 30), kernel)
    assert plain.q4 is None and plain.q8 is None
    x = torch.randn(40, 96, generator=gen)
    for lin in (layer, head, plain):
        rows = PromptRows()
        exact = lin.forward(x)
        lin.enable_bf16_weights(rows)
        assert lin.bf16_weights and not lin.bf16_prompts
        bf = kernel.bf16_linear(x, lin.bf16, lin.out_features, lin.bias)
        w = lin.weight()
        tol = 1e-5 * (x.bfloat16().double().abs() @ w.bfloat16().double().abs().T) + 1e-6
        assert ((bf.double() - reference(x, w, lin.bias)).abs() <= tol).all()  # the weight rounded
        assert not torch.equal(bf, exact)  # the paths do differ
        assert_rows_on_their_paths(lin, rows, x, bf, exact)
        panels = lin.bf16
        lin.enable_bf16(rows)  # prefill_dtype=bfloat16 too: the same panels, every row on them
        assert lin.bf16 is panels and lin.bf16_prompts
        rows.runs = row_runs([(1, 0), (20, 12)])
        assert torch.equal(lin.forward(x[:21]), bf[:21])


# vdpbf16ps: one tile of x (12 rows) and past it; AMX: one row tile, two, and past them (the panels).
@pytest.mark.parametrize("m", [1, 3, 12, 13, 16, 17, 32, 33, 70])
def test_tiles_made_from_the_4bit_blocks_give_the_panels_bits(kernel, m: int) -> None:  # type: ignore[no-untyped-def]
    """decode_dtype=bfloat16-weights, a 4-bit layer: bf16_q4_linear makes
    each AMX tile (or vdpbf16ps's pairs) from the blocks the panels were
    rounded from (few rows), or runs the panels (more rows): bf16_linear's
    bits either way."""
    gen = torch.Generator().manual_seed(m)
    for n, k_in in ((200, 96), (48, 576), (7, 64)):
        lin = nn.Linear(k_in, n)
        lin.weight.data = q4_weight(n, k_in, gen)
        layer = PackedLinear(lin, kernel)
        assert layer.q4 is not None
        x = torch.randn(m, k_in, generator=gen)
        layer.enable_bf16_weights(PromptRows())
        panels = kernel.pack_bf16(layer.weight())
        assert torch.equal(layer.bf16, panels)
        for bias in (None, layer.bias):
            want = kernel.bf16_linear(x, panels, n, bias)
            assert torch.equal(kernel.bf16_q4_linear(x, panels, layer.q4, n, bias), want)
        assert torch.equal(layer.forward(x), kernel.bf16_linear(x, panels, n, layer.bias))
        assert_reads_blocks_up_to_its_rows(kernel, kernel.bf16_q4_linear, x, panels, layer.q4, n)


# vdpbf16ps: one tile of x (12 rows) and past it; AMX: one row tile, two, and past them (the panels).
@pytest.mark.parametrize("m", [1, 3, 12, 13, 16, 17, 32, 33, 70])
def test_tiles_made_from_the_8bit_blocks_give_the_panels_bits(kernel, m: int) -> None:  # type: ignore[no-untyped-def]
    """decode_dtype=bfloat16-weights, an 8-bit layer (the head): bf16_q8_linear
    makes each AMX tile (or vdpbf16ps's pairs) from the blocks the panels
    were rounded from (few rows), or runs the panels: bf16_linear's bits either way, through the
    layer's forward and its normed forward too, and with the norm and the
    SiLU of a Q8_0 model's projections."""
    gen = torch.Generator().manual_seed(m + 100)
    for n, k_in in ((200, 96), (40, 576), (7, 64)):
        lin = nn.Linear(k_in, n, bias=False)
        lin.weight.data = q8_weight(n, k_in, gen)
        layer = PackedLinear(lin, kernel)
        assert layer.q8 is not None and layer.q4 is None
        x, norm_w = torch.randn(m, k_in, generator=gen), torch.randn(k_in, generator=gen)
        layer.enable_bf16_weights(PromptRows())
        panels = kernel.pack_bf16(layer.weight())
        assert torch.equal(layer.bf16, panels)
        want = kernel.bf16_linear(x, panels, n)
        assert torch.equal(kernel.bf16_q8_linear(x, panels, layer.q8, n), want)
        assert_reads_blocks_up_to_its_rows(kernel, kernel.bf16_q8_linear, x, panels, layer.q8, n)
        assert torch.equal(layer.forward(x), want)
        normed = kernel.bf16_linear(kernel.rms_norm(x, norm_w, 1e-5, None), panels, n)
        assert torch.equal(layer.forward_normed(x, norm_w, 1e-5), normed)
    # An 8-bit gate and up projection and down projection (a Q8_0 model's),
    # gating their tiles of sums and their inputs as the panels do.
    gu, dn = (q8_layer(kernel, k_in, n, gen) for k_in, n in ((64, 96), (64, 32)))
    x, norm_w = torch.randn(m, 64, generator=gen), torch.randn(64, generator=gen)
    gated = kernel.bf16_norm_silu_linear(x, gu.bf16, gu.q8, 96, norm_w, 1e-5)
    assert torch.equal(gated, kernel.bf16_norm_silu_linear(x, gu.bf16, None, 96, norm_w, 1e-5))
    separate = kernel.silu_and_mul(kernel.bf16_norm_linear(x, gu.bf16, None, 96, norm_w, 1e-5))
    assert torch.equal(gated, separate.to(gated.dtype))
    gate_up = torch.randn(m, 128, generator=gen)
    assert torch.equal(kernel.bf16_silu_linear(gate_up, dn.bf16, dn.q8, 32),
                       kernel.bf16_linear(kernel.silu_and_mul(gate_up), dn.bf16, 32))
    with pytest.raises(RuntimeError, match="8-bit"):
        kernel.bf16_q8_linear(x, panels, kernel.pack_bf16(lin.weight.data)[:, :1].contiguous(), n)
    q4 = PackedLinear(nn.Linear(64, 16, bias=False), kernel)
    with pytest.raises(RuntimeError, match="4-bit"):
        kernel.bf16_q4_linear(x[:, :64], kernel.pack_bf16(q4.weight()), layer.q8, 16)


def assert_reads_blocks_up_to_its_rows(kernel, fn, x: torch.Tensor, panels: torch.Tensor,  # type: ignore[no-untyped-def]
                                       blocks: torch.Tensor, n: int) -> None:
    """fn (bf16_q4_linear or bf16_q8_linear) reads the blocks, not the panels,
    for x's rows up to kernel.blocks_max_rows() (AMX tiles, or vdpbf16ps pairs
    made from them with AVX512-VBMI), and the panels past them: a changed
    block moves the result only there."""
    limit = kernel.blocks_max_rows()
    if kernel.amx_supported() or kernel.q4bf16_supported():  # a path the CPU's flags allow must run
        assert limit > 0
    changed = blocks.clone()
    first_q = 2 * 16 * 4 if blocks.shape[-1] == 384 else 16 * 4  # after d and m (4-bit) or d (8-bit)
    changed[..., first_q] ^= 0x11  # column 0's q values of the block's first inputs
    moved = not torch.equal(fn(x, panels, changed, n), fn(x, panels, blocks, n))
    assert moved == (x.shape[0] <= limit), (x.shape[0], limit)


def q8_layer(kernel, k_in: int, n: int, gen: torch.Generator) -> PackedLinear:  # type: ignore[no-untyped-def]
    """An 8-bit layer k_in -> n without a bias, on its bfloat16 panels for generated rows."""
    lin = nn.Linear(k_in, n, bias=False)
    lin.weight.data = q8_weight(n, k_in, gen)
    layer = PackedLinear(lin, kernel)
    assert layer.q8 is not None
    layer.enable_bf16_weights(PromptRows())
    return layer


def test_the_flag_and_the_layout() -> None:
    with pytest.raises(ValueError, match="prefill_dtype"):
        ModelConfig(prefill_dtype="float16")
    base = dict(model_id="m", dtype="float32", kv_cache_dtype="float32", block_size=16, num_layers=2,
                num_kv_heads=1, head_dim=64)
    plain, bf = KVLayout(**base), KVLayout(**base, prefill_dtype="bfloat16")
    assert KVLayout.from_dict(base) == plain  # a peer that does not name it computed prompts in its dtype
    with pytest.raises(LayoutMismatch, match="prefill_dtype"):
        check_compatible(plain, bf)
    with pytest.raises(ValueError, match="prefill_dtype"):
        KVLayout(**base, prefill_dtype="float16")


def q4_layer(kernel, k_in: int, n: int, bias: bool, m: int,  # type: ignore[no-untyped-def]
             gen: torch.Generator) -> tuple[nn.Linear, PackedLinear, torch.Tensor, tuple[torch.Tensor, ...]]:
    """A 4-bit layer k_in -> n: the nn.Linear, its PackedLinear, its bfloat16
    panels, and m rows of x, a norm's weight and m rows of a residual stream."""
    w = q4_weight(n, k_in, gen)
    lin = nn.Linear(k_in, n, bias=bias)
    lin.weight.data = w
    layer = PackedLinear(lin, kernel)
    assert layer.q4 is not None
    inputs = (torch.randn(m, k_in, generator=gen), torch.randn(k_in, generator=gen),
              torch.randn(m, k_in, generator=gen))
    return lin, layer, kernel.pack_bf16(w), inputs


# Up to two AMX row tiles (tiles made from the 4-bit blocks), past them, and a prompt's rows.
@pytest.mark.parametrize("m", [1, 5, 16, 32, 33, 200])
def test_fused_norm_and_silu_give_the_separate_calls_bits(kernel, m: int) -> None:  # type: ignore[no-untyped-def]
    """decode_dtype=bfloat16-weights: bf16_norm_linear is bf16_q4_linear (blocks
    given) or bf16_linear of rms_norm, its residual updated the same way, and
    bf16_silu_linear of silu_and_mul: bit for bit, with and without a bias."""
    gen = torch.Generator().manual_seed(m + 7)
    k_in, n = 96, 50
    lin, layer, panels, (x, norm_w, stream) = q4_layer(kernel, k_in, n, True, m, gen)
    gate_up = torch.randn(m, 2 * k_in, generator=gen)
    for blocks in (layer.q4, None):
        for bias in (None, lin.bias.detach()):
            assert torch.equal(kernel.bf16_norm_linear(x, panels, blocks, n, norm_w, 1e-5, bias=bias),
                               kernel.bf16_linear(kernel.rms_norm(x, norm_w, 1e-5), panels, n, bias))
            fused_stream, separate_stream = stream.clone(), stream.clone()
            fused = kernel.bf16_norm_linear(x, panels, blocks, n, norm_w, 1e-6, fused_stream, bias)
            separate = kernel.bf16_linear(kernel.rms_norm(x, norm_w, 1e-6, separate_stream), panels, n, bias)
            assert torch.equal(fused, separate) and torch.equal(fused_stream, separate_stream)
            assert torch.equal(fused_stream, stream + x)  # the residual add happened, in place
            assert torch.equal(kernel.bf16_silu_linear(gate_up, panels, blocks, n, bias),
                               kernel.bf16_linear(kernel.silu_and_mul(gate_up), panels, n, bias))


def test_fused_norm_and_silu_check_their_shapes(kernel) -> None:  # type: ignore[no-untyped-def]
    panels = kernel.pack_bf16(torch.randn(16, 64))
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="bf16_silu_linear: x has 64 features, want 128"):
        kernel.bf16_silu_linear(x, panels, None, 16)
    with pytest.raises(RuntimeError, match="bf16_norm_linear: weight must be a contiguous float32"):
        kernel.bf16_norm_linear(x, panels, None, 16, torch.ones(63), 1e-5)
    with pytest.raises(RuntimeError, match="bf16_norm_linear: residual must be"):
        kernel.bf16_norm_linear(x, panels, None, 16, torch.ones(64), 1e-5, torch.zeros(3, 64))
    with pytest.raises(RuntimeError, match="bf16_norm_silu_linear: n must be even"):
        kernel.bf16_norm_silu_linear(x, kernel.pack_bf16(torch.randn(15, 64)), None, 15, torch.ones(64), 1e-5)
    bad_blocks = torch.zeros(1, 2, 100, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=r"bf16_norm_linear: blocks must be the panels' uint8 \[P, K/32"):
        kernel.bf16_norm_linear(x, panels, bad_blocks, 16, torch.ones(64), 1e-5)


def test_packed_linear_fuses_on_the_bfloat16_weights_path(kernel) -> None:  # type: ignore[no-untyped-def]
    """bfloat16-weights: forward_normed / forward_silu equal forward after the
    separate call, fused (one call) for generated rows, and for prompt rows
    too where they share the panels (prefill_dtype=bfloat16)."""
    layer, rows, check = fused_case(kernel)
    layer.enable_bf16_weights(rows)
    assert layer._fused_inputs is not None and layer._fused_now() is layer._fused_inputs
    check()
    rows.runs = ((0, 4, True), (4, 9, False))  # prompt rows on the exact path: the separate calls
    assert layer._fused_now() is None
    check()
    layer.enable_bf16(rows)  # prompts on the same panels: fused for every row
    assert layer._fused_now() is layer._fused_inputs
    check()
    rows.runs = ((0, 9, True),)
    check()


# Up to two AMX row tiles (tiles made from the 4-bit blocks), past them, a
# whole and a partial 192-row chunk.
@pytest.mark.parametrize("m", [1, 15, 16, 17, 32, 33, 200, 385])
def test_norm_silu_linear_gives_the_separate_calls_bits(kernel, m: int) -> None:  # type: ignore[no-untyped-def]
    """bf16_norm_silu_linear (gate and up in one weight) is silu_and_mul of
    bf16_norm_linear, its residual updated the same way, bit for bit (on AMX
    rounded to bfloat16 as the down projection rounds its input): gated tile
    by tile on either kernel; odd panel counts for gate and for up (3 each)
    and an unused half of the last row tile."""
    k_in, inter = 96, 48
    lin, layer, panels, (x, norm_w, stream) = q4_layer(kernel, k_in, 2 * inter, False, m,
                                                       torch.Generator().manual_seed(m + 11))
    for blocks in (layer.q4, None):
        gated_stream, separate_stream = stream.clone(), stream.clone()
        gated = kernel.bf16_norm_silu_linear(x, panels, blocks, 2 * inter, norm_w, 1e-6, gated_stream)
        separate = kernel.silu_and_mul(kernel.bf16_norm_linear(x, panels, blocks, 2 * inter, norm_w, 1e-6,
                                                               separate_stream))
        assert gated.shape == (m, inter)
        assert gated.dtype == (torch.bfloat16 if amx_on(kernel) else torch.float32)
        assert torch.equal(gated, separate.to(gated.dtype)) and torch.equal(gated_stream, separate_stream)
        assert torch.equal(gated_stream, stream + x)  # the residual add happened, in place
        no_residual = kernel.bf16_norm_linear(x, panels, blocks, 2 * inter, norm_w, 1e-5)
        assert torch.equal(kernel.bf16_norm_silu_linear(x, panels, blocks, 2 * inter, norm_w, 1e-5),
                           kernel.silu_and_mul(no_residual).to(gated.dtype))
    # Gate and up not in whole panels each (an output count the AMX path does not split): the two calls.
    odd = kernel.pack_bf16(lin.weight.data[:40])
    assert torch.equal(kernel.bf16_norm_silu_linear(x, odd, None, 40, norm_w, 1e-5),
                       kernel.silu_and_mul(kernel.bf16_norm_linear(x, odd, None, 40, norm_w, 1e-5)))


def amx_on(kernel) -> bool:  # type: ignore[no-untyped-def]
    """Whether the bfloat16 kernels run on AMX tiles now (the fixture's choice)."""
    if not kernel.amx_supported():
        return False
    on = kernel.set_amx(True)
    kernel.set_amx(on)
    return bool(on)


# Within a tile, whole tiles, a chunk and a tile more, a partial tile after whole chunks.
@pytest.mark.parametrize("m", [1, 15, 16, 17, 32, 33, 200, 385])
def test_bfloat16_rows_give_their_float32_copies_bits(kernel, m: int) -> None:  # type: ignore[no-untyped-def]
    """bf16_linear and bf16_q4_linear take bfloat16 rows (the gated rows of
    bf16_norm_silu_linear on AMX, read there as they are, the rows past the
    last whole tile from a tile of their own) and give the float32 copy's bits;
    so does the down projection of the gated rows against the separate calls'."""
    gen = torch.Generator().manual_seed(m + 19)
    k_in, n, inter = 96, 40, 96
    _, layer, panels, (x, norm_w, _) = q4_layer(kernel, k_in, n, False, m, gen)
    rows = x.bfloat16()
    plain = kernel.bf16_linear(rows.float(), panels, n)
    assert torch.equal(kernel.bf16_linear(rows, panels, n), plain)
    assert torch.equal(kernel.bf16_q4_linear(rows, panels, layer.q4, n), plain)
    # gate and up (K = 96) gated, then the down projection (K = inter, a multiple of 32: AMX where it runs)
    _, gate_up, gu_panels, _ = q4_layer(kernel, k_in, 2 * inter, False, m, gen)
    _, down, dn_panels, _ = q4_layer(kernel, inter, k_in, False, m, gen)
    for blocks in (gate_up.q4, None):
        gated = kernel.bf16_norm_silu_linear(x, gu_panels, blocks, 2 * inter, norm_w, 1e-5)
        separate = kernel.silu_and_mul(kernel.bf16_norm_linear(x, gu_panels, blocks, 2 * inter, norm_w, 1e-5))
        for down_blocks in (down.q4, None):
            want = kernel.bf16_linear(separate, dn_panels, k_in) if down_blocks is None else \
                kernel.bf16_q4_linear(separate, dn_panels, down_blocks, k_in)
            got = kernel.bf16_linear(gated, dn_panels, k_in) if down_blocks is None else \
                kernel.bf16_q4_linear(gated, dn_panels, down_blocks, k_in)
            assert torch.equal(got, want)


def test_packed_linear_gates_its_outputs_where_it_fuses(kernel) -> None:  # type: ignore[no-untyped-def]
    """forward_normed_silu is silu_and_mul(forward_normed(...)) where
    forward_normed fuses and the layer has no bias, and None (the residual
    untouched) on a step whose prompt rows take another path or for a layer
    with a bias."""
    k_in, inter = 96, 32
    gen = torch.Generator().manual_seed(3)
    lin, layer, _, (x, norm_w, stream) = q4_layer(kernel, k_in, 2 * inter, False, 9, gen)
    rows = PromptRows()
    assert layer.forward_normed_silu(x, norm_w, 1e-5) is None  # exact decodes: nothing fused
    layer.enable_bf16_weights(rows)
    a, b = stream.clone(), stream.clone()
    gated = layer.forward_normed_silu(x, norm_w, 1e-5, a)
    assert gated is not None
    assert torch.equal(gated, kernel.silu_and_mul(layer.forward_normed(x, norm_w, 1e-5, b)).to(gated.dtype))
    assert torch.equal(a, b)
    rows.runs = ((0, 4, True), (4, 9, False))  # prompt rows on the exact path
    untouched = stream.clone()
    assert layer.forward_normed_silu(x, norm_w, 1e-5, untouched) is None and torch.equal(untouched, stream)
    # Prompt rows alone on the panels (prefill_dtype=bfloat16), whatever the decodes' path.
    prompts = PackedLinear(lin, kernel)
    prompts.enable_bf16(rows)
    assert prompts.forward_normed_silu(x, norm_w, 1e-5) is None  # prompt and generated rows: two paths
    rows.runs = ((0, 9, True),)
    a, b = stream.clone(), stream.clone()
    gated = prompts.forward_normed_silu(x, norm_w, 1e-5, a)
    assert gated is not None
    assert torch.equal(gated, kernel.silu_and_mul(prompts.forward_normed(x, norm_w, 1e-5, b)).to(gated.dtype))
    assert torch.equal(a, b)
    rows.runs = ()
    biased = nn.Linear(k_in, 2 * inter)
    biased.weight.data = lin.weight.data
    with_bias = PackedLinear(biased, kernel)
    with_bias.enable_bf16_weights(rows)
    assert with_bias.forward_normed_silu(x, norm_w, 1e-5) is None
