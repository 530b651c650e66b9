"""A generated position's logprobs as the engine hands them back.  Torch-free:
the workers' protobuf edge (services/convert.py) turns them into messages."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position: token id -> its logprob (the sampled or prompt token and the top ones).
PositionLogprobs = dict[int, Logprob]
# vLLM's shape: one entry per prompt token, the first None (nothing predicts it).
PromptLogprobs = list[PositionLogprobs | None]
