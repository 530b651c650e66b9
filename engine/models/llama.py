"""Llama-family decoder (Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2/3, Phi-3) over the paged KV cache.

Tokens of all scheduled sequences are flattened into one [T] batch; attention
metadata says which rows belong to which sequence.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import replace
from types import ModuleType
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.attention import AttentionFn, AttentionMetadata, write_kv
from engine.layers.packed_linear import PackedLinear, PromptRows, q4_blocks
from engine.models import decode_stack
from engine.models.int4 import Int4Weight, exact_blocks, pack_blocks
from engine.models.spec import LlamaSpec

__all__ = ["AttentionFn", "LlamaForCausalLM", "LlamaSpec", "PackedLinear", "bare_modules", "q4_blocks"]

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
    d = spec.rope_dim
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
    """gemma: scales by (1 + weight), in float32 before the cast back (as
    transformers' Gemma norms do); otherwise by weight, after it (Llama)."""

    def __init__(self, dim: int, eps: float, gemma: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.gemma = gemma

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In float32, as the reference implementation does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)


ACTIVATION: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh")}


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: [T, 1, R/2].  Rotate-half (non-interleaved) form
    over the first R dims of each head; the rest pass through (partial rope)."""
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


def rope_values(inv: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, 1, R/2] of positions (float32) times inv, in dtype."""
    freqs = positions[:, None] * inv.to(positions.device)[None, :]  # [T, R/2]
    return freqs.cos().to(dtype)[:, None, :], freqs.sin().to(dtype)[:, None, :]


RopeRows = tuple[torch.Tensor, torch.Tensor]  # cos, sin


class RopeTable:
    """Each position's cos and sin (rope_values) for positions 0 .. n - 1, per
    inverse frequency tensor and dtype, grown by doubling when a position past
    them is asked for; a step takes its rows with index_select.  Computing them
    per step ran torch's cos and sin over the step's T x R/2 angles, which
    from 256 values on run as a parallel region: with OpenMP's idle threads
    asleep (engine/__init__.py) each woke them, about 60 us on 2 cores for
    32 rows, as advanced indexing does (index_select stays on the calling
    thread).  The same float32 products and cos and sin of them, so the same
    values as computed per step."""

    MIN_POSITIONS = 4096

    def __init__(self) -> None:
        # id(inv) -> (inv, {dtype: (cos, sin)}); inv is held so that its id stays its own
        # (a model's global and local inverse frequencies, as moved to the device)
        self._tables: dict[int, tuple[torch.Tensor, dict[torch.dtype, RopeRows]]] = {}

    def rows(self, inv: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype,
             ) -> tuple[torch.Tensor, torch.Tensor]:
        held = self._tables.get(id(inv))
        if held is None or held[0] is not inv:
            held = self._tables[id(inv)] = (inv, {})
        tables = held[1]
        cos, sin = tables.get(dtype, (None, None))
        top = int(positions.max()) if positions.numel() else 0
        if cos is None or sin is None or top >= cos.shape[0]:
            n = max(self.MIN_POSITIONS, 1 << top.bit_length())
            cos, sin = tables[dtype] = rope_values(inv, torch.arange(n, dtype=torch.float32), dtype)
        idx = positions.long()
        return cos.index_select(0, idx), sin.index_select(0, idx)


# What _forward_fused reads of a layer's submodules, in its order.
_FUSED_PARTS = ("input_layernorm", "post_attention_layernorm", "qkv_proj", "o_proj", "gate_up_proj",
                "down_proj", "q_norm", "k_norm")


class LlamaLayer(nn.Module):
    def __init__(self, spec: LlamaSpec, layer_idx: int) -> None:
        super().__init__()
        self.spec = spec
        self.layer_idx = layer_idx
        h, d = spec.hidden_size, spec.head_dim
        self.q_size, self.kv_size = spec.num_heads * d, spec.num_kv_heads * d
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, h, bias=spec.o_bias)
        self.gate_up_proj = nn.Linear(h, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(spec.intermediate_size, h, bias=spec.mlp_bias)
        g, eps = spec.gemma_norms, spec.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, g)
        # Llama: the MLP's input norm; Gemma: the attention output's (the MLP has its own).
        self.post_attention_layernorm = RMSNorm(h, eps, g)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, g) if g else None
        self.post_feedforward_layernorm = RMSNorm(h, eps, g) if g else None
        self.q_norm = RMSNorm(d, eps, g) if spec.qk_norm else None
        self.k_norm = RMSNorm(d, eps, g) if spec.qk_norm else None
        self.act = ACTIVATION[spec.hidden_act]
        self.window = spec.window(layer_idx)
        self.scale = spec.attn_scale
        self.fused: ModuleType | None = None  # the CPU kernels' fused small ops, set by pack_linears
        self._parts: tuple[Any, ...] | None = None  # _FUSED_PARTS (modules, or None), once gathered

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, attn: AttentionFn) -> torch.Tensor:
        if self.fused is not None:
            return self._forward_fused(self.fused, x, cos, sin, kv_cache, meta, attn)
        s, t = self.spec, x.shape[0]
        qkv = self.qkv_proj(self.input_layernorm(x))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = q.view(t, s.num_heads, s.head_dim), k.view(t, s.num_kv_heads, s.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = v.view(t, s.num_kv_heads, s.head_dim)
        write_kv(kv_cache, self.layer_idx, k, v, meta.slot_mapping)
        o = self.o_proj(attn(q, k, v, kv_cache, self.layer_idx, meta, self.scale, window=self.window,
                             softcap=s.attn_softcap).reshape(t, self.q_size))
        if self.pre_feedforward_layernorm is not None and self.post_feedforward_layernorm is not None:
            x = x + self.post_attention_layernorm(o)
            gate, up = self.gate_up_proj(self.pre_feedforward_layernorm(x)).chunk(2, dim=-1)
            return x + self.post_feedforward_layernorm(self.down_proj(self.act(gate) * up))
        x = x + o
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.down_proj(self.act(gate) * up)

    def _forward_fused(self, f: ModuleType, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       kv_cache: torch.Tensor, meta: AttentionMetadata, attn: AttentionFn) -> torch.Tensor:
        """forward() with the small ops fused (CPU, float32, full-width rope).
        Updates x, the residual stream, in place."""
        # The projections' forward() directly: no hooks are ever registered on
        # them, and nn.Module's __call__ machinery costs a few us a call, 120
        # calls a step (the same holds for the layer call in LlamaForCausalLM).
        # The submodules from a plain tuple: nn.Module looks each one up in
        # Python (about 1 us; eight a layer).
        norm1, norm2, qkv_proj, o_proj, gate_up_proj, down_proj, q_norm, k_norm = (
            self._parts if self._parts is not None else self._gather_parts())
        s, t = self.spec, x.shape[0]
        qkv = _normed(qkv_proj, f, x, norm1)
        if q_norm is not None and k_norm is not None:  # per head, in place, ahead of rope
            for norm, lo, n in ((q_norm, 0, s.num_heads), (k_norm, self.q_size, s.num_kv_heads)):
                part = qkv[:, lo:lo + n * s.head_dim]
                part.copy_(f.rms_norm(part.reshape(t, n, s.head_dim), norm.weight, norm.eps).view(t, -1))
        v = qkv[:, self.q_size + self.kv_size:].view(t, s.num_kv_heads, s.head_dim)
        # Stored in the cache's dtype (float32, bfloat16 or fp8) as write_kv would store them.
        q, k = f.rope_and_store_kv(qkv, cos, sin, kv_cache, self.layer_idx, meta.slot_mapping,
                                   s.num_heads, s.num_kv_heads)
        o = attn(q, k, v, kv_cache, self.layer_idx, meta, self.scale, window=self.window)
        # x += o_proj(o), then gate_up_proj(norm2(x))
        o = o_proj.forward(o.reshape(t, self.q_size))
        if isinstance(gate_up_proj, PackedLinear) and isinstance(down_proj, PackedLinear):
            gated = gate_up_proj.forward_normed_silu(o, norm2.weight, norm2.eps, x)
            if gated is not None:  # silu(gate) * up from the projection's own call
                return x.add_(down_proj.forward(gated))
        gate_up = _normed(gate_up_proj, f, o, norm2, x)
        if isinstance(down_proj, PackedLinear):
            return x.add_(down_proj.forward_silu(gate_up))
        return x.add_(down_proj.forward(f.silu_and_mul(gate_up)))

    def _gather_parts(self) -> tuple[Any, ...]:
        parts = self._parts = tuple(getattr(self, name) for name in _FUSED_PARTS)
        return parts

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name in _FUSED_PARTS:  # a submodule swapped (a LoRA wrapper): gathered again
            self.__dict__["_parts"] = None


def _normed(proj: nn.Module, f: ModuleType, x: torch.Tensor, norm: RMSNorm,
            residual: torch.Tensor | None = None) -> torch.Tensor:
    """proj(f.rms_norm(x, norm's weight and eps, residual)); a packed projection
    norms its rows itself where it can (PackedLinear.forward_normed), a
    wrapped one (LoRA) takes them normed."""
    if isinstance(proj, PackedLinear):
        return proj.forward_normed(x, norm.weight, norm.eps, residual)
    return proj.forward(f.rms_norm(x, norm.weight, norm.eps, residual))


class LlamaForCausalLM(nn.Module):
    def __init__(self, spec: LlamaSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(LlamaLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.gemma_norms)
        self.fused: ModuleType | None = None  # set by pack_linears
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # A plain attribute, not a buffer: it stays float32 when the weights change dtype.
        # Always computed on the CPU: on the meta device it would hold no data (and cost
        # torch's reference-op imports, seconds of start-up).
        with torch.device("cpu"):
            self.inv_freq = inv_freq(spec)
            # The sliding-window layers' own rope (Gemma 3), or None.
            self.local_inv_freq = None if spec.local_rope_theta is None else inv_freq(
                replace(spec, rope_theta=spec.local_rope_theta, rope_scaling=None))
        self.rope_tables = RopeTable()
        # A decode step's pass through every layer in one kernel call (decode_stack.py),
        # built at the first such step: None until then, or after the layers change.
        self._decode_stack: decode_stack.DecodeStack | None = None
        self._decode_stack_built = False

    def rope(self, inv: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype,
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, R/2] of each position's angles (position * inv).
        On the CPU, rows of a table of every position up to the largest asked
        for (RopeTable): the same values, each computed once."""
        if positions.device.type == "cpu" and inv.device.type == "cpu":
            return self.rope_tables.rows(inv, positions, dtype)
        return rope_values(inv, positions.float(), dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, attn: AttentionFn) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden]."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        x = self.embed_tokens(input_ids)
        if self.spec.gemma_norms:  # Gemma scales the embedding, rounded to the model's dtype
            x = x * torch.tensor(self.spec.hidden_size ** 0.5, dtype=x.dtype)
        rope = self.rope(self.inv_freq, positions, x.dtype)
        local = rope if self.local_inv_freq is None else self.rope(self.local_inv_freq, positions, x.dtype)
        stack = self._stack(kv_cache)
        if stack is not None and stack.runs(x, meta, attn, kv_cache):
            x = stack.forward(x, *rope, kv_cache, meta)
        else:
            for layer in self.layers:
                cos, sin = local if cast(LlamaLayer, layer).window is not None else rope
                x = layer.forward(x, cos, sin, kv_cache, meta, attn)
        if self.fused is not None:
            return self.fused.rms_norm(x, self.norm.weight, self.norm.eps)
        return self.norm(x)

    def _stack(self, kv_cache: torch.Tensor) -> decode_stack.DecodeStack | None:
        """The decode stack, built once for the packed kernels (None where it
        does not cover this model), again when a layer's submodules change."""
        if self.fused is None:
            return None
        held = self._decode_stack
        if not self._decode_stack_built or (held is not None and not held.current(self.layers)):
            self._decode_stack = decode_stack.build(self, kv_cache)
            self._decode_stack_built = True
        return self._decode_stack

    def _layers_changed(self) -> None:
        """The projections' paths or weights changed: the decode stack is built again."""
        self._decode_stack, self._decode_stack_built = None, False

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.spec.final_softcap
        return logits if cap is None else cap * torch.tanh(logits / cap)

    def fuses_argmax(self, prompt_tokens: bool) -> bool:
        """Whether compute_argmax runs for a step's head rows (some of them
        prompt tokens or none): a head whose kernel fuses it
        (PackedLinear.fuses_argmax) and no soft cap (its tanh makes ties)."""
        return (self.spec.final_softcap is None and isinstance(self.lm_head, PackedLinear)
                and self.lm_head.fuses_argmax(prompt_tokens))

    def compute_argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """compute_logits(hidden).argmax(-1) without the logits (fuses_argmax)."""
        assert isinstance(self.lm_head, PackedLinear)
        return self.lm_head.argmax(hidden)

    def linear_names(self) -> list[str]:
        """The layers pack_linears swaps, by attribute path."""
        return [f"layers.{i}.{name}" for i in range(len(self.layers))
                for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")] + ["lm_head"]

    def pack_linears(self, kernel: ModuleType, panels: Mapping[str, torch.Tensor] | None = None,
                     int4: Mapping[str, Int4Weight] | None = None, int4_only: bool = False) -> None:
        """Swap every projection and the head for a PackedLinear (CPU, float32),
        packing their weights or taking `panels` packed before (by linear_names,
        4-bit blocks under "path#q4").  `int4`: layers' weights as the checkpoint
        quantized them (by linear path); with int4_only those layers hold their
        4-bit blocks alone (their float weights were never loaded)."""
        self._layers_changed()
        for path in self.linear_names():
            parent_path, _, name = path.rpartition(".")
            parent = self.get_submodule(parent_path) if parent_path else self
            linear = getattr(parent, name)
            stored: dict[str, torch.Tensor] | None = None
            if panels is not None:
                stored = {k: panels[f"{path}{k}"] for k in ("", "#q4", "#q8") if f"{path}{k}" in panels}
            elif int4 is not None and path in int4:
                if int4_only:
                    stored = {"#q4": pack_blocks(int4[path])}
                else:  # the float weights are loaded: the blocks if they rebuild them, else their panels
                    q4 = exact_blocks(int4[path], kernel, linear.weight.detach())
                    stored = ({"#q4": q4} if q4 is not None
                              else {"": kernel.pack_weight(linear.weight.detach())})
            setattr(parent, name, PackedLinear(linear, kernel, stored))
        if not self.spec.fusable:  # the projections stay packed; the small ops run in torch
            return
        self.fused = kernel
        for layer in self.layers:
            cast(LlamaLayer, layer).fused = kernel

    def enable_bf16_prompts(self, rows: PromptRows | None = None) -> PromptRows:
        """prefill_dtype=bfloat16: every layer's projections (not the head)
        also hold bfloat16 panels and run the rows the returned PromptRows
        (`rows`, or new) names, set per step, on them."""
        self._layers_changed()
        rows = rows if rows is not None else PromptRows()
        for path in self.linear_names():
            layer = self.get_submodule(path)
            if path != "lm_head" and isinstance(layer, PackedLinear):
                layer.enable_bf16(rows)
        return rows

    def bf16_head_prompts(self, rows: PromptRows | None) -> None:
        """A bfloat16 model on the packed kernels: the head's prompt rows (a
        prompt's last token) on its bfloat16 panels too, its other rows on
        those (bfloat16-weights) or its 8-bit blocks (bfloat16): no row reads
        its float32 panels then."""
        if isinstance(self.lm_head, PackedLinear) and rows is not None:
            self.lm_head.enable_bf16(rows)

    def drop_unread_panels(self) -> None:
        """Free each packed layer's panels that no row reads (PackedLinear.drop_unread)."""
        self._layers_changed()
        for path in self.linear_names():
            layer = self.get_submodule(path)
            if isinstance(layer, PackedLinear):
                layer.drop_unread()

    def offer_bf16_panels(self, panels: Mapping[str, torch.Tensor]) -> None:
        """bfloat16 panels packed before (by linear path, as bf16_panels gives
        them): each packed layer takes its own where they fit, and runs on
        them if it is asked to hold bfloat16 panels (drop_unread frees the rest)."""
        self._layers_changed()
        for path in self.linear_names():
            layer = self.get_submodule(path)
            if isinstance(layer, PackedLinear) and path in panels:
                layer.offer_bf16(panels[path])

    def bf16_panels(self) -> dict[str, torch.Tensor]:
        """Each packed layer's bfloat16 panels, where it holds them, by linear path."""
        out: dict[str, torch.Tensor] = {}
        for path in self.linear_names():
            layer = self.get_submodule(path)
            if isinstance(layer, PackedLinear) and layer.bf16 is not None:
                out[path] = layer.bf16
        return out

    def enable_decodes(self, decode_dtype: str, rows: PromptRows, head_rows: PromptRows) -> None:
        """decode_dtype int8 or bfloat16: every layer's 4-bit projections run the
        rows `rows` does not mark as prompt tokens on int8 (or bfloat16) inputs,
        and a quantized head (4- or 8-bit) those `head_rows` does not mark;
        bfloat16-weights: every packed projection and the head on bfloat16
        panels (PackedLinear.enable_int8, enable_bf16_decodes, enable_bf16_weights)."""
        self._layers_changed()
        enable = {"int8": "enable_int8", "bfloat16": "enable_bf16_decodes",
                  "bfloat16-weights": "enable_bf16_weights"}[decode_dtype]
        for path in self.linear_names():
            layer = self.get_submodule(path)
            if isinstance(layer, PackedLinear):
                getattr(layer, enable)(head_rows if path == "lm_head" else rows)

    def packed_panels(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for path in self.linear_names():
            layer = cast(PackedLinear, self.get_submodule(path))
            out.update({f"{path}{k}": v for k, v in layer.stored().items()})
        return out

    def linear_sources(self) -> dict[str, list[str]]:
        """The checkpoint tensors (Hugging Face names) each packed layer's
        weight is made of, stacked along the outputs; the head only if untied."""
        out: dict[str, list[str]] = {}
        for i in range(self.spec.num_layers):
            p, mine = f"model.layers.{i}.", f"layers.{i}."
            a = p + "self_attn."
            if self.spec.fused_checkpoint:  # Phi-3 stores the fused layout already
                out[mine + "qkv_proj"] = [a + "qkv_proj.weight"]
                out[mine + "gate_up_proj"] = [p + "mlp.gate_up_proj.weight"]
            else:
                out[mine + "qkv_proj"] = [a + f"{x}_proj.weight" for x in "qkv"]
                out[mine + "gate_up_proj"] = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
            out[mine + "o_proj"] = [a + "o_proj.weight"]
            out[mine + "down_proj"] = [p + "mlp.down_proj.weight"]
        if not self.spec.tie_word_embeddings:
            out["lm_head"] = ["lm_head.weight"]
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
        draft.local_inv_freq = self.local_inv_freq
        draft.rope_tables = self.rope_tables
        return draft.eval()

    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor], skip_linear_weights: bool = False,
                           skip_linears: Collection[str] = ()) -> None:
        """Load Hugging Face tensor names, fusing q/k/v and gate/up.  With
        skip_linear_weights the projections' and head's weights are left out
        (their packed copies come from elsewhere), as are those of the layers
        in skip_linears (quantized ones, packed from their codes); biases and
        the rest load."""
        own = dict(self.named_parameters())
        loaded: set[str] = set()
        sources = self.linear_sources()
        skipped = {f"{path}.weight" for path in sources if skip_linear_weights or path in skip_linears}

        def put(name: str, value: torch.Tensor | Callable[[], torch.Tensor]) -> None:
            loaded.add(name)
            if name in skipped:
                return
            with torch.no_grad():
                own[name].copy_(value() if callable(value) else value)

        def get(name: str) -> torch.Tensor:
            if name not in tensors:
                raise ValueError(f"model: the checkpoint has no tensor {name!r}")
            return tensors[name]

        def fused(names: list[str]) -> Callable[[], torch.Tensor]:  # read only if not skipped
            return lambda: torch.cat([get(n) for n in names])

        put("embed_tokens.weight", get("model.embed_tokens.weight"))
        put("norm.weight", get("model.norm.weight"))
        for path, names in sources.items():
            put(f"{path}.weight", fused(names))
        spec = self.spec
        for i in range(spec.num_layers):
            p, mine = f"model.layers.{i}.", f"layers.{i}."
            a = p + "self_attn."
            if spec.qkv_bias:
                put(mine + "qkv_proj.bias", fused([a + f"{x}_proj.bias" for x in "qkv"]))
            if spec.o_bias:
                put(mine + "o_proj.bias", get(a + "o_proj.bias"))
            if spec.mlp_bias:
                put(mine + "gate_up_proj.bias", fused([p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias"]))
                put(mine + "down_proj.bias", get(p + "mlp.down_proj.bias"))
            if spec.qk_norm:
                put(mine + "q_norm.weight", get(a + "q_norm.weight"))
                put(mine + "k_norm.weight", get(a + "k_norm.weight"))
            norms = ["input_layernorm", "post_attention_layernorm"]
            if spec.gemma_norms:
                norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
            for norm in norms:
                put(mine + f"{norm}.weight", get(p + f"{norm}.weight"))
        missing = set(own) - loaded
        if missing:
            raise ValueError(f"model: weights missing for {sorted(missing)[:5]}")
