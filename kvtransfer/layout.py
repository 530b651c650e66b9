"""What both ends of a KV transfer must agree on (docs/ARCHITECTURE.md, invariant 7).

A block is one contiguous region of the engine's cache
    kv_cache: [num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]
so two workers can copy blocks byte for byte exactly when every field below
matches; the handshake compares them and refuses the connection otherwise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class KVLayout:
    model_id: str
    dtype: str  # the model's compute dtype: torch's name without "torch.", e.g. "bfloat16"
    kv_cache_dtype: str  # the cache's storage dtype: `dtype`, or fp8 e.g. "float8_e4m3fn"
    block_size: int  # tokens per block
    num_layers: int
    num_kv_heads: int
    head_dim: int
    # What prompt tokens computed in, if not `dtype`: "bfloat16" (prefill_dtype), or "".
    prefill_dtype: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ValueError(f"KVLayout.model_id must be a non-empty string, got {self.model_id!r}")
        for name in ("dtype", "kv_cache_dtype"):
            value = getattr(self, name)
            if not isinstance(getattr(torch, str(value), None), torch.dtype):
                raise ValueError(f"KVLayout.{name}: {value!r} is not a torch dtype name")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.prefill_dtype not in ("", "bfloat16"):
            raise ValueError(f"KVLayout.prefill_dtype must be '' or 'bfloat16', got {self.prefill_dtype!r}")

    @property
    def itemsize(self) -> int:
        dtype: torch.dtype = getattr(torch, self.kv_cache_dtype)  # what a block's bytes are
        return dtype.itemsize

    @property
    def block_bytes(self) -> int:
        # one block: [num_layers, 2, block_size, num_kv_heads, head_dim]
        return (self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
                * self.itemsize)

    @classmethod
    def from_cache(cls, kv_cache: torch.Tensor, model_id: str, dtype: torch.dtype | str,
                   prefill_dtype: str = "") -> KVLayout:
        """dtype: the model's compute dtype (the cache's own may be fp8)."""
        if kv_cache.dim() != 6 or kv_cache.shape[2] != 2:
            raise ValueError("kv_cache must be [num_blocks, num_layers, 2, block_size, num_kv_heads, "
                             f"head_dim], got shape {tuple(kv_cache.shape)}")
        _, num_layers, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        return cls(model_id=model_id, dtype=str(dtype).removeprefix("torch."),
                   kv_cache_dtype=str(kv_cache.dtype).removeprefix("torch."),
                   block_size=block_size, num_layers=num_layers, num_kv_heads=num_kv_heads,
                   head_dim=head_dim, prefill_dtype=prefill_dtype)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVLayout:
        fields = dataclasses.fields(cls)
        names = {f.name for f in fields}
        required = {f.name for f in fields if f.default is dataclasses.MISSING}
        missing, unknown = required - data.keys(), data.keys() - names
        if missing or unknown:
            raise ValueError(f"KVLayout: missing fields {sorted(missing)}, unknown fields {sorted(unknown)}")
        return cls(**data)


class LayoutMismatch(ValueError):
    """The two workers' KV layouts differ; `differences` maps field -> (local, remote)."""

    def __init__(self, differences: Mapping[str, tuple[Any, Any]]) -> None:
        self.differences = dict(differences)
        detail = "; ".join(f"{name}: local {local!r} vs remote {remote!r}"
                           for name, (local, remote) in self.differences.items())
        super().__init__(f"KV layout mismatch ({detail}): prefill and decode workers must serve "
                         "the same model with the same KV dtype, prefill dtype and block size")


def check_compatible(local: KVLayout, remote: KVLayout) -> None:
    """Raise LayoutMismatch naming every differing field, or return."""
    differences = {f.name: (getattr(local, f.name), getattr(remote, f.name))
                   for f in dataclasses.fields(KVLayout)
                   if getattr(local, f.name) != getattr(remote, f.name)}
    if differences:
        raise LayoutMismatch(differences)
