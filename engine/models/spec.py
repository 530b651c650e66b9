"""What the decoder needs to know about a checkpoint, read once from its
Hugging Face config.json.  One frozen dataclass covers every supported family
(Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2/2.5, Qwen3, Phi-3, Gemma 2/3); fields say
how a family departs from Llama, so the model code branches on features, never
on family names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# model_type -> how its checkpoint stores attention and MLP weights.
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")
GEMMA = ("gemma2", "gemma3_text")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


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
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and k, before rope (Qwen3)
    # Keys a query at position p sees: p - window + 1 .. p; None: all (per layer).
    layer_windows: tuple[int | None, ...] = ()
    rotary_dim: int = 0  # leading dims of a head that rope rotates; 0: all of them
    fused_checkpoint: bool = False  # qkv_proj and gate_up_proj stored fused (Phi-3)
    # Gemma: norms scale by (1 + weight); the embedding by sqrt(hidden); the
    # attention output and the MLP output are normed too ("sandwich"), and the
    # MLP input by its own pre_feedforward_layernorm.
    gemma_norms: bool = False
    hidden_act: str = "silu"  # the GLU's gate activation
    query_pre_attn_scalar: float | None = None  # scores scale by its -1/2 power, not head_dim's
    attn_softcap: float | None = None  # scores s -> C tanh(s / C) (Gemma 2)
    final_softcap: float | None = None  # the same on the logits
    local_rope_theta: float | None = None  # rope base of the sliding-window layers (Gemma 3)

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def fusable(self) -> bool:
        """Whether the CPU kernels' fused small ops (Llama's block: plain norms,
        SiLU, whole-head rope) compute this model's layers."""
        return self.rope_dim == self.head_dim and not self.gemma_norms and self.hidden_act == "silu"

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> LlamaSpec:
        arch = cfg.get("model_type", "llama")
        if arch not in FAMILIES:
            raise ValueError(f"model: architecture {arch!r} is not supported ({', '.join(FAMILIES)})")
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        local_theta = None
        if arch == "gemma3_text":  # full layers: scaled rope; sliding ones: their own base, unscaled
            local_theta = float((rope.get("sliding_attention") or {}).get(
                "rope_theta", cfg.get("rope_local_base_freq", 10000.0)))
            rope = rope.get("full_attention") or rope
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind == "longrope":
            # Phi-3 128k: the factors switch with the sequence's length, which
            # would make a sequence's cached keys depend on how long it grows.
            raise ValueError("model: rope_scaling type 'longrope' (config rope_scaling.rope_type / "
                             "rope_parameters.rope_type) is not supported")
        partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
        attention_bias = bool(cfg.get("attention_bias", False))
        layers = cfg["num_hidden_layers"]
        act = cfg.get("hidden_activation") or cfg.get("hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise ValueError(f"model: hidden_act {act!r} is not supported ({', '.join(ACTIVATIONS)})")
        gemma = arch in GEMMA
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=layers,
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            rope_scaling=rope if kind != "default" else None,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=arch == "qwen2" or (arch != "phi3" and attention_bias),
            o_bias=arch in ("llama", "qwen3", *GEMMA) and attention_bias,
            mlp_bias=arch == "llama" and bool(cfg.get("mlp_bias", False)),
            qk_norm=arch in ("qwen3", "gemma3_text"),
            layer_windows=layer_windows(cfg, layers, arch),
            rotary_dim=int(head_dim * partial) if partial != 1.0 else 0,
            fused_checkpoint=arch == "phi3",
            gemma_norms=gemma, hidden_act=act,
            query_pre_attn_scalar=float(cfg["query_pre_attn_scalar"]) if gemma else None,
            attn_softcap=cfg.get("attn_logit_softcapping") if gemma else None,
            final_softcap=cfg.get("final_logit_softcapping") if gemma else None,
            local_rope_theta=local_theta)


def layer_windows(cfg: dict[str, Any], num_layers: int, arch: str) -> tuple[int | None, ...]:
    """Per layer, the sliding window or None, as transformers applies it: on
    the layers `layer_types` marks "sliding_attention" where the config lists
    them (Qwen2/3 with use_sliding_window, Gemma), else on every layer when
    `sliding_window` is set (Mistral, Phi-3)."""
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types is None and arch in GEMMA and window:  # configs saved before layer_types
        every = 2 if arch == "gemma2" else cfg.get("sliding_window_pattern", 6)
        types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(num_layers)]
    if types is not None:
        if len(types) != num_layers:
            raise ValueError(f"model: layer_types lists {len(types)} layers, "
                             f"num_hidden_layers is {num_layers}")
        unknown = set(types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ValueError(f"model: layer_types {sorted(unknown)} are not supported")
        if "sliding_attention" in types and not window:
            raise ValueError("model: layer_types has sliding_attention layers but sliding_window is not set")
        windows = tuple(window if t == "sliding_attention" else None for t in types)
    elif "use_sliding_window" in cfg:  # Qwen2/3 configs name a window they may not use
        first = cfg.get("max_window_layers", 0) if cfg["use_sliding_window"] else num_layers
        windows = tuple(window if i >= first else None for i in range(num_layers))
    else:
        windows = (window or None,) * num_layers
    if any(w is not None and (not isinstance(w, int) or w < 1) for w in windows):
        raise ValueError(f"model: sliding_window must be a positive integer, got {window!r}")
    return windows if any(w is not None for w in windows) else ()
