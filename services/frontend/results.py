"""What came back for one request: each choice's text, tokens and logprobs, and the usage."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protos import pb
from services.frontend.prepare import Plan


@dataclass(frozen=True)
class Event:
    """One worker message for one choice, as the dispatcher merges them."""

    index: int  # the choice's index in the response
    msg: pb.WorkerGenerateResponse


@dataclass
class Choice:
    index: int
    prompt_index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[pb.TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | None = None
    cached_tokens: int = 0
    # Prompt logprobs: entry i is prompt token i + 1's; shared by the prompt's choices.
    prompt_logprobs: list[pb.TokenLogprobs] | None = None


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def to_openai(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def to_proto(self) -> pb.Usage:
        return pb.Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                        cached_tokens=self.cached_tokens)


class Results:
    def __init__(self, plan: Plan) -> None:
        n = plan.n
        self.prompt_lens = [len(p.token_ids) for p in plan.prompts]
        self.choices = [Choice(p * n + i, p) for p in range(len(plan.prompts)) for i in range(n)]

    def add(self, event: Event) -> Choice:
        c = self.choices[event.index]
        msg = event.msg
        c.text += msg.text
        c.token_ids += msg.token_ids
        c.logprobs += msg.logprobs
        c.cached_tokens = max(c.cached_tokens, msg.cached_tokens)
        if msg.prompt_logprobs:
            for other in self.choices:
                if other.prompt_index == c.prompt_index:
                    other.prompt_logprobs = list(msg.prompt_logprobs)
        if msg.finish_reason:
            c.finish_reason = msg.finish_reason
            c.stop_reason = msg.stop_reason or None
        return c

    @property
    def finished(self) -> bool:
        return all(c.finish_reason for c in self.choices)

    def usage(self) -> Usage:
        """cached_tokens: per prompt, the most any of its choices had cached (they
        share the prompt), summed over prompts."""
        cached = [0] * len(self.prompt_lens)
        for c in self.choices:
            cached[c.prompt_index] = max(cached[c.prompt_index], c.cached_tokens)
        return Usage(sum(self.prompt_lens), sum(len(c.token_ids) for c in self.choices), sum(cached))
