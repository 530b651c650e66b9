"""Llama-family decoder (Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2) over the paged KV cache.

Tokens of all scheduled sequences are flattened into one [T] batch; attention
metadata says which rows belong to which sequence.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.attention import AttentionMetadata, write_kv

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int,
                        AttentionMetadata, float], torch.Tensor]


@dataclass(frozen=True)
class LlamaSpec:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> LlamaSpec:
        arch = cfg.get("model_type", "llama")
        if arch not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"model: architecture {arch!r} is not supported (llama, mistral, qwen2)")
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            rope_scaling=scaling, max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=arch == "qwen2" or cfg.get("attention_bias", False))


@contextlib.contextmanager
def bare_modules() -> Iterator[None]:
    """Build modules on the meta device without running their weight init: the
    weights are loaded right after, and torch's random init on meta tensors
    imports its reference ops (about 3 s of a worker's start-up)."""
    names = ("normal_", "uniform_", "kaiming_uniform_")
    saved = {n: getattr(nn.init, n) for n in names}
    for n in names:
        setattr(nn.init, n, lambda tensor, *args, **kwargs: tensor)
    try:
        with torch.device("meta"):
            yield
    finally:
        for n, f in saved.items():
            setattr(nn.init, n, f)


def inv_freq(spec: LlamaSpec) -> torch.Tensor:
    d = spec.head_dim
    # float32 like the reference implementation, so positions rotate identically.
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = spec.rope_scaling
    if s is None:
        return inv.float()
    kind = s.get("rope_type", s.get("type"))
    if kind == "linear":
        return (inv / s["factor"]).float()
    if kind == "llama3":
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled).float()
    raise ValueError(f"model: rope scaling {kind!r} is not supported")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In float32, as the reference implementation does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: [T, 1, D/2].  Rotate-half (non-interleaved) form."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def q4_blocks(weight: torch.Tensor, kernel: ModuleType) -> torch.Tensor | None:
    """The weight as exact 4-bit blocks for kernel.q4_linear, if it is one: a
    matrix dequantized from GGUF Q4_1 (w = d * q + m, q in 0..15, d and m
    float16, per 32 inputs).  None unless every weight rebuilds bit for bit."""
    n, k = weight.shape
    if k % 32:
        return None
    p = (n + 15) // 16
    w = torch.zeros(p * 16, k, dtype=torch.float32)
    w[:n] = weight
    w3 = w.view(p * 16, k // 32, 32)
    m = w3.amin(-1)
    d = ((w3.amax(-1) - m) / 15).half().float()
    if not (torch.isfinite(d).all() and torch.equal(m.half().float(), m)):
        return None
    safe = torch.where(d == 0, torch.ones_like(d), d)
    q = ((w3 - m[..., None]) / safe[..., None]).round().clamp_(0, 15)
    kb = k // 32
    dm = torch.cat([d.view(p, 16, kb).transpose(1, 2), m.view(p, 16, kb).transpose(1, 2)], dim=-1)
    qb = q.to(torch.uint8).view(p, 16, kb, 32).permute(0, 2, 3, 1)  # [p, kb, 32, 16]
    nibbles = qb[..., :8] | (qb[..., 8:] << 4)  # byte j: column j low, column j + 8 high
    blocks = torch.cat([dm.contiguous().view(torch.uint8).view(p, kb, 128),
                        nibbles.reshape(p, kb, 256)], dim=-1).contiguous()
    if not torch.equal(kernel.q4_unpack(blocks, n), weight):  # rebuilt as the kernel rebuilds them
        return None
    return blocks


# Up to this many rows a projection reads its 4-bit copy (decoding few sequences
# is memory-bound); beyond, the float32 panels (rebuilding weights costs compute).
Q4_MAX_ROWS = 4


class PackedLinear(nn.Module):
    """A float32 linear layer whose weight is packed once for the CPU kernel
    (csrc/linear_cpu.cpp); the BLAS would repack it on every call, which
    dominates decode steps of a few rows.  Holds the packed copy only."""

    panels: torch.Tensor
    q4: torch.Tensor | None

    def __init__(self, linear: nn.Linear, kernel: ModuleType, panels: torch.Tensor | None = None,
                 q4: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernel = kernel
        if panels is None:
            weight = linear.weight.detach()
            panels = kernel.pack_weight(weight)
            q4 = q4_blocks(weight, kernel)
        elif panels.shape != ((self.out_features + 15) // 16, self.in_features, 16):
            raise ValueError(f"packed weights: {tuple(panels.shape)} do not fit a "
                             f"{self.in_features}->{self.out_features} layer")
        self.register_buffer("panels", panels, persistent=False)
        self.register_buffer("q4", q4 if q4 is not None and q4.numel() else None, persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.q4 is not None and x.numel() <= Q4_MAX_ROWS * self.in_features:
            return self.kernel.q4_linear(x, self.q4, self.out_features, self.bias)
        return self.kernel.packed_linear(x, self.panels, self.out_features, self.bias)


class LlamaLayer(nn.Module):
    def __init__(self, spec: LlamaSpec, layer_idx: int) -> None:
        super().__init__()
        self.spec = spec
        self.layer_idx = layer_idx
        h, d = spec.hidden_size, spec.head_dim
        self.q_size, self.kv_size = spec.num_heads * d, spec.num_kv_heads * d
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, h, bias=False)
        self.gate_up_proj = nn.Linear(h, 2 * spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, h, bias=False)
        self.input_layernorm = RMSNorm(h, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, spec.rms_norm_eps)
        self.scale = d ** -0.5
        self.fused: ModuleType | None = None  # the CPU kernels' fused small ops, set by pack_linears

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, attn: AttentionFn) -> torch.Tensor:
        if self.fused is not None:
            return self._forward_fused(self.fused, x, cos, sin, kv_cache, meta, attn)
        s, t = self.spec, x.shape[0]
        qkv = self.qkv_proj(self.input_layernorm(x))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(t, s.num_heads, s.head_dim), cos, sin)
        k = apply_rope(k.view(t, s.num_kv_heads, s.head_dim), cos, sin)
        v = v.view(t, s.num_kv_heads, s.head_dim)
        write_kv(kv_cache, self.layer_idx, k, v, meta.slot_mapping)
        o = attn(q, k, v, kv_cache, self.layer_idx, meta, self.scale)
        x = x + self.o_proj(o.reshape(t, self.q_size))
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)

    def _forward_fused(self, f: ModuleType, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       kv_cache: torch.Tensor, meta: AttentionMetadata, attn: AttentionFn) -> torch.Tensor:
        """forward() with the small ops fused (CPU, float32).  Updates x, the
        residual stream, in place."""
        s, t = self.spec, x.shape[0]
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        qkv = self.qkv_proj(f.rms_norm(x, norm1.weight, norm1.eps))
        q, k = f.rope_and_store_kv(qkv, cos, sin, kv_cache, self.layer_idx, meta.slot_mapping,
                                   s.num_heads, s.num_kv_heads)
        v = qkv[:, self.q_size + self.kv_size:].view(t, s.num_kv_heads, s.head_dim)
        o = attn(q, k, v, kv_cache, self.layer_idx, meta, self.scale)
        h = f.rms_norm(self.o_proj(o.reshape(t, self.q_size)), norm2.weight, norm2.eps, x)  # x += o_proj(o)
        return x.add_(self.down_proj(f.silu_and_mul(self.gate_up_proj(h))))


class LlamaForCausalLM(nn.Module):
    def __init__(self, spec: LlamaSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(LlamaLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.fused: ModuleType | None = None  # set by pack_linears
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # A plain attribute, not a buffer: it stays float32 when the weights change dtype.
        # Always computed on the CPU: on the meta device it would hold no data (and cost
        # torch's reference-op imports, seconds of start-up).
        with torch.device("cpu"):
            self.inv_freq = inv_freq(spec)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        return freqs.cos().to(dtype)[:, None, :], freqs.sin().to(dtype)[:, None, :]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, attn: AttentionFn) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden]."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, kv_cache, meta, attn)
        if self.fused is not None:
            return self.fused.rms_norm(x, self.norm.weight, self.norm.eps)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def linear_names(self) -> list[str]:
        """The layers pack_linears swaps, by attribute path."""
        return [f"layers.{i}.{name}" for i in range(len(self.layers))
                for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")] + ["lm_head"]

    def pack_linears(self, kernel: ModuleType, panels: Mapping[str, torch.Tensor] | None = None) -> None:
        """Swap every projection and the head for a PackedLinear (CPU, float32),
        packing their weights or taking `panels` packed before (by linear_names)."""
        for path in self.linear_names():
            parent_path, _, name = path.rpartition(".")
            parent = self.get_submodule(parent_path) if parent_path else self
            packed = q4 = None
            if panels is not None:
                packed, q4 = panels[path], panels.get(f"{path}#q4")
            setattr(parent, name, PackedLinear(getattr(parent, name), kernel, packed, q4))
        self.fused = kernel
        for layer in self.layers:
            cast(LlamaLayer, layer).fused = kernel

    def packed_panels(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for path in self.linear_names():
            layer = cast(PackedLinear, self.get_submodule(path))
            out[path] = layer.panels
            if layer.q4 is not None:
                out[f"{path}#q4"] = layer.q4
        return out

    def first_layers(self, num_layers: int) -> LlamaForCausalLM:
        """A model made of this one's embedding, first num_layers layers, final
        norm and head, sharing their weights (self-speculation: no new weights).
        Its layers keep their indices 0..num_layers-1, so it runs over a KV
        cache of num_layers layers."""
        if not 1 <= num_layers < self.spec.num_layers:
            raise ValueError(f"speculative_config.num_layers: must be in [1, {self.spec.num_layers - 1}] "
                             f"for a {self.spec.num_layers}-layer model, got {num_layers}")
        with bare_modules():
            draft = LlamaForCausalLM(replace(self.spec, num_layers=num_layers))
        draft.embed_tokens = self.embed_tokens
        draft.layers = nn.ModuleList(self.layers[:num_layers])
        draft.norm = self.norm
        draft.lm_head = self.lm_head
        draft.inv_freq = self.inv_freq
        return draft.eval()

    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor], skip_linear_weights: bool = False) -> None:
        """Load Hugging Face tensor names, fusing q/k/v and gate/up.  With
        skip_linear_weights the projections' and head's weights are left out
        (their packed copies come from elsewhere); biases and the rest load."""
        own = dict(self.named_parameters())
        loaded: set[str] = set()
        skipped = {f"{path}.weight" for path in self.linear_names()} if skip_linear_weights else set()
        if skipped and self.spec.tie_word_embeddings:
            skipped.discard("lm_head.weight")  # it is the embedding

        def put(name: str, value: torch.Tensor | Callable[[], torch.Tensor]) -> None:
            loaded.add(name)
            if name in skipped:
                return
            with torch.no_grad():
                own[name].copy_(value() if callable(value) else value)

        def get(name: str) -> torch.Tensor:
            return tensors[name]

        put("embed_tokens.weight", get("model.embed_tokens.weight"))
        put("norm.weight", get("model.norm.weight"))
        if not self.spec.tie_word_embeddings:
            put("lm_head.weight", get("lm_head.weight"))
        for i in range(self.spec.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            put(f"layers.{i}.qkv_proj.weight", functools.partial(
                torch.cat, [get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight")]))
            if self.spec.qkv_bias:
                put(f"layers.{i}.qkv_proj.bias",
                    torch.cat([get(a + "q_proj.bias"), get(a + "k_proj.bias"), get(a + "v_proj.bias")]))
            put(f"layers.{i}.o_proj.weight", get(a + "o_proj.weight"))
            put(f"layers.{i}.gate_up_proj.weight",
                functools.partial(torch.cat,
                                  [get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]))
            put(f"layers.{i}.down_proj.weight", get(p + "mlp.down_proj.weight"))
            put(f"layers.{i}.input_layernorm.weight", get(p + "input_layernorm.weight"))
            put(f"layers.{i}.post_attention_layernorm.weight", get(p + "post_attention_layernorm.weight"))
        missing = set(own) - loaded
        if missing:
            raise ValueError(f"model: weights missing for {sorted(missing)[:5]}")
