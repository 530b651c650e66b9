"""OpenAI response bodies and SSE chunks, as pure functions of what the workers sent."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from protos import pb
from services.frontend.results import Choice, Usage
from services.frontend.tools import ToolPlan, ToolStream, extract_calls, openai_calls

# JSON has no -inf; a token the model cannot produce reports this (as vLLM does).
MIN_LOGPROB = -9999.0


@dataclass(frozen=True)
class Envelope:
    """The fields every response and chunk of one request repeats."""

    id: str
    created: int
    model: str

    def wrap(self, obj: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, **extra}


def sse(data: dict[str, Any] | str) -> str:
    body = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {body}\n\n"


SSE_DONE = sse("[DONE]")


def _lp(x: float) -> float:
    return max(float(x), MIN_LOGPROB)


def _alternatives(pos: pb.TokenLogprobs, k: int) -> list[pb.TopLogprob]:
    # `top` is sorted, best first, and may end with the chosen token when it is not in the top k.
    return list(pos.top[:k])


def prompt_logprobs_json(entries: Sequence[pb.TokenLogprobs] | None) -> list[dict[int, Any] | None]:
    """vLLM's shape: None for the first prompt token (nothing predicts it), then
    per token {token id: {logprob, rank, decoded_token}} for it and its alternatives."""
    out: list[dict[int, Any] | None] = [None]
    for pos in entries or ():
        alts = {t.token_id: _vllm_logprob(t) for t in pos.top}
        alts[pos.token_id] = _vllm_logprob(pos)
        out.append(alts)
    return out


def _vllm_logprob(t: pb.TokenLogprobs | pb.TopLogprob) -> dict[str, Any]:
    return {"logprob": _lp(t.logprob), "rank": t.rank or None, "decoded_token": t.token}


# -- /v1/completions ----------------------------------------------------------------


def completion_logprobs(positions: Sequence[pb.TokenLogprobs], k: int, text_offset: int) -> dict[str, Any]:
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = text_offset
    for pos in positions:
        tokens.append(pos.token)
        token_logprobs.append(_lp(pos.logprob))
        alts = {t.token: _lp(t.logprob) for t in _alternatives(pos, k)}
        alts.setdefault(pos.token, _lp(pos.logprob))
        top.append(alts)
        offsets.append(offset)
        offset += len(pos.token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": offsets}


def completion_choice(c: Choice, logprobs: int | None, echo: str = "",
                      prompt_logprobs: bool = False) -> dict[str, Any]:
    choice = {"index": c.index, "text": echo + c.text,
              "logprobs": None if logprobs is None else completion_logprobs(c.logprobs, logprobs, 0),
              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
    if prompt_logprobs:
        choice["prompt_logprobs"] = prompt_logprobs_json(c.prompt_logprobs)
    return choice


def completion_response(env: Envelope, choices: Sequence[Choice], usage: Usage,
                        logprobs: int | None, echo: Sequence[str] | None = None,
                        prompt_logprobs: bool = False) -> dict[str, Any]:
    """echo: each prompt's text, put before its choices' text.  prompt_logprobs:
    each choice carries its prompt's (vLLM's shape)."""
    return env.wrap("text_completion",
                    [completion_choice(c, logprobs, echo[c.prompt_index] if echo else "", prompt_logprobs)
                     for c in choices],
                    usage=usage.to_openai(), system_fingerprint=None)


def completion_chunk(env: Envelope, index: int, msg: pb.WorkerGenerateResponse, logprobs: int | None,
                     text_offset: int, include_usage: bool) -> dict[str, Any]:
    choice = {"index": index, "text": msg.text,
              "logprobs": None if logprobs is None else completion_logprobs(msg.logprobs, logprobs,
                                                                            text_offset),
              "finish_reason": msg.finish_reason or None, "stop_reason": msg.stop_reason or None}
    return env.wrap("text_completion", [choice], **({"usage": None} if include_usage else {}))


# -- /v1/chat/completions -----------------------------------------------------------


def _token_entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": _lp(logprob), "bytes": list(token.encode("utf-8"))}


def chat_logprobs(positions: Sequence[pb.TokenLogprobs], k: int) -> dict[str, Any]:
    content = []
    for pos in positions:
        entry = _token_entry(pos.token, pos.logprob)
        entry["top_logprobs"] = [_token_entry(t.token, t.logprob) for t in _alternatives(pos, k)]
        content.append(entry)
    return {"content": content, "refusal": None}


def chat_choice(c: Choice, logprobs: int | None, tools: ToolPlan | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": c.text}
    finish_reason = c.finish_reason
    if tools is not None:
        content, calls = extract_calls(tools, c.text)
        if calls:
            message = {"role": "assistant", "content": content, "tool_calls": openai_calls(calls)}
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
    return {"index": c.index, "message": message,
            "logprobs": None if logprobs is None else chat_logprobs(c.logprobs, logprobs),
            "finish_reason": finish_reason, "stop_reason": c.stop_reason}


def chat_response(env: Envelope, choices: Sequence[Choice], usage: Usage,
                  logprobs: int | None, tools: ToolPlan | None = None,
                  prompt_logprobs: bool = False) -> dict[str, Any]:
    """prompt_logprobs: the (one) prompt's, beside the choices (vLLM's shape)."""
    extra = {"prompt_logprobs": prompt_logprobs_json(choices[0].prompt_logprobs)} if prompt_logprobs else {}
    return env.wrap("chat.completion", [chat_choice(c, logprobs, tools) for c in choices],
                    usage=usage.to_openai(), system_fingerprint=None, **extra)


def chat_role_chunk(env: Envelope, index: int, include_usage: bool) -> dict[str, Any]:
    choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
              "finish_reason": None}
    return env.wrap("chat.completion.chunk", [choice], **({"usage": None} if include_usage else {}))


def chat_chunk(env: Envelope, index: int, msg: pb.WorkerGenerateResponse, logprobs: int | None,
               include_usage: bool) -> dict[str, Any]:
    delta = {"content": msg.text} if msg.text or not msg.finish_reason else {}
    choice = {"index": index, "delta": delta,
              "logprobs": None if logprobs is None else chat_logprobs(msg.logprobs, logprobs),
              "finish_reason": msg.finish_reason or None, "stop_reason": msg.stop_reason or None}
    return env.wrap("chat.completion.chunk", [choice], **({"usage": None} if include_usage else {}))


def chat_tool_chunks(env: Envelope, index: int, msg: pb.WorkerGenerateResponse, stream: ToolStream,
                     logprobs: int | None, include_usage: bool) -> list[dict[str, Any]]:
    """A tool-calling choice's chunks for one worker message: the content that
    may go out, and at the end the calls (each whole, in OpenAI's delta shape)
    with finish_reason tool_calls."""
    content = stream.push(msg.text)
    calls: list[dict[str, Any]] = []
    if msg.finish_reason:
        rest, calls = stream.finish()
        content += rest
    extra = {"usage": None} if include_usage else {}
    out = []
    lp = None if logprobs is None else chat_logprobs(msg.logprobs, logprobs)
    if content or (lp and not msg.finish_reason):
        out.append(env.wrap("chat.completion.chunk", [{"index": index, "delta": {"content": content},
                                                       "logprobs": lp, "finish_reason": None}], **extra))
    if msg.finish_reason:
        reason = "tool_calls" if calls and msg.finish_reason == "stop" else msg.finish_reason
        delta = {"tool_calls": calls} if calls else {}
        out.append(env.wrap("chat.completion.chunk", [{"index": index, "delta": delta, "logprobs": None,
                                                       "finish_reason": reason,
                                                       "stop_reason": msg.stop_reason or None}], **extra))
    return out


def usage_chunk(env: Envelope, obj: str, usage: Usage) -> dict[str, Any]:
    return env.wrap(obj, [], usage=usage.to_openai())
