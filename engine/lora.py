"""LoRA: adapters as a delta added after each base projection.

The base projections (packed CPU kernels or torch linears) are left as they
are; each of a layer's four projections is wrapped in a LoRALinear that adds
`(x @ A.T) @ B.T` for the rows whose request uses an adapter.  A batch mixes
adapters and the base: per step the runner groups the flattened rows by
adapter (LoRABatch) and each wrapper loops over those groups (few adapters
per step; a gathered bmm would copy the A/B matrices per row).

PEFT names map onto the fused projections: q/k/v_proj are slices of
qkv_proj's output, gate/up_proj of gate_up_proj's.  A fused projection's
adapter is one A (the pieces' A stacked, [k*r, in]) and one block-diagonal B
([out, k*r], the scale folded in).
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from engine.vocab.lora_request import KEY_RE, LoRARequest, adapter_digest, adapter_files, check_adapter_config

log = logging.getLogger(__name__)

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@dataclass
class LoRAAdapter:
    name: str
    path: str
    digest: str
    rank: int
    # "layers.{i}.{projection}" -> (A [R, in], B [out, R] scaled)
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def _pieces(spec: Any) -> dict[str, tuple[str, int, int]]:
    """PEFT module name -> (our projection, output rows lo, hi)."""
    q, kv, inter = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.intermediate_size
    return {"q_proj": ("qkv_proj", 0, q), "k_proj": ("qkv_proj", q, q + kv),
            "v_proj": ("qkv_proj", q + kv, q + 2 * kv), "qkv_proj": ("qkv_proj", 0, q + 2 * kv),
            "o_proj": ("o_proj", 0, spec.hidden_size), "gate_proj": ("gate_up_proj", 0, inter),
            "up_proj": ("gate_up_proj", inter, 2 * inter), "gate_up_proj": ("gate_up_proj", 0, 2 * inter),
            "down_proj": ("down_proj", 0, spec.hidden_size)}


def load_adapter(req: LoRARequest, spec: Any, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> LoRAAdapter:
    """Read a PEFT adapter directory into fused per-projection matrices."""
    from safetensors.torch import load_file

    cfg_file, weights_file = adapter_files(req.lora_path)
    digest = adapter_digest(req.lora_path)
    r, scale = check_adapter_config(json.loads(cfg_file.read_text()), max_rank)
    pieces = _pieces(spec)
    q_size = spec.num_heads * spec.head_dim
    in_features = {"qkv_proj": spec.hidden_size, "o_proj": q_size, "gate_up_proj": spec.hidden_size,
                   "down_proj": spec.intermediate_size}
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in load_file(str(weights_file)).items():
        m = KEY_RE.search(key)
        if m is None or m.group(2) not in pieces or int(m.group(1)) >= spec.num_layers:
            raise ValueError(f"lora_path: adapter weight {key!r} targets a module this engine "
                             f"does not adapt (it adapts {', '.join(sorted(pieces))})")
        found.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = t.float()
    adapter = LoRAAdapter(req.lora_name, req.lora_path, digest, r)
    grouped: dict[str, list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
    for (layer, module), ab in sorted(found.items()):
        proj, lo, hi = pieces[module]
        a, b = ab.get("A"), ab.get("B")
        # Checked here, not in a step: a misshapen adapter must not fail the batch it joins.
        if a is None or b is None or a.shape != (r, in_features[proj]) or b.shape != (hi - lo, r):
            raise ValueError(f"lora_path: layer {layer} {module}: lora_A/lora_B missing or not "
                             f"[{r}, {in_features[proj]}] / [{hi - lo}, {r}] (an adapter of another model?)")
        grouped.setdefault(f"layers.{layer}.{proj}", []).append((lo, hi, a, b))
    for name, parts in grouped.items():
        a_cat = torch.cat([a for _, _, a, _ in parts])  # [k*r, in]
        out = pieces[name.rpartition(".")[2]][2]  # the whole projection's rows
        b_full = torch.zeros(out, a_cat.shape[0])  # block-diagonal [out, k*r]
        for i, (lo, hi, _, b) in enumerate(parts):
            b_full[lo:hi, i * r:(i + 1) * r] = b * scale
        adapter.weights[name] = (a_cat.to(dtype=dtype, device=device).contiguous(),
                                 b_full.to(dtype=dtype, device=device).contiguous())
    return adapter


@dataclass
class LoRABatch:
    """This step's rows grouped by adapter: (adapter, row indices [n] or None for all rows)."""

    groups: list[tuple[LoRAAdapter, torch.Tensor | None]] = field(default_factory=list)


class LoRALinear(nn.Module):
    """A base projection plus the delta of each adapter in the batch."""

    def __init__(self, base: nn.Module, name: str, batch: LoRABatch) -> None:
        super().__init__()
        self.base, self.name, self.batch = base, name, batch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # [T, out]
        for adapter, rows in self.batch.groups:
            ab = adapter.weights.get(self.name)
            if ab is None:
                continue
            a, b = ab
            if rows is None:
                y.add_((x @ a.t()) @ b.t())
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ a.t()) @ b.t())
        return y


class LoRAManager:
    """The adapters one engine holds (at most max_loras, least recently used
    evicted first) and the wrappers that apply them.  A request keeps its
    adapter object, so an eviction or unload never changes a request in flight."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int) -> None:
        self.model = model
        self.spec = cast(Any, model).spec
        self.max_loras, self.max_rank = max_loras, max_rank
        self.adapters: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self.batch = LoRABatch()
        ref = cast(Any, model).embed_tokens.weight
        self.dtype, self.device = ref.dtype, ref.device
        for i, layer in enumerate(cast(Any, model).layers):
            for proj in PROJECTIONS:
                setattr(layer, proj, LoRALinear(getattr(layer, proj), f"layers.{i}.{proj}", self.batch))

    def get(self, req: LoRARequest, digest: str | None = None) -> LoRAAdapter:
        """The adapter for req, loaded from its path on first use.  digest: the
        one the caller expects (a prefill worker checks the decode worker's)."""
        have = self.adapters.get(req.lora_name)
        if have is not None and have.path == req.lora_path and (digest is None or have.digest == digest):
            self.adapters.move_to_end(req.lora_name)
            return have
        adapter = load_adapter(req, self.spec, self.max_rank, self.dtype, self.device)
        if digest is not None and adapter.digest != digest:
            raise ValueError(f"lora_name: adapter {req.lora_name!r} at {req.lora_path!r} has digest "
                             f"{adapter.digest}, the caller's has {digest}")
        self.adapters.pop(req.lora_name, None)
        while len(self.adapters) >= self.max_loras:
            old, _ = self.adapters.popitem(last=False)
            log.info("LoRA adapter %s evicted (max_loras %d)", old, self.max_loras)
        self.adapters[req.lora_name] = adapter
        log.info("LoRA adapter %s loaded from %s (rank %d, digest %s)", req.lora_name, req.lora_path,
                 adapter.rank, adapter.digest)
        return adapter

    def unload(self, name: str) -> bool:
        return self.adapters.pop(name, None) is not None

    @contextmanager
    def apply(self, row_adapters: Sequence[tuple[LoRAAdapter | None, int]]) -> Iterator[None]:
        """During one forward: row_adapters, per scheduled sequence in row
        order, its adapter (None: the base) and its number of rows."""
        rows: dict[int, tuple[LoRAAdapter, list[int]]] = {}
        start = 0
        for adapter, n in row_adapters:
            if adapter is not None:
                rows.setdefault(id(adapter), (adapter, []))[1].extend(range(start, start + n))
            start += n
        self.batch.groups = [(a, None if len(r) == start else torch.tensor(r, device=self.device))
                             for a, r in rows.values()]
        try:
            yield
        finally:
            self.batch.groups = []
