"""OpenAI request bodies: JSON bytes -> typed request, or a 400 that names the field.

Types are checked strictly (no "5" for 5, no true for 1); ranges are left to
engine.vocab.sampling_params.SamplingParams, the one place that knows them.  Unknown
fields are accepted and ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from services.frontend.errors import APIError, bad_request


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Any = None  # str | list[str]; SamplingParams checks it
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: Any = None  # {token id (str or int): bias}; SamplingParams checks it
    user: str | None = None
    max_tokens: int | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    priority: int = 0
    cache_salt: str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    disable_speculation: bool | None = None  # opt this request out of speculative decoding
    prompt_logprobs: int | None = None  # vLLM's: logprobs of the prompt's tokens (not with stream)
    # Structured output (services/frontend/guided.py checks them)
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None


class CompletionRequest(_SamplingFields):
    prompt: Any  # str | list[str] | list[int] | list[list[int]]; checked by prepare
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: Any  # checked by prepare.chat_messages
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: Any = None  # checked by services/frontend/tools.py
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None


Req = TypeVar("Req", bound=BaseModel)


def parse_body(body: bytes, model: type[Req]) -> Req:
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"body: malformed JSON: {e}", "body", "invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"body: must be a JSON object, got {type(data).__name__}", "body")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


def validation_error(e: ValidationError) -> APIError:
    """First pydantic error -> 400 naming the field: messages[0].content: ..."""
    err = e.errors()[0]
    param = field_path(err["loc"])
    msg = "is required" if err["type"] == "missing" else err["msg"]
    return bad_request(f"{param}: {msg}", param)


def field_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "body"
