"""AWQ and GPTQ checkpoints: 4-bit codes with a scale and a zero per group of
inputs, read from their Hugging Face safetensors layouts into Int4Weight
(engine/models/int4.py), which the CPU kernel runs without a float copy.

config.json's `quantization_config` names the format:

- AWQ (`quant_method: awq`, `version: gemm`): `qweight` int32 [K, N/8],
  `qzeros` int32 [K/G, N/8], `scales` [K/G, N]; each int32 holds 8 columns in
  AWQ's interleaved order (nibble i is column 8c + AWQ_ORDER[i]).
- GPTQ (`quant_method: gptq`): `qweight` int32 [K/8, N] (8 consecutive inputs
  per int32, nibble i = input 8r + i), `qzeros` int32 [K/G, N/8] (columns in
  order), `scales` [K/G, N], `g_idx` int32 [K] (each input's group).  Checkpoints
  in the original format (`checkpoint_format: gptq`, the default) store zero - 1;
  `gptq_v2` stores the zero itself.  With act-order (`desc_act`), inputs are
  not grouped consecutively: such a layer is dequantized to float32 at load.

Both dequantize as w[n, k] = (q[k, n] - z[g(k), n]) * s[g(k), n].
"""

from __future__ import annotations

from typing import Any

import torch

from engine.models.int4 import Int4Weight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column (within 8) that nibble i holds


def unpack_int32(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """The 8 nibbles of each int32, least significant first, spread along
    `dim` (which grows 8 times): [.., X, ..] -> [.., 8 X, ..] uint8."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nib = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF  # [..., 8]
    nib = nib.movedim(-1, dim + 1 if dim >= 0 else dim)
    shape = list(packed.shape)
    shape[dim] *= 8
    return nib.reshape(shape).to(torch.uint8)


def quant_method(config: dict[str, Any]) -> str | None:
    """'awq', 'gptq', or None for a float checkpoint; ValueError naming the
    field for a quantization the engine cannot run."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method not in ("awq", "gptq"):
        raise ValueError(f"model: quantization_config.quant_method {method!r} is not supported (awq, gptq)")
    if int(qc.get("bits", 4)) != 4:
        raise ValueError(f"model: quantization_config.bits {qc.get('bits')} is not supported (4)")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"model: quantization_config.version {version!r} is not supported (gemm)")
        if not qc.get("zero_point", True):
            raise ValueError("model: quantization_config.zero_point false is not supported for awq")
    return method


def awq_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> Int4Weight:
    order = torch.tensor(AWQ_ORDER)
    inverse = torch.argsort(order)  # nibble that holds column j

    def columns(packed: torch.Tensor) -> torch.Tensor:  # [R, N/8] int32 -> [R, N] uint8
        nib = unpack_int32(packed, dim=1).view(packed.shape[0], -1, 8)
        return nib[..., inverse].reshape(packed.shape[0], -1)

    q, z = columns(qweight), columns(qzeros)  # [K, N], [G, N]
    return Int4Weight.from_groups(q.t(), scales.t(), z.t())


def gptq_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                zero_offset: int) -> Int4Weight | torch.Tensor:
    """Int4Weight, or the float32 weight [N, K] if the groups are not runs of
    consecutive inputs (act-order)."""
    q = unpack_int32(qweight, dim=0)  # [K, N]
    z = unpack_int32(qzeros, dim=1).to(torch.int16) + zero_offset  # [G, N]
    k, groups = q.shape[0], scales.shape[0]
    runs = torch.arange(k) // (k // groups)
    if g_idx is None or torch.equal(g_idx.to(torch.int64), runs):
        return Int4Weight.from_groups(q.t(), scales.t(), z.t())
    g = g_idx.to(torch.int64)
    return ((q.to(torch.int16) - z[g]).float() * scales.float()[g]).t().contiguous()


def checkpoint_int4(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Int4Weight]:
    """The quantized linear weights of an AWQ/GPTQ checkpoint by their float
    name ("...q_proj.weight"), their packed tensors taken out of `tensors`; a
    layer that must run in float (act-order GPTQ) goes back into `tensors` as
    a float32 "...weight".  {} for a float checkpoint."""
    method = quant_method(config)
    if method is None:
        return {}
    qc = config["quantization_config"]
    zero_offset = 1 if method == "gptq" and str(qc.get("checkpoint_format", "gptq")).lower() == "gptq" else 0
    out: dict[str, Int4Weight] = {}
    for name in [n for n in tensors if n.endswith(".qweight")]:
        base = name[: -len(".qweight")]
        qweight = tensors.pop(name)
        qzeros, scales, g_idx = (tensors.pop(f"{base}.{s}", None) for s in ("qzeros", "scales", "g_idx"))
        if qzeros is None or scales is None:
            raise ValueError(f"model: {base} has a qweight but no qzeros or scales")
        weight = (awq_weight(qweight, qzeros, scales) if method == "awq" else
                  gptq_weight(qweight, qzeros, scales, g_idx, zero_offset))
        if isinstance(weight, Int4Weight):
            out[f"{base}.weight"] = weight
        else:
            tensors[f"{base}.weight"] = weight
    return out
