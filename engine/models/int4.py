"""4-bit weights with a scale and an offset per 32 inputs, the one quantized
form the CPU linear kernel reads (csrc/linear_cpu.cpp, q4_linear).

Every 4-bit format the engine loads becomes this: GGUF Q4_0, Q4_1 and Q4_K
(engine/models/gguf_int4.py), AWQ and GPTQ (engine/models/awq_gptq.py).  Their
groups (32 inputs for GGUF's small blocks, 32-input sub-blocks of Q4_K, 128 or
any multiple of 32 for AWQ/GPTQ) split into 32-input blocks with no arithmetic
but w = d * q + m, so the kernel rebuilds each weight as the format defines it:

  AWQ / GPTQ   w = (q - z) * s   ->  d = s, m = -z * s
  Q4_K         w = D q - M       ->  d = D, m = -M

With s a float16 (11 significant bits) and q, z 4-bit, q * s and z * s are
exact in float32, so fl(fl(d * q) + m) is (q - z) * s exactly: the blocks
rebuild the dequantized float32 matrix bit for bit (kernel.q4_unpack, which
exact_blocks checks).  The kernel's product sums each block factored,
d * sum(x q) + m * sum(x), so its results match the dequantized matrix's to
float32 rounding, not bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from engine.layers.packed_linear import q4_layout

BLOCK = 32  # inputs per block; the kernel's QB


@dataclass(frozen=True)
class Int4Weight:
    """w[n, k] = d[n, k // 32] * q[n, k] + m[n, k // 32], q in 0..15."""

    q: torch.Tensor  # [N, K] uint8
    d: torch.Tensor  # [N, K / 32] float32
    m: torch.Tensor  # [N, K / 32] float32

    def __post_init__(self) -> None:
        n, k = self.q.shape
        if k % BLOCK or self.d.shape != (n, k // BLOCK) or self.m.shape != (n, k // BLOCK):
            raise ValueError(f"int4 weight: q {tuple(self.q.shape)}, d {tuple(self.d.shape)}, "
                             f"m {tuple(self.m.shape)} do not form 32-input blocks")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[0], self.q.shape[1])

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32, rounded as the kernel rounds: the product, then the sum."""
        n, k = self.shape
        prod = self.q.view(n, k // BLOCK, BLOCK).float() * self.d[..., None]
        return (prod + self.m[..., None]).view(n, k)

    def rows(self, index: torch.Tensor) -> Int4Weight:
        """The weight with its output rows reordered (weight[index])."""
        return Int4Weight(self.q[index], self.d[index], self.m[index])

    @staticmethod
    def cat(parts: list[Int4Weight]) -> Int4Weight:
        """Stacked along the outputs, as a fused projection (q|k|v, gate|up) is."""
        return Int4Weight(torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]),
                          torch.cat([p.m for p in parts]))

    @staticmethod
    def from_groups(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> Int4Weight:
        """w[n, k] = (q[n, k] - zero[n, g]) * scale[n, g] for groups g of K / G
        consecutive inputs (AWQ, GPTQ): q [N, K] uint8, scale and zero [N, G]."""
        n, k = q.shape
        groups = scale.shape[1]
        if k % groups or (k // groups) % BLOCK:
            raise ValueError(f"int4 weight: {groups} groups of {k} inputs are not whole 32-input blocks")
        s = scale.float()
        d = s.repeat_interleave(k // groups // BLOCK, dim=1)
        m = (-zero.float() * s).repeat_interleave(k // groups // BLOCK, dim=1)
        return Int4Weight(q.to(torch.uint8).contiguous(), d.contiguous(), m.contiguous())


def pack_blocks(w: Int4Weight) -> torch.Tensor:
    """The kernel's layout of w (engine/layers/packed_linear.py, q4_layout)."""
    return q4_layout(w.q, w.d, w.m)


def exact_blocks(w: Int4Weight, kernel: ModuleType,
                 weight: torch.Tensor | None = None) -> torch.Tensor | None:
    """The kernel's blocks for w, if the kernel rebuilds from them exactly
    `weight` (by default w.dequantize()); None otherwise, so a caller whose
    float weights differ keeps them."""
    blocks = pack_blocks(w)
    expected = w.dequantize() if weight is None else weight
    return blocks if torch.equal(kernel.q4_unpack(blocks, w.shape[0]), expected) else None


def fuse_layers(sources: dict[str, list[str]], weights: dict[str, Int4Weight],
                floats: dict[str, torch.Tensor]) -> dict[str, Int4Weight]:
    """The 4-bit weight of each packed layer (path -> its tensors' names,
    stacked) whose tensors are all 4-bit; a layer only partly 4-bit has its
    4-bit tensors dequantized into `floats` and runs in float32."""
    out: dict[str, Int4Weight] = {}
    for path, names in sources.items():
        have = [n for n in names if n in weights]
        if len(have) == len(names):
            out[path] = Int4Weight.cat([weights[n] for n in names])
        else:
            floats.update({n: weights[n].dequantize() for n in have if n not in floats})
    return out
