"""splitserve's inference engine.

`LLM` is imported lazily so that torch-free users (the frontend, the prefix
index) can import the vocabulary, `engine.vocab`, without pulling in torch.
"""

from typing import TYPE_CHECKING, Any

from engine.vocab.lora_request import LoRARequest
from engine.vocab.sampling_params import SamplingParams

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
