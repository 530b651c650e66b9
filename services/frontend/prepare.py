"""Validated requests: OpenAI bodies and gRPC GenerateRequests -> a Plan ready to route.

Everything a worker would refuse is refused here first, with the field's name:
the model, the prompt (empty, token ids out of the vocabulary, longer than the
context), sampling values, n, and max_tokens against the context left.

Limits come before work: the number of prompts and choices, each prompt's
length in characters, every integer's range and the stop strings are checked
before anything is tokenized, so that no request can cost much to refuse.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.vocab.guided_params import GuidedDecoding
from engine.vocab.sampling_params import MAX_LOGPROBS, SamplingParams
from protos import pb
from services.convert import sampling_from_proto
from services.frontend.errors import APIError, bad_request, from_value_error, model_not_found
from services.frontend.guided import guided_decoding
from services.frontend.loras import LoRAEntry, LoRARegistry
from services.frontend.protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields
from services.frontend.tokenizer import ChatTemplateError, Tokenizer
from services.frontend.tool_parsers import make_parser
from services.frontend.tools import ToolPlan, check_tools, forced_output, tool_plan, tools_in_messages

# Request fields passed to SamplingParams as they are, when set.
_SAMPLING_FIELDS = ("n", "stop", "seed", "temperature", "top_p", "presence_penalty", "frequency_penalty",
                    "logit_bias", "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos",
                    "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
                    "disable_speculation", "prompt_logprobs")
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Guards: what one request may ask for, so that no request can cost without bound.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # per stop string; as much text may be held back from a stream
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024
MAX_TAG_CHARS = 256  # cache_salt, user
# Default cap on a prompt's characters, per token of context: real text runs 3-5
# characters a token, so a prompt past 16 cannot fit and is refused untokenized.
CHARS_PER_TOKEN = 16
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1  # the protos' int32 fields
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class PromptPlan:
    token_ids: list[int]
    params: SamplingParams  # n = choices for this prompt; max_tokens resolved against the context


@dataclass(frozen=True)
class Plan:
    request_id: str
    prompts: list[PromptPlan]
    priority: int = 0
    cache_salt: str = ""
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # alternatives to report per token; None: no logprobs
    tools: ToolPlan | None = None  # chat with tool calling: how to read calls out of the output
    echo: tuple[str, ...] | None = None  # completions with echo: each prompt's text, put before its output
    lora: LoRAEntry | None = None  # the adapter named as the model; None: the base model

    @property
    def n(self) -> int:
        return self.prompts[0].params.n

    @property
    def prompt_logprobs(self) -> bool:
        return self.prompts[0].params.prompt_logprobs is not None


class Preparer:
    def __init__(self, tokenizer: Tokenizer, model_name: str, max_n: int,
                 max_model_len: Callable[[], int | None], *, max_prompts: int = 64, max_choices: int = 256,
                 max_prompt_chars: int = 0, tool_call_parser: str = "hermes",
                 loras: LoRARegistry | None = None) -> None:
        self.tokenizer = tokenizer
        self.loras = loras  # adapters a request may name as its model
        self.tool_parser = make_parser(tool_call_parser)
        self.model_name = model_name
        self.max_n = max_n
        self.max_prompts = max_prompts
        self.max_choices = max_choices
        self.max_prompt_chars = max_prompt_chars  # 0: CHARS_PER_TOKEN x max_model_len
        self._max_model_len = max_model_len

    # -- entry points ------------------------------------------------------------

    def completion(self, req: CompletionRequest, request_id: str) -> Plan:
        self._check_common(req)
        if req.echo and req.logprobs is not None:
            raise bad_request("echo with logprobs is not supported (no prompt logprobs)", "echo")
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of is not supported (only best_of == n)", "best_of")
        max_len = self._context()
        inputs = self.completion_inputs(req.prompt, max_len)
        self._check_choices(len(inputs), req.n)
        base = self._params(req, logprobs=req.logprobs, max_tokens=req.max_tokens)
        prompts = [self._tokens(x, where, max_len) for where, x in inputs]
        explicit = "max_tokens" if req.max_tokens is not None else None
        plan = self._plan(request_id, req, prompts, base, explicit, COMPLETION_DEFAULT_MAX_TOKENS,
                          "prompt", req.logprobs)
        if req.echo:
            texts = req.prompt if isinstance(req.prompt, list) and isinstance(req.prompt[0], str) else (
                [req.prompt] if isinstance(req.prompt, str) else
                [self.tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts])
            plan = dataclasses.replace(plan, echo=tuple(texts))
        return plan

    def chat(self, req: ChatCompletionRequest, request_id: str) -> Plan:
        self._check_common(req)
        tools = check_tools(req.tools) if req.tools is not None else None
        calling = tool_plan(tools, req.tool_choice, self.tool_parser)
        shown = tools if calling is not None else None  # tool_choice none: the model does not see them
        top = req.top_logprobs
        if top is not None and not (0 <= top <= MAX_LOGPROBS):
            raise bad_request(f"must be in [0, {MAX_LOGPROBS}], got {top}", "top_logprobs")
        if top and not req.logprobs:
            raise bad_request("needs logprobs set to true", "top_logprobs")
        logprobs = (top or 0) if req.logprobs else None
        max_len = self._context()
        messages = chat_messages(req.messages)
        self._check_chars(sum(len(m["content"]) for m in messages), "messages", max_len)
        self._check_choices(1, req.n)
        max_tokens: int | None
        explicit: str | None
        if req.max_completion_tokens is not None:
            max_tokens, explicit = req.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, explicit = req.max_tokens, "max_tokens" if req.max_tokens is not None else None
        forced = None
        if calling is not None and tools is not None:
            forced = forced_output(calling, tools, req.parallel_tool_calls is not False)
        base = self._params(req, logprobs=logprobs, max_tokens=max_tokens, max_tokens_field=explicit,
                            forced=forced)
        renders_tools = getattr(self.tokenizer, "renders_tools", False)
        messages = tools_in_messages(messages, shown, self.tool_parser, renders_tools)
        try:
            ids = self.tokenizer.apply_chat_template(
                messages, req.add_generation_prompt, **({"tools": shown} if renders_tools and shown else {}))
        except ChatTemplateError as e:
            raise from_value_error(e, "messages") from None
        plan = self._plan(request_id, req, [ids], base, explicit, None, "messages", logprobs)
        return dataclasses.replace(plan, tools=calling)

    def grpc(self, req: pb.GenerateRequest, request_id: str) -> Plan:
        self.check_model(req.model)
        self._check_tag(req.cache_salt, "cache_salt")
        self._check_tag(req.user, "user")
        max_len = self._context()
        which = req.WhichOneof("prompt")
        prompt: str | list[int]
        if which == "text":
            prompt, where = req.text, "prompt.text"
            self._check_chars(len(prompt), where, max_len)
        elif which == "token_ids":
            prompt, where = list(req.token_ids.ids), "prompt.token_ids"
        else:
            raise bad_request("set text or token_ids", "prompt")
        try:
            base = sampling_from_proto(req.sampling)
        except ValueError as e:
            raise from_value_error(e) from None
        self._check_n(base.n)
        self._check_choices(1, base.n)
        self._check_sampling(base, req.priority)
        prompts = [self._tokens(prompt, where, max_len)]
        explicit = "max_tokens" if req.sampling.HasField("max_tokens") else None
        plan = Plan(request_id, [], req.priority, req.cache_salt, stream=True, include_usage=True,
                    logprobs=base.logprobs, lora=self.lora(req.model))
        return self._resolve(plan, prompts, base, explicit, base.max_tokens, "prompt")

    # -- pieces ------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model and model != self.model_name and self.lora(model) is None:
            raise model_not_found(model)

    def lora(self, model: str | None) -> LoRAEntry | None:
        return None if self.loras is None else self.loras.get(model)

    def completion_inputs(self, prompt: Any, max_len: int) -> list[tuple[str, str | list[int]]]:
        """str | list[str] | list[int] | list[list[int]] -> (field, text or token ids) per
        prompt, their number and sizes checked; nothing tokenized yet."""
        inputs: list[tuple[str, str | list[int]]]
        is_list = isinstance(prompt, list) and bool(prompt)
        if isinstance(prompt, str) or is_list and all(_is_int(t) for t in prompt):  # one prompt
            inputs = [("prompt", prompt)]
        elif is_list and any(all(isinstance(p, kind) for p in prompt) for kind in (str, list)):
            if len(prompt) > self.max_prompts:
                raise bad_request(f"at most {self.max_prompts} prompts in one request, got {len(prompt)}",
                                  "prompt")
            inputs = [(f"prompt[{i}]", p) for i, p in enumerate(prompt)]
        elif isinstance(prompt, list) and not prompt:
            raise bad_request("must not be empty", "prompt")
        else:
            raise bad_request("must be a string, a list of strings, a list of token ids or a list of "
                              "lists of token ids", "prompt")
        for where, x in inputs:
            if isinstance(x, str):
                self._check_chars(len(x), where, max_len)
        return inputs

    def _context(self) -> int:
        max_len = self._max_model_len()
        if max_len is None:
            raise APIError(503, "no worker has reported its max_model_len yet; try again later", None,
                           "no_healthy_worker")
        return max_len

    def _check_chars(self, chars: int, where: str, max_len: int) -> None:
        limit = self.max_prompt_chars or CHARS_PER_TOKEN * max_len
        if chars > limit:
            raise bad_request(f"{chars} characters is over the limit of {limit}", where,
                              "context_length_exceeded")

    def _check_choices(self, prompts: int, n: int) -> None:
        if prompts * n > self.max_choices:
            raise bad_request(f"{prompts} prompt(s) x n={n} is {prompts * n} choices, over the limit of "
                              f"{self.max_choices} in one request", "n")

    @staticmethod
    def _check_tag(value: str | None, field: str) -> None:
        if value is not None and len(value) > MAX_TAG_CHARS:
            raise bad_request(f"at most {MAX_TAG_CHARS} characters, got {len(value)}", field)

    def _check_sampling(self, base: SamplingParams, priority: int) -> None:
        """Counts, lengths and integer ranges, so that nothing fails past admission
        (a value the protos cannot carry, a fan-out seed past int64)."""
        _check_range("priority", priority, INT32_MIN, INT32_MAX)
        _check_range("top_k", base.top_k, -1, INT32_MAX)
        _check_range("min_tokens", base.min_tokens, 0, INT32_MAX)
        if base.seed is not None:  # choice i samples with seed + i
            _check_range("seed", base.seed, INT64_MIN, INT64_MAX - (base.n - 1))
        if len(base.stop_strings) > MAX_STOP_STRINGS:
            raise bad_request(f"at most {MAX_STOP_STRINGS} strings, got {len(base.stop_strings)}", "stop")
        longest = max(map(len, base.stop_strings), default=0)
        if longest > MAX_STOP_CHARS:
            raise bad_request(f"each stop string may have at most {MAX_STOP_CHARS} characters, got "
                              f"{longest}", "stop")
        vocab = self.tokenizer.vocab_size
        if base.stop_token_ids:
            if len(base.stop_token_ids) > MAX_STOP_TOKEN_IDS:
                raise bad_request(f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(base.stop_token_ids)}",
                                  "stop_token_ids")
            bad = [t for t in base.stop_token_ids if t >= vocab]
            if bad:
                raise bad_request(f"token id {bad[0]} is not in [0, {vocab})", "stop_token_ids")
        if base.logit_bias and len(base.logit_bias) > MAX_LOGIT_BIAS:
            raise bad_request(f"at most {MAX_LOGIT_BIAS} entries, got {len(base.logit_bias)}", "logit_bias")
        if base.logit_bias:
            bad = [t for t in base.logit_bias if t >= vocab]
            if bad:
                raise bad_request(f"token id {bad[0]} is not in [0, {vocab})", "logit_bias")

    def _check_common(self, req: _SamplingFields) -> None:
        self.check_model(req.model)
        if req.stream_options is not None and not req.stream:
            raise bad_request("only allowed when stream is true", "stream_options")
        if req.stream and req.prompt_logprobs:  # as vLLM: 0 is accepted and streams nothing
            raise bad_request("not available when stream is true", "prompt_logprobs")
        if req.cache_salt is not None and not req.cache_salt:
            raise bad_request("must be a non-empty string", "cache_salt")
        self._check_tag(req.cache_salt, "cache_salt")
        self._check_tag(req.user, "user")
        self._check_n(req.n)

    def _check_n(self, n: int) -> None:
        if not 1 <= n <= self.max_n:
            raise bad_request(f"must be in [1, {self.max_n}], got {n}", "n")

    def _params(self, req: _SamplingFields, *, logprobs: int | None, max_tokens: int | None,
                max_tokens_field: str | None = "max_tokens",
                forced: GuidedDecoding | None = None) -> SamplingParams:
        """forced: the grammar tool_choice required / named imposes."""
        kw: dict[str, Any] = {f: getattr(req, f) for f in _SAMPLING_FIELDS if getattr(req, f) is not None}
        if req.stream:
            kw.pop("prompt_logprobs", None)
        guided = guided_decoding(req)
        if forced is not None and guided is not None:
            raise bad_request("required or a named function cannot be combined with response_format "
                              "or guided_*", "tool_choice")
        guided = guided or forced
        try:
            params = SamplingParams(**kw, logprobs=logprobs, max_tokens=max_tokens, guided=guided)
        except ValueError as e:
            err = from_value_error(e)
            if err.param == "max_tokens" and max_tokens_field and max_tokens_field != "max_tokens":
                err = from_value_error(ValueError(str(e).replace("max_tokens", max_tokens_field, 1)))
            raise err from None
        self._check_sampling(params, req.priority)
        return params

    def _plan(self, request_id: str, req: _SamplingFields, prompts: list[list[int]],
              base: SamplingParams, explicit: str | None, default_max: int | None,
              prompt_field: str, logprobs: int | None) -> Plan:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        plan = Plan(request_id, [], req.priority, req.cache_salt or "", req.stream, include_usage, logprobs,
                    lora=self.lora(req.model))
        return self._resolve(plan, prompts, base, explicit, default_max, prompt_field)

    def _resolve(self, plan: Plan, prompts: list[list[int]], base: SamplingParams, explicit: str | None,
                 default_max: int | None, prompt_field: str) -> Plan:
        """Check each prompt and max_tokens against the context; fill in max_tokens."""
        max_len = self._context()
        resolved = []
        for i, ids in enumerate(prompts):
            room = max_len - len(ids)
            where = prompt_field if len(prompts) == 1 else f"{prompt_field}[{i}]"
            if room < 1:
                raise bad_request(f"{len(ids)} tokens, but max_model_len is {max_len} (room for at least "
                                  "one generated token is needed)", where, "context_length_exceeded")
            if explicit is not None:
                assert base.max_tokens is not None
                if len(ids) + base.max_tokens > max_len:
                    raise bad_request(
                        f"{base.max_tokens} + the prompt's {len(ids)} tokens is over max_model_len "
                        f"({max_len}); at most {room} more tokens fit", explicit, "context_length_exceeded")
                params = base
            else:
                try:
                    params = dataclasses.replace(base, max_tokens=min(default_max or room, room))
                except ValueError as e:  # min_tokens over what fits
                    raise from_value_error(e) from None
            resolved.append(PromptPlan(ids, params))
        return dataclasses.replace(plan, prompts=resolved)

    def _tokens(self, prompt: str | list[Any], field: str, max_len: int) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request("must not be empty", field)
            return self.tokenizer.encode(prompt)
        return self._check_ids(prompt, field, max_len)

    def _check_ids(self, ids: list[Any], field: str, max_len: int) -> list[int]:
        if not ids:
            raise bad_request("must not be empty", field)
        if len(ids) >= max_len:  # before looking at each id
            raise bad_request(f"{len(ids)} tokens, but max_model_len is {max_len} (room for at least one "
                              "generated token is needed)", field, "context_length_exceeded")
        vocab = self.tokenizer.vocab_size
        for j, t in enumerate(ids):
            if not _is_int(t) or not 0 <= t < vocab:
                raise bad_request(f"token id {t!r} at position {j} is not in [0, {vocab})", field)
        return list(ids)


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI messages -> the {"role", "content": str, ...} dicts chat templates expect:
    an assistant's tool_calls keep their shape, with arguments as objects (what
    templates with tool support render); a tool result keeps its tool_call_id."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("must be a non-empty list of messages", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request("must be an object with role and content", where)
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(f"must be one of {', '.join(CHAT_ROLES)}, got {role!r}", f"{where}.role")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role,
                               "content": _content_text(m.get("content"), role, f"{where}.content")}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        if role == "assistant" and m.get("tool_calls") is not None:
            msg["tool_calls"] = _history_calls(m["tool_calls"], f"{where}.tool_calls")
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise bad_request("is required for a tool message", f"{where}.tool_call_id")
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


def _history_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise bad_request("must be a list of tool calls", where)
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not isinstance(fn.get("arguments"), str):
            raise bad_request('must be {"id", "type": "function", "function": {"name", "arguments"}}',
                              f"{where}[{j}]")
        try:
            args: Any = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            args = fn["arguments"]  # rendered as the client sent it
        out.append({"id": c.get("id"), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def _content_text(content: Any, role: str, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            is_text = isinstance(part, dict) and part.get("type") == "text"
            if not is_text or not isinstance(part.get("text"), str):
                raise bad_request("only text parts ({\"type\": \"text\", \"text\": ...}) are supported",
                                  f"{where}[{j}]")
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad_request("must be a string or a list of text parts", where)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_range(field: str, value: int, lo: int, hi: int) -> None:
    if not lo <= value <= hi:
        raise bad_request(f"must be an integer in [{lo}, {hi}], got {value}", field)
