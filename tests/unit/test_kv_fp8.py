"""fp8 KV caches: the quantizer saturates, and every attention reader (the torch
path, the CPU decode kernel, Triton by its interpreter) computes on exactly the
dequantized values, close to the float answer; the decode kernel's bfloat16
pairs (bfloat16 decodes) round only the query and the softmax's weights."""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig
from engine.layers.attention import paged_attention
from engine.layers.kv_quant import FP8_DTYPES, KV_SCALE, dequantize, quantize, resolve_kv_dtype
from tests.unit.test_triton_attention import (
    LAYER,
    MIXED_BATCH,
    _make_step,
    rows_reading_the_cache,
    triton_on_kernel_device,
)

FP8 = list(FP8_DTYPES.values())
# fp8 attention against float32 on unit-normal K/V: a value keeps 3 (e4m3) or 2
# (e5m2) mantissa bits, off by up to 2**-4 or 2**-3 of itself, so a one-key
# output (= v) may be 0.15 or 0.3 off; on average the error is far smaller.
# A wrong decode (a byte misread, a missing scale) is off by about 1.
FP8_MAX_ERR = {torch.float8_e4m3fn: 0.15, torch.float8_e5m2: 0.3}
FP8_MEAN_ERR = {torch.float8_e4m3fn: 0.015, torch.float8_e5m2: 0.03}


def _close_to_float(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    err = (out.float() - expected).abs()
    assert err.max().item() < FP8_MAX_ERR[dtype], err.max().item()
    assert err.mean().item() < FP8_MEAN_ERR[dtype], err.mean().item()


def test_flag_values() -> None:
    assert resolve_kv_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_dtype("fp8_e4m3", torch.float32) == torch.float8_e4m3fn
    assert resolve_kv_dtype("fp8_e5m2", torch.bfloat16) == torch.float8_e5m2
    with pytest.raises(ValueError,
                       match="kv_cache_dtype: must be one of auto, bfloat16, float16, fp8_e4m3, fp8_e5m2"):
        CacheConfig(kv_cache_dtype="fp8")


@pytest.mark.parametrize("dtype", FP8)
def test_quantize_saturates(dtype: torch.dtype) -> None:
    """A plain cast makes NaN (e4m3fn) or inf (e5m2) of values past the largest
    finite one; the cache keeps the largest finite value of the right sign."""
    top = torch.finfo(dtype).max
    x = torch.tensor([1e6, -1e6, top * 2, 1.0, -0.5, 0.0])
    back = dequantize(quantize(x, dtype), torch.float32)
    assert torch.isfinite(back).all()
    assert back.tolist() == [top, -top, top, 1.0, -0.5, 0.0]


def quantized_step(dtype: torch.dtype, seqs: list[tuple[int, int]], block_size: int, seed: int):  # type: ignore[no-untyped-def]
    """A float32 step and the same step over a cache of `dtype` (fp8, bfloat16).
    -> (q, k_new, v_new, that cache, meta, reference on the dequantized values,
    float32 answer)."""
    gen = torch.Generator().manual_seed(seed)
    q, k_new, v_new, cache32, meta, expected = _make_step(seqs, block_size, 9, 3, 64, gen)
    cache8 = quantize(cache32, dtype)
    # What attention over that cache computes: the torch path over the dequantized cache,
    # with this step's keys rounded as the cache rounds them.
    k_r, v_r = (dequantize(quantize(t, dtype), torch.float32) for t in (k_new, v_new))
    ref = paged_attention(q, k_r, v_r, dequantize(cache8, torch.float32), LAYER, meta, 64 ** -0.5,
                          use_kernel=False)
    return q, k_new, v_new, cache8, meta, ref, expected


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("block_size", [8, 16])
def test_torch_path_and_cpu_kernel_read_fp8(dtype: torch.dtype, block_size: int) -> None:
    from engine.layers.cpu_attention import load_cpu_kernel

    assert load_cpu_kernel() is not None
    q, k_new, v_new, cache8, meta, ref, expected = quantized_step(dtype, MIXED_BATCH, block_size, 11)
    scale = 64 ** -0.5
    rows = rows_reading_the_cache(MIXED_BATCH, meta)
    for use_kernel in (True, False):
        out = paged_attention(q, k_new, v_new, cache8, LAYER, meta, scale, use_kernel=use_kernel)
        assert (out[rows] - ref[rows]).abs().max().item() < 1e-5, use_kernel
        _close_to_float(out, expected, dtype)
    nd = meta.num_decodes
    kernel_out = load_cpu_kernel().paged_decode_attention(  # type: ignore[union-attr]
        q[:nd].bfloat16(), cache8, LAYER, meta.block_tables[:nd], meta.seq_lens[:nd], scale)
    assert kernel_out.dtype == torch.bfloat16  # a bf16 model over an fp8 cache
    assert (kernel_out.float() - ref[:nd]).abs().max().item() < 3e-2


@pytest.mark.parametrize("dtype", FP8)
def test_triton_reads_fp8(dtype: torch.dtype) -> None:
    pytest.importorskip("triton")

    q, _, _, cache8, meta, ref, expected = quantized_step(dtype, MIXED_BATCH, 16, 12)
    out = triton_on_kernel_device(q, cache8, meta, 64 ** -0.5)
    # Triton reads every key from the cache, a fresh prefill's too: the rounded reference everywhere.
    assert (out - ref).abs().max().item() < 1e-4
    _close_to_float(out, expected, dtype)


# Decodes only, one of them past a span (128 positions): the kernel's decode path.
DECODES = [(1, 1), (1, 7), (1, 17), (1, 40), (1, 150), (1, 300)]


def _decode_rows(cache: torch.Tensor, table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's keys and values from the paged cache, dequantized: [length, Hkv, D] each."""
    blocks = dequantize(cache[table.long(), LAYER], torch.float32)  # [nb, 2, bs, Hkv, D]
    k, v = (blocks[:, i].flatten(0, 1)[:length] for i in (0, 1))
    return k, v


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16, torch.float8_e5m2, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_attention_in_bf16_pairs(dtype: torch.dtype, head_dim: int) -> None:
    """bf16_dots (generated tokens under bfloat16 decodes): over an e4m3fn or a
    bfloat16 cache the decode kernel takes its scores from the query, scaled,
    rounded to bfloat16, and the keys as stored, and weighs the values, as
    stored, by the softmax's weights rounded to bfloat16.  So it is the
    attention of that query to within the weights' rounding (each off by up
    to 2**-8 of itself; bounded here by 2**-7 of the sum of weights times
    |values|), and it differs from the float32 kernel's; with every key zero
    (weights 1, exact) it is the values' mean to float32 rounding.  Over any
    other cache the flag changes no bit."""
    from engine.layers.cpu_attention import load_cpu_kernel

    kernel = load_cpu_kernel()
    assert kernel is not None
    if not kernel.decode_bf16_supported():
        pytest.skip("this CPU lacks AVX512-BF16 or AVX512-VBMI: the decode kernel stays in float32")
    gen = torch.Generator().manual_seed(23)
    heads = (9, 3) if head_dim == 64 else (8, 2)  # three and four query heads a KV head
    q, _, _, cache32, meta, _ = _make_step(DECODES, 16, *heads, head_dim, gen)
    cache = quantize(cache32, dtype)
    scale = head_dim ** -0.5
    s = KV_SCALE if dtype in FP8 else 1.0

    def kernel_out(c: torch.Tensor, bf16_dots: bool) -> torch.Tensor:
        out = kernel.paged_decode_attention(q, c, LAYER, meta.block_tables, meta.seq_lens, scale * s, 0,
                                            bf16_dots)
        return out * s

    plain, paired = kernel_out(cache, False), kernel_out(cache, True)
    if dtype not in (torch.float8_e4m3fn, torch.bfloat16):
        assert torch.equal(plain, paired)
        return
    q_rounded = (q * (scale * s)).bfloat16().double() / s  # what the kernel multiplies the keys by, over s
    group = heads[0] // heads[1]
    off_plain = 0.0
    for b, length in enumerate(meta.seq_lens_host):
        rows = _decode_rows(cache, meta.block_tables[b], length)
        k, v = (x.double().repeat_interleave(group, dim=1) for x in rows)
        w = torch.einsum("hd,lhd->hl", q_rounded[b], k).softmax(-1)  # [Hq, length]
        ref = torch.einsum("hl,lhd->hd", w, v)
        bound = 2.0 ** -7 * torch.einsum("hl,lhd->hd", w, v.abs()) + 1e-5
        assert ((paired[b].double() - ref).abs() <= bound).all(), b
        off_plain = max(off_plain, (plain[b].double() - ref).abs().max().item())
    assert off_plain > 1e-5  # the rounding shows: the flag took the other path
    zero_keys = cache.clone()
    zero_keys[:, :, 0] = 0
    for b, length in enumerate(meta.seq_lens_host):
        _, v = _decode_rows(zero_keys, meta.block_tables[b], length)
        mean = v.double().mean(0).repeat_interleave(group, dim=0)
        assert (kernel_out(zero_keys, True)[b].double() - mean).abs().max().item() < 1e-5, b


def test_which_decodes_attend_in_bf16_pairs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Generated tokens on bfloat16 inputs (decode_dtype bfloat16 or
    bfloat16-weights) attend in bfloat16 pairs where the kernel has them and
    prompt tokens attend in bfloat16 too, unless
    SPLITSERVE_BF16_DECODE_ATTENTION=0; float32 and int8 decodes never."""
    from engine.layers.cpu_attention import load_cpu_kernel
    from engine.model_runner import bf16_decode_attention

    kernel = load_cpu_kernel()
    can = kernel is not None and kernel.decode_bf16_supported()
    assert [bf16_decode_attention(d, True, kernel) for d in ("", "int8", "bfloat16", "bfloat16-weights")] == [
        False, False, can, can]
    assert not bf16_decode_attention("bfloat16-weights", False, kernel)
    assert not bf16_decode_attention("bfloat16-weights", True, None)
    monkeypatch.setenv("SPLITSERVE_BF16_DECODE_ATTENTION", "0")
    assert not bf16_decode_attention("bfloat16-weights", True, kernel)
