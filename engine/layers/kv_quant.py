"""The KV cache's storage dtype: the model's own, bfloat16, float16 or fp8 (`--kv-cache-dtype`).

bfloat16 halves a float32 model's cache: the keys and values rounded to
nearest even as they are stored (a bfloat16 model's own precision), the
projections, norms and sampling still in float32.  Twice the blocks for the
same memory, half the bytes a prefill sends a decode and a decode step reads
(at 32 sequences the attention reads the cache at the memory's rate).

float16 halves it the same way with 11 significant bits where bfloat16 keeps
8 (a value off by at most 2**-12 of itself, not 2**-9), in a narrower range:
past 65504 a key or value becomes infinite (as torch's .to(float16) makes it),
and under 2**-14 it keeps fewer bits.  The keys and values of the models
served here stay far inside it (SmolLM2-135M: |K| <= 21, |V| <= 13).  Every
AVX2 CPU widens float16 in one instruction (F16C), as fast as bfloat16's
shift; llama.cpp keeps its cache in float16 by default.

fp8 halves a bfloat16 cache (a quarter of a float32 one): twice the blocks for
the same memory and half the bytes a prefill sends a decode.  Values are
stored as x / KV_SCALE, saturated to the format's largest finite value, and
read back as stored * KV_SCALE in the compute dtype.

Scales: one per tensor, fixed (KV_SCALE = 1.0, as vLLM uses for checkpoints
without calibrated scales), not per block and head, because
  - fp8 is floating point: its relative precision (e4m3: 3 mantissa bits) is the
    same at every magnitude, so a scale only moves the range.  The keys and
    values of the models served here stay well inside e4m3's normal range
    (SmolLM2-135M, all 30 layers: |K| <= 21, |V| <= 13, against a largest
    finite 448 and a smallest normal 2**-6); anything larger saturates;
  - a block stays plain bytes: a transfer sends exactly half the bytes and the
    receiver needs no side table, a prefix-cache hit reuses the block as it
    is, and two workers agree on the encoding by construction (the dtype in
    the layout handshake says it all);
  - a decode appends to its last block one token at a time: per-block scales
    would have to grow, and re-quantize the block, as larger values arrive;
  - measured, finer scales buy nothing: scales per token and head (absmax to
    448, finer than per block and head, so a bound on what those could give)
    agree with a float32 cache on 97.40% of greedy choices, as this per-tensor
    scale does (tests/integration/test_kv_fp8_model.py: the misses are
    near-ties, as bfloat16 compute's are).
"""

from __future__ import annotations

import torch

from engine.config import KV_CACHE_DTYPES

KV_SCALE = 1.0  # the fused store (linear_cpu.cpp, rope_and_store_kv) writes fp8 with this scale
FP8_DTYPES: dict[str, torch.dtype] = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
HALF_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16}
assert set(FP8_DTYPES) | set(HALF_DTYPES) | {"auto"} == set(KV_CACHE_DTYPES)


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's storage dtype for a --kv-cache-dtype value (auto: the model's)."""
    if name == "auto":
        return model_dtype
    return HALF_DTYPES.get(name) or FP8_DTYPES[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES.values()


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in the compute dtype -> the cache's dtype.  Saturating: a plain cast
    turns values past the largest finite one into NaN (e4m3fn) or inf (e5m2)."""
    if not is_fp8(dtype):
        return x.to(dtype)
    top = torch.finfo(dtype).max
    return (x.float() / KV_SCALE).clamp_(-top, top).to(dtype)


def dequantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache values -> the compute dtype (a no-op for an unquantized cache)."""
    if not is_fp8(x.dtype):
        return x.to(dtype)
    out = x.to(dtype)
    return out if KV_SCALE == 1.0 else out.mul_(KV_SCALE)
