"""Paged attention over the block-contiguous KV cache.

KV cache layout (one tensor per engine):
    kv_cache: [num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]
so that one block, all layers, K and V, is one contiguous region that the
transfer layer can send as-is.

A step's query tokens are the concatenation of every scheduled sequence's new
tokens. Sequence i owns query rows query_start_loc[i]:query_start_loc[i+1]; its
keys are positions 0..seq_lens[i]-1 (cached prefix + new tokens), and query j
of a sequence with q_len new tokens sits at position seq_len - q_len + j and
sees keys 0..that position (causal), or with a sliding window W only the last
W of them, position - W + 1..position (Mistral, Gemma's local layers; as
transformers masks them). With a soft cap C (Gemma 2) scores s become
C * tanh(s / C) before the softmax. Decodes (q_len == 1) come first.

The cache may hold fp8 (kv_quant.py): write_kv quantizes, and every reader
dequantizes what it loads to the query's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from engine.layers.cpu_attention import load_cpu_kernel
from engine.layers.kv_quant import KV_SCALE, dequantize, is_fp8, quantize


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    query_lens: list[int]  # host copies, for the CPU path
    seq_lens_host: list[int]
    num_decodes: int  # the first num_decodes sequences have q_len == 1
    # Per sequence, how many of its leading query rows attend in bfloat16
    # (prompt tokens under prefill_dtype bfloat16, where the CPU kernel can);
    # empty: none.
    bf16_rows: list[int] = field(default_factory=list)
    # Whether the decodes attend in bfloat16 pairs (generated tokens under
    # decode_dtype bfloat16 or bfloat16-weights with bfloat16 prompts, where the
    # CPU kernel can: its bf16_dots; model_runner.bf16_decode_attention).
    bf16_decodes: bool = False
    # What a backend derives once per step and reuses in every layer (keyed by the backend).
    per_step: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


class AttentionFn(Protocol):
    """An attention backend.  q: [T, Hq, D]; k, v: [T, Hkv, D], this step's
    keys, already in kv_cache.  Returns [T, Hq, D].  window: see the module doc."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 layer: int, meta: AttentionMetadata, scale: float, /, *,
                 window: int | None = None, softcap: float | None = None) -> torch.Tensor: ...


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """q_pos: [Q], k_pos: [K] -> [Q, K] bool: which keys each query attends to."""
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return mask


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           scale: float, softcap: float | None) -> torch.Tensor:
    """q: [B, Hq, Lq, D]; k, v: [B, Hkv, Lk, D]; mask broadcasts to [B, 1, Lq, Lk]
    (None: causal, Lq == Lk).  SDPA has no soft cap, so capped scores are
    written out (in float32, as transformers' eager attention does)."""
    if softcap is None:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = softcap * torch.tanh(scores / softcap)
    if mask is None:
        lq = q.shape[2]
        mask = torch.ones(lq, lq, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1, dtype=torch.float32).to(v.dtype), v)


def write_kv(kv_cache: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the step's new keys and values.  k, v: [T, Hkv, D]."""
    block_size = kv_cache.shape[3]
    if kv_cache.dtype != k.dtype:
        k, v = quantize(k, kv_cache.dtype), quantize(v, kv_cache.dtype)
    blocks = slot_mapping // block_size
    offsets = slot_mapping % block_size
    kv_cache[blocks, layer, 0, offsets] = k
    kv_cache[blocks, layer, 1, offsets] = v


def _gather(kv_cache: torch.Tensor, layer: int, block_table: torch.Tensor, dtype: torch.dtype,
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """block_table: [B, nb] -> K, V: [B, Hkv, nb * block_size, D] in dtype (views
    of two contiguous gathers; gathering K and V apart avoids a reshape copy)."""
    b, nb = block_table.shape
    bs, hkv, d = kv_cache.shape[3:]
    k = dequantize(kv_cache[block_table, layer, 0], dtype).view(b, nb * bs, hkv, d).transpose(1, 2)
    v = dequantize(kv_cache[block_table, layer, 1], dtype).view(b, nb * bs, hkv, d).transpose(1, 2)
    return k, v


def paged_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                    kv_cache: torch.Tensor, layer: int, meta: AttentionMetadata,
                    scale: float, use_kernel: bool = True, *, window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """Torch path.  q: [T, Hq, D]; k_new, v_new: [T, Hkv, D] (already written
    to the cache).  Returns [T, Hq, D].  On the CPU, where the compiled kernels
    built and the scores are not soft-capped, decodes and prefills (a head size
    that is a multiple of 16) go through them: they read the cache in place, no
    gather, no padding, so a prompt's queries see the same keys (as stored)
    whether it is prefilled whole, in chunks or after a cached prefix."""
    nd = meta.num_decodes
    on_cpu = use_kernel and q.device.type == "cpu" and softcap is None
    kernel = load_cpu_kernel() if on_cpu else None
    # The kernels read fp8 values as stored: a cache scale s folds into the
    # softmax scale (q.(s k) = (s q).k) and the output (sum p (s v)).
    s = KV_SCALE if is_fp8(kv_cache.dtype) else 1.0
    parts: list[torch.Tensor] = []
    if nd and kernel is not None:
        # Decodes only (every single-stream step): the whole batch, no slices.
        qd, tables, lens = ((q, meta.block_tables, meta.seq_lens) if nd == meta.num_seqs
                            else (q[:nd], meta.block_tables[:nd], meta.seq_lens[:nd]))
        o = kernel.paged_decode_attention(qd, kv_cache, layer, tables, lens, scale * s, window or 0,
                                          meta.bf16_decodes)
        parts.append(o if s == 1.0 else o * s)
    elif nd:
        parts.append(_torch_decodes(q[:nd], kv_cache, layer, meta, scale, window, softcap))
    if nd < meta.num_seqs and kernel is not None and q.shape[-1] % 16 == 0:
        o = kernel.paged_prefill_attention(q[nd:], kv_cache, layer, meta.block_tables[nd:],
                                           meta.query_lens[nd:], meta.seq_lens_host[nd:],
                                           scale * s, window or 0, meta.bf16_rows[nd:])
        parts.append(o if s == 1.0 else o * s)
    elif nd < meta.num_seqs:
        parts.append(_torch_prefills(q, k_new, v_new, kv_cache, layer, meta, scale, window, softcap))
    # A single-stream step is one decode: its output as the kernel made it.
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _torch_decodes(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, meta: AttentionMetadata,
                   scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
    """The decodes' rows (q: [Bd, Hq, D]) in one padded SDPA call."""
    nd = q.shape[0]
    block_size = kv_cache.shape[3]
    nb = (max(meta.seq_lens_host[:nd]) + block_size - 1) // block_size
    k, v = _gather(kv_cache, layer, meta.block_tables[:nd, :nb], q.dtype)
    key_pos = torch.arange(nb * block_size, device=q.device)
    mask = key_pos[None, :] < meta.seq_lens[:nd, None]  # [Bd, L]
    if window is not None:
        mask &= key_pos[None, :] >= meta.seq_lens[:nd, None] - window
    return attend(q.unsqueeze(2), k, v, mask[:, None, None, :], scale, softcap).squeeze(2)


def _torch_prefills(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, kv_cache: torch.Tensor,
                    layer: int, meta: AttentionMetadata, scale: float, window: int | None,
                    softcap: float | None) -> torch.Tensor:
    """The prefills' rows (those after the decodes in q), one SDPA call each."""
    nd = meta.num_decodes
    block_size = kv_cache.shape[3]
    out = torch.empty_like(q[nd:])
    start = 0
    for i in range(nd, meta.num_seqs):
        q_len, seq_len = meta.query_lens[i], meta.seq_lens_host[i]
        rows = slice(nd + start, nd + start + q_len)
        qi = q[rows].transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
        if q_len == seq_len and (window is None or q_len <= window):
            # No cached prefix: the new keys are the whole context, all in sight.
            ki = k_new[rows].transpose(0, 1).unsqueeze(0)
            vi = v_new[rows].transpose(0, 1).unsqueeze(0)
            o = attend(qi, ki, vi, None, scale, softcap)
        else:
            nb = (seq_len + block_size - 1) // block_size
            ki, vi = _gather(kv_cache, layer, meta.block_tables[i:i + 1, :nb], q.dtype)
            ki, vi = ki[:, :, :seq_len], vi[:, :, :seq_len]
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            mask = visible(q_pos, torch.arange(seq_len, device=q.device), window)  # [q_len, seq_len]
            o = attend(qi, ki, vi, mask, scale, softcap)
        out[start:start + q_len] = o[0].transpose(0, 1)
        start += q_len
    return out
