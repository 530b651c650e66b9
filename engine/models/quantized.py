"""Which of a checkpoint's projections run from 4-bit blocks: an AWQ/GPTQ
checkpoint's (engine/models/awq_gptq.py; they have no float weights), or a
GGUF file's 4-bit tensors (engine/models/gguf_int4.py; converted to float32
too, which prefill reads)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.models.awq_gptq import checkpoint_int4
from engine.models.gguf_int4 import gguf_int4
from engine.models.int4 import Int4Weight, fuse_layers
from engine.models.llama import LlamaForCausalLM

SOURCES = ("int4.py", "awq_gptq.py", "gguf_int4.py", "quantized.py")  # the packing code (cache keys)


def int4_layers(model: LlamaForCausalLM, config: dict[str, Any], tensors: dict[str, torch.Tensor],
                gguf: Path | None) -> tuple[dict[str, Int4Weight], bool]:
    """-> (4-bit weights by packed layer path, whether they are all the layers
    have: no float weights were loaded).  Takes an AWQ/GPTQ checkpoint's packed
    tensors out of `tensors`, and puts in the float32 weights of layers that
    cannot run 4-bit (act-order GPTQ, a fused layer partly quantized)."""
    weights = checkpoint_int4(config, tensors)
    if weights:
        return fuse_layers(model.linear_sources(), weights, tensors), True
    if gguf is None:
        return {}, False
    spec = model.spec
    weights = gguf_int4(gguf, tensors, spec.num_heads, spec.num_kv_heads)
    return fuse_layers(model.linear_sources(), weights, tensors), False
