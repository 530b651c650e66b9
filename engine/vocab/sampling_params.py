"""Per-request sampling parameters, validated at construction.

Torch-free: the frontend imports this to validate requests before routing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from engine.vocab.guided_params import GuidedDecoding

MAX_LOGPROBS = 20
# Temperatures below this are treated as greedy, here and in the sampler:
# logits / 1e-6 already makes softmax one-hot, and smaller ones overflow
# float32 into inf - inf = nan.
SAMPLING_EPS = 1e-5


def _check(cond: bool, field_name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{field_name}: {msg}")


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """Sampling parameters in the shape vLLM users know.

    temperature 0 means greedy. top_k 0 or -1 means all tokens. Penalties
    follow OpenAI (presence/frequency: over generated tokens) and
    Hugging Face (repetition: over prompt and generated tokens).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    max_tokens: int | None = 16
    logprobs: int | None = None
    # Logprobs of the prompt's own tokens (vLLM's extra): each position's token
    # and this many alternatives, computed during prefill.
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Opt out of speculative decoding for this request.
    disable_speculation: bool = False
    # Structured output: the output matches this grammar (JSON schema, regex, ...).
    guided: GuidedDecoding | None = None
    stop_strings: tuple[str, ...] = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        _check(isinstance(self.n, int) and not isinstance(self.n, bool) and self.n >= 1,
               "n", f"must be an integer >= 1, got {self.n!r}")
        _check(_is_number(self.temperature) and math.isfinite(self.temperature)
               and self.temperature >= 0, "temperature",
               f"must be a finite number >= 0, got {self.temperature!r}")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p",
               f"must be in (0, 1], got {self.top_p!r}")
        _check(isinstance(self.top_k, int) and not isinstance(self.top_k, bool)
               and self.top_k >= -1, "top_k",
               f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if self.top_k == -1:
            self.top_k = 0
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p",
               f"must be in [0, 1], got {self.min_p!r}")
        _check(_is_number(self.repetition_penalty) and math.isfinite(self.repetition_penalty)
               and self.repetition_penalty > 0, "repetition_penalty",
               f"must be > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(_is_number(v) and -2 <= v <= 2, name, f"must be in [-2, 2], got {v!r}")
        if self.logit_bias is not None:
            _check(isinstance(self.logit_bias, dict), "logit_bias", "must be a mapping of token id to bias")
            bias: dict[int, float] = {}
            for k, v in self.logit_bias.items():
                # JSON object keys arrive as strings: accept "42" and 42, nothing else.
                if isinstance(k, str) and k.strip().isdigit():
                    tok = int(k)
                elif isinstance(k, int) and not isinstance(k, bool):
                    tok = k
                else:
                    raise ValueError(f"logit_bias: key {k!r} is not a token id")
                _check(tok >= 0, "logit_bias", f"token id {tok} is negative")
                _check(_is_number(v) and -100 <= v <= 100, "logit_bias",
                       f"bias for token {tok} must be in [-100, 100], got {v!r}")
                bias[tok] = float(v)
            self.logit_bias = bias
        _check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)),
               "seed", f"must be an integer, got {self.seed!r}")
        self.stop_strings = self._normalize_stop(self.stop)
        if self.stop_token_ids is not None:
            _check(isinstance(self.stop_token_ids, (list, tuple))
                   and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                           for t in self.stop_token_ids),
                   "stop_token_ids", "must be a list of non-negative integers")
            self.stop_token_ids = list(self.stop_token_ids)
        _check(isinstance(self.min_tokens, int) and not isinstance(self.min_tokens, bool)
               and self.min_tokens >= 0, "min_tokens",
               f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None:
            _check(isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool)
                   and self.max_tokens >= 1, "max_tokens",
                   f"must be an integer >= 1, got {self.max_tokens!r}")
            _check(self.min_tokens <= self.max_tokens, "min_tokens",
                   f"({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "disable_speculation"):
            _check(isinstance(getattr(self, name), bool), name, "must be true or false")
        _check(self.guided is None or isinstance(self.guided, GuidedDecoding), "guided",
               "must be a GuidedDecoding")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            _check(v is None or (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_LOGPROBS),
                   name, f"must be an integer in [0, {MAX_LOGPROBS}], got {v!r}")

    @staticmethod
    def _normalize_stop(stop: Any) -> tuple[str, ...]:
        if stop is None:
            return ()
        if isinstance(stop, str):
            stop = [stop]
        _check(isinstance(stop, (list, tuple)), "stop",
               f"must be a string or a list of strings, got {type(stop).__name__}")
        for s in stop:
            _check(isinstance(s, str), "stop", f"must contain only strings, got {type(s).__name__}")
            _check(len(s) > 0, "stop", "must not contain empty strings")
        return tuple(stop)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)
