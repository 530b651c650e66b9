"""A decode step through a Llama model's blocks in one kernel call.

A step whose rows are all generated tokens (one a sequence) runs every layer
in the CPU kernels' DecodeStack (csrc/decode_stack.cpp): the fused layer's
ops (LlamaLayer._forward_fused) in its order, through the same kernels, so
the same bits, without the interpreter between them and without the GIL.
Any other step, and any model the stack does not cover (projections wrapped
for LoRA, another attention backend; Gemma's norms and soft caps are not
fused at all), keeps the Python loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from engine.layers.attention import AttentionFn, AttentionMetadata, paged_attention
from engine.layers.cpu_attention import load_cpu_kernel
from engine.layers.kv_quant import KV_SCALE, is_fp8
from engine.layers.packed_linear import PackedLinear, PromptRows


class DecodeStack:
    """The kernels' DecodeStack for one model's layers, with what it was built
    from: each layer's submodules (LlamaLayer._parts, gathered again when one
    is swapped) and the rows the projections take as prompt tokens."""

    def __init__(self, stack: Any, parts: Sequence[tuple[Any, ...]], rows: PromptRows | None,
                 kv_dtype: torch.dtype) -> None:
        self.stack = stack
        self.parts = list(parts)
        self.rows = rows
        self.kv_dtype = kv_dtype

    def current(self, layers: nn.ModuleList) -> bool:
        """Whether every layer still holds the submodules the stack was built from."""
        return all(layer._parts is p for layer, p in zip(layers, self.parts, strict=True))

    def runs(self, x: torch.Tensor, meta: AttentionMetadata, attn: AttentionFn,
             kv_cache: torch.Tensor) -> bool:
        """Whether this step is one the stack computes: every row a sequence's
        generated token, none a prompt token, on the CPU kernel's attention."""
        t = x.shape[0]
        return (attn is paged_attention and meta.num_decodes == t and meta.num_seqs == t
                and (self.rows is None or not self.rows.runs) and kv_cache.dtype == self.kv_dtype
                and x.dtype == torch.float32 and x.device.type == "cpu")

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        return self.stack.forward(x, cos, sin, kv_cache, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                                  meta.bf16_decodes)


def build(model: Any, kv_cache: torch.Tensor) -> DecodeStack | None:
    """The stack for `model` (a LlamaForCausalLM on the packed kernels) and a
    cache of kv_cache's dtype, or None where it does not cover the model."""
    spec, kernel, attention = model.spec, model.fused, load_cpu_kernel()
    if kernel is None or attention is None or kv_cache.device.type != "cpu":
        return None
    if spec.attn_softcap is not None or model.local_inv_freq is not None:
        return None  # soft-capped scores, a second rope: the loop's
    parts = [layer._parts if layer._parts is not None else layer._gather_parts() for layer in model.layers]
    layers = []
    prompt_rows: list[PromptRows] = []
    for layer, (norm1, norm2, qkv, o, gate_up, down, q_norm, k_norm) in zip(model.layers, parts, strict=True):
        projections = (qkv, o, gate_up, down)
        if not all(isinstance(p, PackedLinear) for p in projections) or (q_norm is None) != (k_norm is None):
            return None
        prompt_rows += [p.prompt_rows for p in projections if p.prompt_rows is not None]
        layers.append(kernel.DecodeLayer(
            layer.layer_idx, norm1.weight.detach(), norm1.eps, norm2.weight.detach(), norm2.eps,
            *(p.decode_projection() for p in projections), layer.window or 0,
            *((None, 0.0, None, 0.0) if q_norm is None else
              (q_norm.weight.detach(), q_norm.eps, k_norm.weight.detach(), k_norm.eps))))
    rows = prompt_rows[0] if prompt_rows else None
    if any(r is not rows for r in prompt_rows):  # each projection would take other rows as prompt tokens
        return None
    kv_scale = KV_SCALE if is_fp8(kv_cache.dtype) else 1.0
    stack = kernel.DecodeStack(layers, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.attn_scale,
                               kv_scale, attention.decode_attention_capsule())
    return DecodeStack(stack, parts, rows, kv_cache.dtype)
