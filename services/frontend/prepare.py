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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.sampling_params import MAX_LOGPROBS, SamplingParams
from protos import pb
from services.convert import sampling_from_proto
from services.frontend.errors import APIError, bad_request, from_value_error, model_not_found
from services.frontend.protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields
from services.frontend.tokenizer import ChatTemplateError, Tokenizer

# Request fields passed to SamplingParams as they are, when set.
_SAMPLING_FIELDS = ("n", "stop", "seed", "temperature", "top_p", "presence_penalty", "frequency_penalty",
                    "logit_bias", "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos",
                    "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
                    "disable_speculation")
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

    @property
    def n(self) -> int:
        return self.prompts[0].params.n


class Preparer:
    def __init__(self, tokenizer: Tokenizer, model_name: str, max_n: int,
                 max_model_len: Callable[[], int | None], *, max_prompts: int = 64, max_choices: int = 256,
                 max_prompt_chars: int = 0) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_n = max_n
        self.max_prompts = max_prompts
        self.max_choices = max_choices
        self.max_prompt_chars = max_prompt_chars  # 0: CHARS_PER_TOKEN x max_model_len
        self._max_model_len = max_model_len

    # -- entry points ------------------------------------------------------------

    def completion(self, req: CompletionRequest, request_id: str) -> Plan:
        self._check_common(req)
        if req.echo:
            raise bad_request("echo is not supported", "echo")
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
        return self._plan(request_id, req, prompts, base, explicit, COMPLETION_DEFAULT_MAX_TOKENS,
                          "prompt", req.logprobs)

    def chat(self, req: ChatCompletionRequest, request_id: str) -> Plan:
        self._check_common(req)
        if req.tools:
            raise bad_request("tools are not supported", "tools")
        if req.tool_choice not in (None, "none"):
            raise bad_request("tool_choice is not supported", "tool_choice")
        fmt = req.response_format
        if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
            raise bad_request("only {\"type\": \"text\"} is supported", "response_format")
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
        base = self._params(req, logprobs=logprobs, max_tokens=max_tokens, max_tokens_field=explicit)
        try:
            ids = self.tokenizer.apply_chat_template(messages, req.add_generation_prompt)
        except ChatTemplateError as e:
            raise from_value_error(e, "messages") from None
        return self._plan(request_id, req, [ids], base, explicit, None, "messages", logprobs)

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
                    logprobs=base.logprobs)
        return self._resolve(plan, prompts, base, explicit, base.max_tokens, "prompt")

    # -- pieces ------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model and model != self.model_name:
            raise model_not_found(model)

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
        if req.cache_salt is not None and not req.cache_salt:
            raise bad_request("must be a non-empty string", "cache_salt")
        self._check_tag(req.cache_salt, "cache_salt")
        self._check_tag(req.user, "user")
        self._check_n(req.n)

    def _check_n(self, n: int) -> None:
        if not 1 <= n <= self.max_n:
            raise bad_request(f"must be in [1, {self.max_n}], got {n}", "n")

    def _params(self, req: _SamplingFields, *, logprobs: int | None, max_tokens: int | None,
                max_tokens_field: str | None = "max_tokens") -> SamplingParams:
        kw: dict[str, Any] = {f: getattr(req, f) for f in _SAMPLING_FIELDS if getattr(req, f) is not None}
        try:
            params = SamplingParams(**kw, logprobs=logprobs, max_tokens=max_tokens)
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
        plan = Plan(request_id, [], req.priority, req.cache_salt or "", req.stream, include_usage, logprobs)
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
    """OpenAI messages -> the {"role", "content": str} dicts chat templates expect."""
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
        out.append(msg)
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
