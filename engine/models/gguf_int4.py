"""The 4-bit tensors of a GGUF file, read from its raw blocks into Int4Weight
(engine/models/int4.py), so the CPU kernel decodes from them exactly.

  Q4_0  32 inputs: d (f16), 16 bytes of codes    w = d (q - 8)  ->  d, m = -8 d
  Q4_1  32 inputs: d, m (f16), 16 bytes          w = d q + m
  Q4_K  256 inputs: d, dmin (f16), 12 bytes of 6-bit scales and mins, 128
        bytes of codes; per 32-input sub-block j: w = (d sc_j) q - dmin mn_j

Q8_0 and Q6_K (8- and 6-bit codes) have no kernel here: those tensors, and any
other type, run from the float32 weights that loading dequantized.  The names
and the q/k row order follow transformers' GGUF reader (engine/models/loader.py
converts through it), and every weight is checked against that conversion bit
for bit: a tensor that does not rebuild it is left to its float copy.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from engine.models.int4 import Int4Weight

# GGUF tensor name (after "blk.{i}.") -> Hugging Face name (after "model.layers.{i}.").
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(gguf_name: str) -> str | None:
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.weight"
    return None


def f16(raw: np.ndarray) -> torch.Tensor:
    """[..., 2] bytes -> [...] float32."""
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32))


def low_high(codes: np.ndarray) -> np.ndarray:
    """[..., B] bytes -> [..., 2B] nibbles: the low ones, then the high ones."""
    return np.concatenate([codes & 0x0F, codes >> 4], axis=-1)


def q4_0(blocks: np.ndarray) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:  # blocks: [N, K/32, 18]
    d = f16(blocks[..., 0:2])
    return low_high(blocks[..., 2:]), d, -8 * d


def q4_1(blocks: np.ndarray) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:  # blocks: [N, K/32, 20]
    return low_high(blocks[..., 4:]), f16(blocks[..., 0:2]), f16(blocks[..., 2:4])


def q4_k(blocks: np.ndarray) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:  # blocks: [N, K/256, 144]
    d, dmin = f16(blocks[..., 0:2]), f16(blocks[..., 2:4])
    s = blocks[..., 4:16]
    # 6-bit scale and min of sub-block j < 4 in bytes j and j + 4; of j >= 4 in
    # byte j + 4's nibbles, with their top bits in bytes j - 4 and j.
    sc = np.concatenate([s[..., 0:4] & 0x3F, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 0x3F, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 2) & 0x30)], axis=-1)
    codes = blocks[..., 16:].reshape(*blocks.shape[:-1], 4, 32)  # chunk c: sub-blocks 2c (low), 2c + 1 (high)
    q = np.stack([codes & 0x0F, codes >> 4], axis=-2)  # [N, K/256, 4, 2, 32]
    n = blocks.shape[0]
    dd = d[..., None] * torch.from_numpy(sc.astype(np.float32))
    mm = -(dmin[..., None] * torch.from_numpy(mn.astype(np.float32)))
    return q.reshape(n, -1), dd.reshape(n, -1), mm.reshape(n, -1)


DECODERS = {"Q4_0": (18, 32, q4_0), "Q4_1": (20, 32, q4_1), "Q4_K": (144, 256, q4_k)}


def decode(type_name: str, data: np.ndarray, k: int) -> Int4Weight | None:
    """data: [N, bytes per row] uint8, rows of k inputs."""
    if type_name not in DECODERS:
        return None
    size, inputs, fn = DECODERS[type_name]
    n = data.shape[0]
    q, d, m = fn(np.asarray(data).reshape(n, k // inputs, size))
    return Int4Weight(torch.from_numpy(np.ascontiguousarray(q.reshape(n, k))), d.reshape(n, -1).contiguous(),
                      m.reshape(n, -1).contiguous())


def llama_qk_order(rows: int, heads: int) -> torch.Tensor:
    """The row order transformers restores in a Llama GGUF's q and k (llama.cpp
    interleaves each head's two rope halves): weight[order] is the HF weight."""
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)


def gguf_int4(path: Path, floats: dict[str, torch.Tensor], num_heads: int,
              num_kv_heads: int) -> dict[str, Int4Weight]:
    """The 4-bit linear weights of the GGUF at `path` by Hugging Face name,
    each one only if it rebuilds `floats[name]` (the converted weights): a
    few rows checked here, every weight by pack_linears."""
    from engine.models.gguf_index import gguf_tensors

    out: dict[str, Int4Weight] = {}
    for t in gguf_tensors(path):
        name = hf_name(t.name)
        if name is None or name not in floats:
            continue
        w = decode(t.tensor_type.name, t.data, int(t.shape[0]))
        if w is None:
            continue
        if ".attn_q." in t.name or ".attn_k." in t.name:  # transformers reorders these rows (Llama)
            heads = num_heads if ".attn_q." in t.name else num_kv_heads
            orders: list[torch.Tensor | None] = [llama_qk_order(w.shape[0], heads), None]
        else:
            orders = [None]
        # A few rows tell the order (and a name mapped wrong); pack_linears
        # checks every weight of the packed blocks against the floats.
        head = floats[name][:32]
        for order in orders:
            cand = w if order is None else w.rows(order)
            if torch.equal(cand.rows(torch.arange(min(32, cand.shape[0]))).dequantize(), head):
                out[name] = cand
                break
    return out
