"""Reference quantizers and packers for the weight-format tests, written from
the formats' own definitions (AutoAWQ's GEMM packing, AutoGPTQ's packing,
llama.cpp's Q4_K / Q6_K block layouts), independent of the engine's readers.

They quantize by plain min/max (not the formats' search for the best scales):
the tests need valid checkpoints in each layout, not good ones."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of an AWQ int32 holds column 8c + AWQ_ORDER[i]


@dataclass
class GroupQuant:
    """w ~ (q - zero[:, g_idx]) * scale[:, g_idx]: q [N, K], scale (f16) and zero [N, G]."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    g_idx: torch.Tensor  # [K] int32

    def dequantize(self) -> torch.Tensor:
        g = self.g_idx.long()
        return ((self.q - self.zero[:, g]).float() * self.scale.float()[:, g]).contiguous()


def quantize_groups(w: torch.Tensor, group: int, sym: bool = False, g_idx: torch.Tensor | None = None,
                    min_zero: int = 0) -> GroupQuant:
    """4-bit min/max quantization of w [N, K] per group of inputs (g_idx: each
    input's group; default runs of `group` consecutive inputs)."""
    n, k = w.shape
    g_idx = torch.arange(k, dtype=torch.int32) // group if g_idx is None else g_idx
    order = torch.argsort(g_idx, stable=True)
    wg = w[:, order].view(n, k // group, group)
    if sym:
        scale = (wg.abs().amax(-1) / 7.5).clamp(min=1e-6).half()
        zero = torch.full_like(scale, 8, dtype=torch.int32)
    else:
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-6).half()
        zero = (-lo / scale.float()).round().clamp(min_zero, 15).to(torch.int32)
    qs = (wg / scale.float()[..., None] + zero[..., None]).round().clamp(0, 15).to(torch.int32).view(n, k)
    q = torch.empty_like(qs)
    q[:, order] = qs
    return GroupQuant(q, scale, zero, g_idx.to(torch.int32))


def pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """[..., 8] in 0..15 -> [...] int32, value i in bits 4i..4i+3."""
    acc = torch.zeros(values.shape[:-1], dtype=torch.int64)
    for i in range(8):
        acc |= values[..., i].to(torch.int64) << (4 * i)
    return ((acc + 2**31) % 2**32 - 2**31).to(torch.int32)  # the bit pattern, as int32


def pack_awq(gq: GroupQuant) -> dict[str, torch.Tensor]:
    """AutoAWQ GEMM: qweight [K, N/8], qzeros [G, N/8], scales [G, N] f16."""
    def cols(x: torch.Tensor) -> torch.Tensor:  # [R, N] -> [R, N/8]
        return pack_nibbles(x.reshape(x.shape[0], -1, 8)[..., AWQ_ORDER])

    return {"qweight": cols(gq.q.t()), "qzeros": cols(gq.zero.t()), "scales": gq.scale.t().contiguous()}


def pack_gptq(gq: GroupQuant, v1: bool) -> dict[str, torch.Tensor]:
    """AutoGPTQ: qweight [K/8, N] (8 consecutive inputs per int32), qzeros
    [G, N/8] storing zero - 1 in the original (v1) format, scales, g_idx."""
    qt = gq.q.t()  # [K, N]
    qweight = pack_nibbles(qt.reshape(-1, 8, qt.shape[1]).transpose(1, 2))
    zt = gq.zero.t() - (1 if v1 else 0)  # [G, N]
    assert zt.min() >= 0, "v1 zeros must be >= 1"
    qzeros = pack_nibbles(zt.reshape(zt.shape[0], -1, 8))
    return {"qweight": qweight, "qzeros": qzeros, "scales": gq.scale.t().contiguous(), "g_idx": gq.g_idx}


# ---- GGUF K-quants (llama.cpp's block layouts; QK_K = 256) ----

def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(*x.shape, 2)


def quantize_q4_k(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [N, K] float32 -> (raw blocks [N, K/256 * 144] uint8, the values they hold)."""
    n, k = w.shape
    sub = w.reshape(n, k // 256, 8, 32)
    lo, hi = np.minimum(sub.min(-1), 0), np.maximum(sub.max(-1), 0)
    scale, mn = (hi - lo) / 15, -lo  # per sub-block: w ~ scale q - mn
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (mn.max(-1) / 63).astype(np.float16).astype(np.float32)
    d, dmin = np.maximum(d, 1e-8), np.maximum(dmin, 1e-8)
    sc = np.clip(np.round(scale / d[..., None]), 1, 63).astype(np.uint8)
    m = np.clip(np.round(mn / dmin[..., None]), 0, 63).astype(np.uint8)
    eff_d, eff_m = d[..., None] * sc, dmin[..., None] * m
    q = np.clip(np.round((sub + eff_m[..., None]) / eff_d[..., None]), 0, 15).astype(np.uint8)
    values = (eff_d[..., None] * q.astype(np.float32) - eff_m[..., None]).reshape(n, k)
    s = np.zeros((n, k // 256, 12), np.uint8)
    s[..., 0:4] = (sc[..., :4] & 0x3F) | ((sc[..., 4:] >> 4) << 6)
    s[..., 4:8] = (m[..., :4] & 0x3F) | ((m[..., 4:] >> 4) << 6)
    s[..., 8:12] = (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)
    qs = q.reshape(n, k // 256, 4, 2, 32)
    codes = (qs[..., 0, :] | (qs[..., 1, :] << 4)).reshape(n, k // 256, 128)
    raw = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), s, codes], axis=-1)
    return raw.reshape(n, -1), values


def quantize_q6_k(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [N, K] float32 -> (raw blocks [N, K/256 * 210] uint8, the values they hold)."""
    n, k = w.shape
    sub = w.reshape(n, k // 256, 16, 16)
    amax = np.abs(sub).max(-1) / 31
    d = (np.maximum(amax.max(-1), 1e-8) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(amax / d[..., None]), 1, 127).astype(np.int8)
    eff = d[..., None] * sc.astype(np.float32)
    q = np.clip(np.round(sub / eff[..., None]), -32, 31).astype(np.int16) + 32  # 0..63
    values = (eff[..., None] * (q - 32).astype(np.float32)).reshape(n, k)
    q = q.astype(np.uint8).reshape(n, k // 256, 2, 4, 32)  # half h, quarter j: element 128 h + 32 j + l
    ql = np.concatenate([(q[:, :, :, 0] & 0x0F) | ((q[:, :, :, 2] & 0x0F) << 4),
                         (q[:, :, :, 1] & 0x0F) | ((q[:, :, :, 3] & 0x0F) << 4)], axis=-1)  # [n, b, 2, 64]
    qh = ((q[:, :, :, 0] >> 4) | ((q[:, :, :, 1] >> 4) << 2) | ((q[:, :, :, 2] >> 4) << 4)
          | ((q[:, :, :, 3] >> 4) << 6))  # [n, b, 2, 32]
    raw = np.concatenate([ql.reshape(n, k // 256, 128), qh.reshape(n, k // 256, 64),
                          sc.view(np.uint8), _f16_bytes(d)], axis=-1)
    return raw.reshape(n, -1), values


# ---- a tiny Llama GGUF with a byte-level tokenizer ----

GGUF_DIMS = dict(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2)
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def byte_tokens() -> list[str]:
    """GPT-2's byte-to-character map: 256 tokens, one per byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    cs, extra = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    table = dict(zip(bs, cs, strict=True))
    return [chr(table[b]) for b in range(256)]


def quantize(w: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray]:
    """-> (raw GGUF blocks, the float32 values they hold), independent of gguf's dequantizer."""
    import gguf

    if qtype == "Q4_K":
        return quantize_q4_k(w)
    if qtype == "Q6_K":
        return quantize_q6_k(w)
    kind = gguf.GGMLQuantizationType[qtype]
    raw = gguf.quants.quantize(w, kind)
    blocks = raw.reshape(w.shape[0], -1, gguf.GGML_QUANT_SIZES[kind][1])
    if qtype == "Q8_0":  # d (f16), 32 int8
        d = blocks[..., :2].copy().view(np.float16).astype(np.float32)
        q = blocks[..., 2:].view(np.int8).astype(np.float32)
        return raw, (d * q).reshape(w.shape)
    if qtype == "Q4_0":  # d (f16), 16 bytes: low nibbles inputs 0..15, high 16..31
        d = blocks[..., :2].copy().view(np.float16).astype(np.float32)
        q = np.concatenate([blocks[..., 2:] & 0x0F, blocks[..., 2:] >> 4], -1).astype(np.float32)
        return raw, (d * (q - 8)).reshape(w.shape)
    raise ValueError(qtype)


def write_tiny_gguf(path: str, qtype: str, seed: int = 0) -> dict[str, np.ndarray]:
    """A 2-layer Llama GGUF whose projections and head are in `qtype`; returns
    the float32 values each GGUF tensor holds (by GGUF name, [rows, inputs])."""
    import gguf

    d = GGUF_DIMS
    rng = np.random.default_rng(seed)
    tokens = byte_tokens() + ["Ġt", "Ġa"]  # two merges, so the BPE has some
    vocab = len(tokens)
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("tiny")
    w.add_block_count(d["layers"])
    w.add_context_length(512)
    w.add_embedding_length(d["hidden"])
    w.add_feed_forward_length(d["intermediate"])
    w.add_head_count(d["heads"])
    w.add_head_count_kv(d["kv_heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(d["hidden"] // d["heads"])
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * vocab)
    w.add_token_merges(["Ġ t", "Ġ a"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    values: dict[str, np.ndarray] = {}

    def dense(name: str, shape: tuple[int, ...], scale: float, offset: float = 0.0) -> None:
        x = (rng.standard_normal(shape) * scale + offset).astype(np.float32)
        values[name] = x
        w.add_tensor(name, x)

    def quantized(name: str, rows: int, inputs: int) -> None:
        raw, vals = quantize((rng.standard_normal((rows, inputs)) * 0.08).astype(np.float32), qtype)
        values[name] = vals
        w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[qtype])

    h, i, kv = d["hidden"], d["intermediate"], d["hidden"] // d["heads"] * d["kv_heads"]
    dense("token_embd.weight", (vocab, h), 1.0)
    for b in range(d["layers"]):
        dense(f"blk.{b}.attn_norm.weight", (h,), 0.2, 1.0)
        dense(f"blk.{b}.ffn_norm.weight", (h,), 0.2, 1.0)
        for name, rows, inputs in (("attn_q", h, h), ("attn_k", kv, h), ("attn_v", kv, h),
                                   ("attn_output", h, h), ("ffn_gate", i, h), ("ffn_up", i, h),
                                   ("ffn_down", h, i)):
            quantized(f"blk.{b}.{name}.weight", rows, inputs)
    dense("output_norm.weight", (h,), 0.2, 1.0)
    quantized("output.weight", vocab, h)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return values
