"""splitserve's inference engine.

`LLM` is imported lazily so that torch-free users (the frontend, the prefix
index) can import the vocabulary, `engine.vocab`, without pulling in torch.
"""

import os
import sys
from typing import TYPE_CHECKING, Any

# Before torch loads OpenMP (it reads this once): OpenMP's idle threads sleep
# instead of spinning, so the CPU kernels can run on their own pool
# (engine/layers/csrc/parallel_claim.h).  Spinning OpenMP threads take its
# cores (a one-row decode step 11 -> 16 ms on 2 cores), so where torch came
# first, or OMP_WAIT_POLICY says otherwise, the kernels stay on OpenMP.
# The setting lands in os.environ, so every program this process starts
# inherits it: launchers of other OpenMP programs restore what was there before
# (OMP_WAIT_POLICY_BEFORE; None: unset).
OMP_WAIT_POLICY_BEFORE = os.environ.get("OMP_WAIT_POLICY")
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
OPENMP_SLEEPS = os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"

from engine.vocab.lora_request import LoRARequest  # noqa: E402 - after the OpenMP setting
from engine.vocab.sampling_params import SamplingParams  # noqa: E402

if TYPE_CHECKING:
    from engine.llm import LLM
    from engine.outputs import CompletionOutput, RequestOutput

__all__ = ["LLM", "LoRARequest", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from engine.llm import LLM
        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from engine import outputs
        return getattr(outputs, name)
    raise AttributeError(name)
