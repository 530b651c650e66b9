"""The packed float32 linear kernel (engine/layers/csrc/linear_cpu.cpp) that the
engine's projections and head run through on CPUs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.cpu_attention import load_linear_kernel
from engine.models.llama import PackedLinear
from tests.unit.test_linear_isa import q4_weight


@pytest.fixture(scope="module")
def kernel():  # type: ignore[no-untyped-def]
    k = load_linear_kernel()
    assert k is not None, "the linear kernel must build on this machine"
    return k


# Row counts around the 6-row micro-kernel and the 192-row chunk; column counts
# that are and are not a multiple of the 16-wide panel.
@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 13, 191, 192, 193, 400])
@pytest.mark.parametrize("k_in,n", [(64, 16), (64, 33), (96, 200), (24, 7)])
def test_packed_linear_matches_torch(kernel, m: int, k_in: int, n: int) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k_in, generator=gen)
    w = torch.randn(n, k_in, generator=gen)
    b = torch.randn(n, generator=gen)
    panels = kernel.pack_weight(w)
    assert panels.shape == ((n + 15) // 16, k_in, 16)
    torch.testing.assert_close(kernel.packed_linear(x, panels, n), F.linear(x, w), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kernel.packed_linear(x, panels, n, b), F.linear(x, w, b), rtol=1e-4, atol=1e-4)


def test_packed_linear_keeps_leading_dims_and_takes_no_rows(kernel) -> None:  # type: ignore[no-untyped-def]
    w = torch.randn(40, 32)
    panels = kernel.pack_weight(w)
    x = torch.randn(2, 3, 32)
    y = kernel.packed_linear(x, panels, 40)
    assert y.shape == (2, 3, 40)
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-4, atol=1e-4)
    assert kernel.packed_linear(torch.empty(0, 32), panels, 40).shape == (0, 40)
    # a non-contiguous input (a column slice) is read correctly
    xs = torch.randn(5, 64)[:, 16:48]
    torch.testing.assert_close(kernel.packed_linear(xs, panels, 40), F.linear(xs, w), rtol=1e-4, atol=1e-4)


def test_bad_shapes_and_dtypes_are_clear_errors(kernel) -> None:  # type: ignore[no-untyped-def]
    panels = kernel.pack_weight(torch.randn(40, 32))
    with pytest.raises(RuntimeError, match="features"):
        kernel.packed_linear(torch.randn(2, 31), panels, 40)
    with pytest.raises(RuntimeError, match="float32"):
        kernel.packed_linear(torch.randn(2, 32, dtype=torch.float64), panels, 40)
    with pytest.raises(RuntimeError, match="N does not match"):
        kernel.packed_linear(torch.randn(2, 32), panels, 60)
    with pytest.raises(RuntimeError, match="float32"):
        kernel.pack_weight(torch.randn(4, 4, dtype=torch.bfloat16))


def test_packed_linear_module_replaces_nn_linear(kernel) -> None:  # type: ignore[no-untyped-def]
    lin = nn.Linear(48, 70, bias=True)
    packed = PackedLinear(lin, kernel)
    x = torch.randn(9, 48)
    with torch.no_grad():
        torch.testing.assert_close(packed(x), lin(x), rtol=1e-4, atol=1e-4)
    assert packed.out_features == 70 and packed.bias is lin.bias


def test_the_loaded_model_runs_packed_and_agrees_with_the_plain_one(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """On CPUs in float32 the engine's model runs every projection and the head
    through the kernel, and computes what the plain torch layers compute."""
    import engine.model_runner as model_runner
    from engine.models.loader import resolve_model

    model_dir = resolve_model(None)
    packed = model_runner.load_model(model_dir, torch.float32, torch.device("cpu"))
    assert isinstance(packed.lm_head, PackedLinear)
    assert all(isinstance(getattr(layer, name), PackedLinear) for layer in packed.layers
               for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    monkeypatch.setattr(model_runner, "load_linear_kernel", lambda: None)
    plain = model_runner.load_model(model_dir, torch.float32, torch.device("cpu"))
    assert isinstance(plain.lm_head, nn.Linear)
    hidden = torch.randn(3, packed.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = packed.compute_logits(hidden), plain.compute_logits(hidden)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        x = hidden[:2]
        for name in ("qkv_proj", "gate_up_proj"):
            torch.testing.assert_close(getattr(packed.layers[3], name)(x), getattr(plain.layers[3], name)(x),
                                       rtol=1e-4, atol=1e-4)
    # what the engine runs is exactly the plain weights, packed (from the cache or not): the
    # projections as 4-bit blocks alone (no float32 panels beside them), the 8-bit head with its panels
    for path in ("layers.0.qkv_proj", "layers.29.down_proj"):
        layer = packed.get_submodule(path)
        assert layer.q4 is not None and layer.panels is None
        assert torch.equal(layer.weight(), plain.get_submodule(path).weight.detach())
    weight = plain.lm_head.weight.detach()
    assert packed.lm_head.q8 is not None
    assert torch.equal(packed.lm_head.panels, packed.lm_head.kernel.pack_weight(weight))


def test_packed_weights_are_cached_and_a_bad_cache_is_rebuilt(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import engine.model_runner as model_runner
    from engine.models.loader import resolve_model

    cache = tmp_path / "packed.pt"
    monkeypatch.setattr(model_runner, "packed_cache_path", lambda *_: cache)
    model_dir = resolve_model(None)
    first = model_runner.load_model(model_dir, torch.float32, torch.device("cpu"))
    assert cache.exists()
    cached = model_runner.load_packed(cache)
    assert cached is not None and set(cached) == set(first.packed_panels())
    assert all(path in cached or f"{path}#q4" in cached for path in first.linear_names())
    second = model_runner.load_model(model_dir, torch.float32, torch.device("cpu"))
    assert torch.equal(second.layers[7].gate_up_proj.q4, first.layers[7].gate_up_proj.q4)
    cache.write_bytes(b"not a torch file")
    third = model_runner.load_model(model_dir, torch.float32, torch.device("cpu"))
    assert torch.equal(third.lm_head.panels, first.lm_head.panels)
    assert model_runner.load_packed(cache) is not None  # rewritten


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_fused_rms_norm_matches_the_module(kernel, rows: int) -> None:  # type: ignore[no-untyped-def]
    from engine.models.llama import RMSNorm

    norm = RMSNorm(96, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96))
        x, r = torch.randn(rows, 96), torch.randn(rows, 96)
        torch.testing.assert_close(kernel.rms_norm(x, norm.weight, norm.eps), norm(x), rtol=1e-5, atol=1e-5)
        residual = r.clone()
        out = kernel.rms_norm(x, norm.weight, norm.eps, residual)
        torch.testing.assert_close(residual, r + x)  # the residual stream is updated in place
        torch.testing.assert_close(out, norm(r + x), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="weight has"):
        kernel.rms_norm(x, torch.ones(95), 1e-5)


@pytest.mark.parametrize("cache_dtype",
                         [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn,
                          torch.float8_e5m2])
def test_fused_rope_and_kv_store_match_the_torch_ops(kernel, cache_dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    """A bfloat16, float16 or fp8 cache (--kv-cache-dtype) holds exactly what write_kv
    stores (torch's rounding to nearest even; fp8 saturated at its largest
    finite value); q and k come back in float32, unrounded, either way."""
    from engine.layers.attention import write_kv
    from engine.models.llama import apply_rope

    t, hq, hkv, d, bs = 5, 6, 2, 16, 4
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen)
    qkv[0, -4:] = torch.tensor([1e4, -1e4, 0.0, -0.0])  # v past fp8's range (saturates) and signed zeros
    ang = torch.randn(t, 1, d // 2, generator=gen)
    cos, sin = ang.cos(), ang.sin()
    slots = torch.tensor([13, 2, 7, 30, 0])
    layer = 1
    cache = torch.zeros(8, 3, 2, bs, hkv, d, dtype=cache_dtype)
    q, k = kernel.rope_and_store_kv(qkv, cos, sin, cache, layer, slots, hq, hkv)
    assert q.dtype == k.dtype == torch.float32
    rq, rk, rv = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    rq, rk = apply_rope(rq.view(t, hq, d), cos, sin), apply_rope(rk.view(t, hkv, d), cos, sin)
    expected = torch.zeros_like(cache)
    write_kv(expected, layer, rk, rv.reshape(t, hkv, d), slots)
    torch.testing.assert_close(q, rq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, rk, rtol=1e-5, atol=1e-5)
    if cache_dtype != torch.float32:
        # v is not rotated: its stored bits are exactly torch's rounding of it.
        assert torch.equal(cache[:, layer, 1].view(torch.uint8), expected[:, layer, 1].view(torch.uint8))
        assert torch.isfinite(cache.float()).all()
        # k: the same rounding, bit for bit unless rope's last bit moved a value over a rounding edge.
        k_bits, k_want = cache[:, layer, 0].view(torch.uint8), expected[:, layer, 0].view(torch.uint8)
        same = (k_bits == k_want).float().mean()
        assert same.item() > 0.95
        ulp = torch.finfo(cache_dtype).eps  # one unit in the last place, relative
        err = (cache.float() - expected.float()).abs().max().item()
        assert err <= ulp * expected.float().abs().max().item(), err
    else:
        torch.testing.assert_close(cache, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="out of range"):
        kernel.rope_and_store_kv(qkv, cos, sin, cache, layer, torch.tensor([0, 1, 2, 3, 32]), hq, hkv)


def float16_edges() -> torch.Tensor:
    """float32 values at every float16 rounding edge: each float16 value, the
    midpoints between neighbours (ties, to even) and the float32s either side
    of them, the overflow edge (65504 stays, from 65520 infinity), subnormals,
    signed zeros, infinities and NaN."""
    h = torch.arange(0, 0x7C00, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    mid = (h[:-1] + h[1:]) / 2  # exact in float32
    bits = mid.view(torch.int32)
    near = torch.cat([(bits - 1).view(torch.float32), (bits + 1).view(torch.float32)])
    special = torch.tensor([65504.0, 65519.99, 65520.0, 65536.0, 1e5, 2.0 ** -25, 2.0 ** -25 * 1.0001,
                            2.0 ** -26, 1e-40, 2.0 ** -14, 2.0 ** -24 * 1.5, float("inf"), float("nan"), 0.0])
    pos = torch.cat([h, mid, near, special])
    return torch.cat([pos, -pos])


def stored_values(kernel, values: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """values as a cache of dtype holds them: stored as v (q and k zero) by
    rope_and_store_kv, one head of head_dim, a token a row."""
    t = -(-values.numel() // head_dim)
    v = torch.zeros(t * head_dim)
    v[:values.numel()] = values
    qkv = torch.cat([torch.zeros(t, 2 * head_dim), v.view(t, head_dim)], dim=1)
    cos, sin = torch.ones(t, 1, head_dim // 2), torch.zeros(t, 1, head_dim // 2)
    bs = 16
    cache = torch.zeros(-(-t // bs), 1, 2, bs, 1, head_dim, dtype=dtype)
    kernel.rope_and_store_kv(qkv, cos, sin, cache, 0, torch.arange(t), 1, 1)
    return cache[:, 0, 1].reshape(-1)[:values.numel()]


@pytest.mark.parametrize("head_dim", [6, 14, 64])  # 6: no group of 8; 14: 8 by F16C where present, 6 not
def test_the_float16_store_rounds_as_torch_does(kernel, head_dim: int) -> None:  # type: ignore[no-untyped-def]
    """A float16 cache stores each value as torch's .to(float16) rounds it, bit
    for bit: nearest, ties to even, infinite from 65520 up, subnormals below
    2**-14, NaN a NaN (on every CPU: F16C 8 at a time where the CPU has it, the
    integer conversion for the rest)."""
    values = float16_edges()
    got = stored_values(kernel, values, head_dim, torch.float16)
    want = values.to(torch.float16)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


def fp8_edges(dtype: torch.dtype) -> torch.Tensor:
    """float32 values at every rounding edge of an fp8 format: each of its
    finite values, the midpoints between neighbours (ties, to even) and the
    float32s either side of them, values past its largest finite one (they
    saturate), float32 subnormals, signed zeros, infinities and NaN."""
    top = torch.finfo(dtype).max
    every = torch.arange(0, 256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    finite = every[every.isfinite() & (every >= 0)].unique()  # sorted
    mid = (finite[:-1] + finite[1:]) / 2  # exact in float32
    bits = mid.view(torch.int32)
    near = torch.cat([(bits - 1).view(torch.float32), (bits + 1).view(torch.float32)])
    special = torch.tensor([top, top * 1.0001, top * 1.1, top * 2, 1e30, 1e-40, 1e-45, 2.0 ** -20,
                            float("inf"), float("nan"), 0.0])
    pos = torch.cat([finite, mid, near, special])
    return torch.cat([pos, -pos])


@pytest.mark.parametrize("isa", ["avx512", "avx2", "scalar"])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("head_dim", [6, 14, 64])  # 6, 14: groups of 8 and 16 and a tail
def test_the_fp8_store_rounds_as_torch_does(kernel, isa: str, dtype: torch.dtype,  # type: ignore[no-untyped-def]
                                           head_dim: int) -> None:
    """An fp8 cache stores each value as torch's .to(dtype) rounds it once
    saturated at the format's largest finite value (engine/layers/kv_quant.py),
    bit for bit: nearest, ties to even, subnormals, NaN a NaN; 16 at a time
    (AVX-512), 8 (AVX2) or one by one (the projections' instruction set picks)."""
    if isa not in kernel.supported_isas():
        pytest.skip(f"this CPU lacks the {isa} instructions (it runs {kernel.supported_isas()})")
    values = fp8_edges(dtype)
    before = kernel.isa()
    kernel.set_isa(isa)
    try:
        got = stored_values(kernel, values, head_dim, dtype)
    finally:
        kernel.set_isa(before)
    top = torch.finfo(dtype).max
    want = values.clamp(-top, top).to(dtype)  # kv_quant.quantize's saturation (NaN stays NaN)
    nan = want.float().isnan()
    assert torch.equal(got.float().isnan(), nan)
    assert torch.equal(got[~nan].view(torch.uint8), want[~nan].view(torch.uint8))


def test_fused_silu_and_mul(kernel) -> None:  # type: ignore[no-untyped-def]
    gate_up = torch.randn(7, 2 * 43) * 6  # 43: whole vectors and a tail
    gate_up[0, :6] = torch.tensor([-200.0, -88.0, -20.0, 0.0, 30.0, 200.0])  # exp's ends
    gate, up = gate_up.chunk(2, dim=-1)
    out = kernel.silu_and_mul(gate_up)
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=1e-5, atol=1e-5)
    # Each element's bits do not depend on where it sits (a vector's lane, the tail).
    shifted = kernel.silu_and_mul(torch.cat([gate[:, 3:], up[:, 3:]], dim=-1))
    assert torch.equal(shifted, out[:, 3:])


@pytest.mark.parametrize("n,k", [(16, 32), (40, 64), (576, 1536)])
def test_q4_blocks_rebuild_exactly_and_compute_what_the_float_panels_do(kernel, n: int, k: int) -> None:  # type: ignore[no-untyped-def]
    from engine.models.llama import q4_blocks

    gen = torch.Generator().manual_seed(n + k)
    w = q4_weight(n, k, gen)
    blocks = q4_blocks(w, kernel)
    assert blocks is not None and blocks.dtype == torch.uint8
    assert torch.equal(kernel.q4_unpack(blocks, n), w)
    panels = kernel.pack_weight(w)
    bias = torch.randn(n, generator=gen)
    for m in (1, 2, 5, 7):
        x = torch.randn(m, k, generator=gen)
        # the same weights summed per block (d * sum(x q) + m * sum(x)): close, not bit-equal
        y = kernel.packed_linear(x, panels, n, bias)
        torch.testing.assert_close(kernel.q4_linear(x, blocks, n, bias), y, rtol=1e-4, atol=1e-4)


def test_q4_blocks_refuse_what_is_not_4_bit(kernel) -> None:  # type: ignore[no-untyped-def]
    from engine.models.llama import q4_blocks

    assert q4_blocks(torch.randn(32, 64), kernel) is None  # arbitrary floats
    assert q4_blocks(torch.randn(32, 48), kernel) is None  # inputs not a multiple of 32
    w = q4_weight(16, 64, torch.Generator().manual_seed(1))
    w[3, 5] += 1e-3  # one weight off the grid
    assert q4_blocks(w, kernel) is None


def test_the_default_model_decodes_few_rows_from_its_4_bit_copy() -> None:
    """The default model is a Q4_1 GGUF: every projection gets an exact 4-bit
    copy and runs on it at every row count (a row's result is the same alone
    or in a batch), the head (Q8_0) an exact 8-bit one."""
    import engine.model_runner as model_runner
    from engine.models.loader import resolve_model

    model = model_runner.load_model(resolve_model(None), torch.float32, torch.device("cpu"))
    layers = [model.get_submodule(p) for p in model.linear_names() if p != "lm_head"]
    assert all(layer.q4 is not None and layer.panels is None for layer in layers)  # the blocks alone
    layer = model.layers[5].gate_up_proj
    x = torch.randn(9, layer.in_features)
    panels = layer.kernel.pack_weight(layer.weight())
    torch.testing.assert_close(layer(x), layer.kernel.packed_linear(x, panels, layer.out_features),
                               rtol=1e-4, atol=1e-4)
    assert torch.equal(layer(x[4:5]), layer(x)[4:5])
    head = model.lm_head
    assert head.q8 is not None
    assert torch.equal(head(x[:1]), head.kernel.packed_linear(x[:1], head.panels, head.out_features))
