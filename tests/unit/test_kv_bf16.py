"""A float32 model's bfloat16 or float16 KV cache (--kv-cache-dtype bfloat16,
float16): every attention reader (the torch path, the CPU kernels, Triton by
its interpreter) computes on exactly the widened values, in float32; and the
CPU kernels widen fp8 bytes exactly as torch does, all 256 of them, and every
float16 value (and, for the decode kernel's bfloat16 pairs, every e4m3fn
byte of a key to the float32 path's score)."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from engine.config import CacheConfig
from engine.layers.attention import paged_attention
from engine.layers.cpu_attention import build_avx2_kernel, load_cpu_kernel
from engine.layers.cpu_features import has
from engine.layers.kv_quant import resolve_kv_dtype
from tests.unit.test_kv_fp8 import quantized_step
from tests.unit.test_triton_attention import (
    LAYER,
    MIXED_BATCH,
    rows_reading_the_cache,
    triton_on_kernel_device,
)

# bfloat16 keeps 8 bits of mantissa: a value is off by up to 2**-9 of itself, so
# a one-key output (= v) of unit-normal values may be 0.01 off; a misread
# element (a wrong byte order, a float read as two halves) is off by about 1.
# float16 keeps 11: eight times closer.
MAX_ERR = {torch.bfloat16: (0.02, 0.002), torch.float16: (0.0025, 0.00025)}
HALVES = [torch.bfloat16, torch.float16]


def test_flag_values() -> None:
    assert resolve_kv_dtype("bfloat16", torch.float32) == torch.bfloat16
    assert resolve_kv_dtype("bfloat16", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_dtype("float16", torch.float32) == torch.float16
    assert CacheConfig(kv_cache_dtype="float16").kv_cache_dtype == "float16"
    assert CacheConfig(kv_cache_dtype="bfloat16").kv_cache_dtype == "bfloat16"
    with pytest.raises(ValueError,
                       match="kv_cache_dtype: must be one of auto, bfloat16, float16, fp8_e4m3, fp8_e5m2"):
        CacheConfig(kv_cache_dtype="bf16")


def _close_to_float(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    err = (out.float() - expected).abs()
    max_err, mean_err = MAX_ERR[dtype]
    assert err.max().item() < max_err, err.max().item()
    assert err.mean().item() < mean_err, err.mean().item()


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("block_size", [8, 16])
def test_torch_path_and_cpu_kernels_read_a_half_cache_under_float32(block_size: int,
                                                                     dtype: torch.dtype) -> None:
    assert load_cpu_kernel() is not None
    q, k_new, v_new, cache, meta, ref, expected = quantized_step(dtype, MIXED_BATCH, block_size, 21)
    assert cache.dtype == dtype
    assert q.dtype == torch.float32
    rows = rows_reading_the_cache(MIXED_BATCH, meta)
    for use_kernel in (True, False):
        out = paged_attention(q, k_new, v_new, cache, LAYER, meta, 64 ** -0.5, use_kernel=use_kernel)
        assert out.dtype == torch.float32
        assert (out[rows] - ref[rows]).abs().max().item() < 1e-5, use_kernel
        _close_to_float(out, expected, dtype)
    # The decode kernel alone over the widened cache: the same sums as over a float32 copy.
    nd = meta.num_decodes
    kernel = load_cpu_kernel()
    args = (LAYER, meta.block_tables[:nd], meta.seq_lens[:nd], 64 ** -0.5)
    from_half = kernel.paged_decode_attention(q[:nd], cache, *args)  # type: ignore[union-attr]
    from_f32 = kernel.paged_decode_attention(q[:nd], cache.float(), *args)  # type: ignore[union-attr]
    assert torch.equal(from_half, from_f32)


@pytest.mark.parametrize("dtype", HALVES)
def test_triton_reads_a_half_cache_under_float32(dtype: torch.dtype) -> None:
    pytest.importorskip("triton")

    q, _, _, cache, meta, ref, expected = quantized_step(dtype, MIXED_BATCH, 16, 22)
    out = triton_on_kernel_device(q, cache, meta, 64 ** -0.5)
    assert out.dtype == torch.float32
    assert (out - ref).abs().max().item() < 1e-4  # every key from the cache: the rounded reference
    _close_to_float(out, expected, dtype)


def kernel_build(build: str) -> ModuleType | None:
    """The attention kernel as this CPU builds it ("native"), or as an AVX2
    machine does ("avx2": its own way of widening rows, run here too)."""
    if build == "native":
        return load_cpu_kernel()
    if not all(has(f) for f in ("avx2", "fma", "f16c")):
        pytest.skip("this CPU lacks AVX2, FMA or F16C, which the AVX2 build needs")
    return build_avx2_kernel()


@pytest.mark.parametrize("build", ["native", "avx2"])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16])
def test_cpu_kernel_widens_every_value_as_torch_does(dtype: torch.dtype, build: str) -> None:
    """One key and one value per sequence, so the output is the value row
    itself (softmax over one key is 1): every byte pattern of fp8 (256) and of
    float16 (65536), and a spread of bfloat16 ones (normals, subnormals, signed zeros, infinities),
    widened by the kernel equal torch's own conversion (NaN stays NaN), in
    this CPU's build and in an AVX2 machine's."""
    kernel = kernel_build(build)
    assert kernel is not None
    if dtype == torch.bfloat16:
        bits = torch.cat([torch.arange(0, 65536, 257), torch.tensor([0x0001, 0x8001, 0x007f, 0x0080, 0x8000,
                                                                     0x7f80, 0xff80, 0x7f7f, 0xff7f])])
        stored = bits.to(torch.int32).to(torch.int16).view(torch.bfloat16)  # the same 16 bits
    elif dtype == torch.float16:  # all of them
        stored = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)
    else:
        stored = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    n = stored.numel()
    d = 64
    rows = -(-n // d)
    padded = torch.zeros(rows * d, dtype=dtype)
    padded[:n] = stored
    cache = torch.zeros(rows, 1, 2, 16, 1, d, dtype=dtype)
    cache[:, 0, 1, 0, 0] = padded.view(rows, d)  # block r, position 0: the values
    tables = torch.arange(rows, dtype=torch.int32)[:, None]
    out = kernel.paged_decode_attention(torch.zeros(rows, 1, d), cache, 0, tables,
                                        torch.ones(rows, dtype=torch.int32), 1.0)
    got, want = out.reshape(-1)[:n], stored.float()
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan], want[~nan])  # -0.0 sums to +0.0 in the output: == compares values


def test_bf16_scores_read_every_key_byte_as_the_float32_scores_do() -> None:
    """The keys of scores in bfloat16 pairs (bf16_dots) go through a table of
    their own: all 256 e4m3fn bytes, and a spread of bfloat16 patterns, each
    the one key value of a score whose query is exact in bfloat16 (1/64, so
    no score saturates the softmax), give the float32 path's score bit for
    bit.  Two positions, that key's and a zero key, with values e_0 and e_1:
    the larger weight is 1 (exact in bfloat16), so that output value, 1 / the
    weights' sum, is the float32 path's bit for bit only where the score is;
    the other is within its weight's rounding to bfloat16 (2**-8 of itself,
    bfloat16 keeping 8 significant bits); NaN stays NaN."""
    kernel = load_cpu_kernel()
    assert kernel is not None
    if not kernel.decode_bf16_supported():
        pytest.skip("this CPU lacks AVX512-BF16 or AVX512-VBMI: the decode kernel stays in float32")
    for dtype in (torch.float8_e4m3fn, torch.bfloat16):
        if dtype == torch.bfloat16:
            extra = torch.tensor([0x0001, 0x8001, 0x007f, 0x3c01, 0xc2ff])  # subnormals, odd mantissas
            bits = torch.cat([torch.arange(0, 65536, 257), extra])
            stored = bits.to(torch.int32).to(torch.int16).view(torch.bfloat16)
        else:
            stored = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
        n, d = stored.numel(), 64
        cache = torch.zeros(n, 1, 2, 16, 1, d, dtype=dtype)
        cache[:, 0, 0, 0, 0, 0] = stored
        cache[:, 0, 1, 0, 0, 0] = 1
        cache[:, 0, 1, 1, 0, 1] = 1
        q = torch.zeros(n, 1, d)
        q[:, 0, 0] = 1.0
        tables = torch.arange(n, dtype=torch.int32)[:, None]
        lens = torch.full((n,), 2, dtype=torch.int32)
        plain, paired = (kernel.paged_decode_attention(q, cache, 0, tables, lens, 1 / 64, 0, bf16)[:, 0, :2]
                         for bf16 in (False, True))
        nan = plain.isnan().any(1)
        assert torch.equal(paired.isnan().any(1), nan)
        assert nan.sum().item() == stored.float().isnan().sum().item()  # e4m3fn: 0x7f and 0xff
        top = plain[~nan].argmax(1, keepdim=True)  # the weight 1's output
        assert torch.equal(paired[~nan].gather(1, top), plain[~nan].gather(1, top))
        other = 1 - top
        assert ((paired[~nan].gather(1, other) - plain[~nan].gather(1, other)).abs()
                <= 1.001 * 2.0 ** -8 * plain[~nan].gather(1, other)).all()
