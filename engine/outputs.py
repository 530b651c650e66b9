"""What the engine hands back.  Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.vocab.logprobs import Logprob, PositionLogprobs, PromptLogprobs

__all__ = ["Logprob", "PositionLogprobs", "PromptLogprobs", "StepOutput", "CompletionOutput", "RequestOutput"]


@dataclass
class StepOutput:
    """One request's progress in one engine step (a streaming delta)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[PositionLogprobs] | None
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    queue_time: float = 0.0  # seconds from arrival to first scheduled
    prompt_logprobs: PromptLogprobs | None = None  # with the first output, when asked for


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # SamplingParams.prompt_logprobs
