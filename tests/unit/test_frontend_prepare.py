"""Request validation -> SamplingParams, with a stand-in tokenizer (one token per character)."""

from typing import Any

import pytest

from protos import pb
from services.frontend.errors import APIError
from services.frontend.prepare import Preparer, chat_messages
from services.frontend.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from services.frontend.tokenizer import ChatTemplateError

MAX_LEN = 64


class CharTokenizer:
    vocab_size = 1000

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % self.vocab_size for c in text]

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True) -> list[int]:
        if messages[0]["role"] == "assistant":
            raise ChatTemplateError("messages: conversations must start with a user")
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))


def preparer(max_len: int | None = MAX_LEN) -> Preparer:
    return Preparer(CharTokenizer(), "m", max_n=4, max_model_len=lambda: max_len)  # type: ignore[arg-type]


def completion(**body: Any) -> CompletionRequest:
    return CompletionRequest.model_validate(body)


def chat(**body: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(body)


def error(fn: Any, *args: Any) -> APIError:
    with pytest.raises(APIError) as e:
        fn(*args)
    return e.value


def test_completion_maps_every_sampling_field() -> None:
    plan = preparer().completion(completion(
        model="m", prompt="hi", n=2, max_tokens=5, temperature=0.5, top_p=0.9, top_k=3, min_p=0.1,
        repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=-0.2, logit_bias={"7": 3},
        seed=42, stop=["x"], stop_token_ids=[9], ignore_eos=True, min_tokens=1, logprobs=3,
        priority=2, cache_salt="s", user="u", disable_speculation=True), "r1")
    p = plan.prompts[0].params
    assert plan.prompts[0].token_ids == [ord("h"), ord("i")]
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (2, 5, 0.5, 0.9, 3, 0.1)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.1, 0.2, -0.2)
    assert p.logit_bias == {7: 3.0} and p.seed == 42 and p.stop_strings == ("x",)
    assert p.stop_token_ids == [9] and p.ignore_eos and p.min_tokens == 1 and p.logprobs == 3
    assert p.disable_speculation
    assert (plan.priority, plan.cache_salt, plan.logprobs, plan.n) == (2, "s", 3, 2)


def test_prompt_forms() -> None:
    prep = preparer()
    assert [p.token_ids for p in prep.completion(completion(prompt=["a", "b"]), "r").prompts] == [[97], [98]]
    assert [p.token_ids for p in prep.completion(completion(prompt=[1, 2]), "r").prompts] == [[1, 2]]
    plan = prep.completion(completion(prompt=[[1], [2, 3]]), "r")
    assert [p.token_ids for p in plan.prompts] == [[1], [2, 3]]
    for bad, param in ((True, "prompt"), ([1, True], "prompt"), ([[1], "a"], "prompt"), ([[]], "prompt[0]"),
                       ([[1, 5000]], "prompt[0]"), ([-1], "prompt"), ({"a": 1}, "prompt")):
        assert error(prep.completion, completion(prompt=bad), "r").param == param, bad


def test_max_tokens_defaults_and_context() -> None:
    prep = preparer()
    assert prep.completion(completion(prompt="abc"), "r").prompts[0].params.max_tokens == 16
    assert prep.completion(completion(prompt="a" * 60), "r").prompts[0].params.max_tokens == 4  # clamped
    assert prep.chat(chat(messages=[{"role": "user", "content": "x"}]), "r").prompts[0].params.max_tokens \
        == MAX_LEN - len("<user>x<assistant>")
    e = error(prep.completion, completion(prompt="abc", max_tokens=62), "r")
    assert (e.param, e.code) == ("max_tokens", "context_length_exceeded")
    assert prep.completion(completion(prompt="abc", max_tokens=61), "r").prompts[0].params.max_tokens == 61
    assert error(prep.completion, completion(prompt="a" * 64), "r").param == "prompt"
    assert error(prep.completion, completion(prompt=["a", "b" * 64]), "r").param == "prompt[1]"
    e = error(prep.chat, chat(messages=[{"role": "user", "content": "x"}], max_completion_tokens=0), "r")
    assert e.param == "max_completion_tokens" and "max_completion_tokens" in e.message


def test_no_max_model_len_yet_is_503() -> None:
    assert error(preparer(None).completion, completion(prompt="a"), "r").status == 503


def test_range_errors_name_the_field() -> None:
    prep = preparer()
    for field, value in (("temperature", -1), ("top_p", 1.5), ("top_k", -2), ("min_p", 2),
                         ("presence_penalty", 3), ("repetition_penalty", 0), ("logprobs", 21),
                         ("min_tokens", -1), ("n", 5), ("n", 0), ("logit_bias", {"x": 1}),
                         ("logit_bias", {"5000": 1}), ("stop", [""]), ("cache_salt", "")):
        e = error(prep.completion, completion(prompt="a", **{field: value}), "r")
        assert e.status == 400 and e.param == field and field in e.message, (field, e.message)


def test_unknown_model_is_404() -> None:
    e = error(preparer().completion, completion(model="other", prompt="a"), "r")
    assert (e.status, e.param) == (404, "model")


def test_chat_logprobs_and_unsupported_fields() -> None:
    prep = preparer()
    msgs = [{"role": "user", "content": "x"}]
    assert prep.chat(chat(messages=msgs, logprobs=True, top_logprobs=2), "r").logprobs == 2
    assert prep.chat(chat(messages=msgs, logprobs=True), "r").logprobs == 0
    assert prep.chat(chat(messages=msgs), "r").logprobs is None
    for kw, param in (({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 30},
                      "top_logprobs"), ({"tools": [{}]}, "tools[0]"),
                      ({"tool_choice": "auto"}, "tool_choice"),
                      ({"response_format": {"type": "xml"}}, "response_format.type")):
        assert error(prep.chat, chat(messages=msgs, **kw), "r").param == param
    assert error(prep.chat, chat(messages=[{"role": "assistant", "content": "x"}]), "r").param == "messages"


def test_chat_messages_normalized() -> None:
    out = chat_messages([{"role": "developer", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "a"},
                                                      {"type": "text", "text": "b"}]},
                         {"role": "assistant", "content": None}])
    assert out == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"},
                   {"role": "assistant", "content": ""}]
    for bad, param in (([{"content": "x"}], "messages[0].role"), ([{"role": "user"}], "messages[0].content"),
                       (["hi"], "messages[0]"), ([], "messages"), (None, "messages")):
        with pytest.raises(APIError) as e:
            chat_messages(bad)
        assert e.value.param == param


def test_parse_body_type_errors_name_the_field() -> None:
    for body, param in ((b"{", "body"), (b'"x"', "body"), (b'{"prompt": "a", "n": "2"}', "n"),
                        (b'{"prompt": "a", "stream": 1}', "stream"), (b'{"n": 1}', "prompt"),
                        (b'{"prompt": "a", "stream_options": {"include_usage": "yes"}}',
                         "stream_options.include_usage")):
        with pytest.raises(APIError) as e:
            parse_body(body, CompletionRequest)
        assert e.value.status == 400 and e.value.param == param and param in e.value.message
    body = b'{"prompt": "a", "temperature": 1, "store": true}'  # unknown fields are ignored
    assert parse_body(body, CompletionRequest).temperature == 1.0


def test_grpc_request() -> None:
    prep = preparer()
    plan = prep.grpc(pb.GenerateRequest(text="ab", sampling=pb.SamplingParams(n=2, seed=1, logprobs=1),
                                        priority=3, cache_salt="c"), "g")
    assert plan.prompts[0].token_ids == [97, 98] and plan.n == 2 and plan.logprobs == 1
    assert plan.prompts[0].params.max_tokens == 16 and plan.stream and plan.include_usage
    assert error(prep.grpc, pb.GenerateRequest(), "g").param == "prompt"
    assert error(prep.grpc, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5000])), "g").param == \
        "prompt.token_ids"
    assert error(prep.grpc, pb.GenerateRequest(text="a", sampling=pb.SamplingParams(max_tokens=64)),
                 "g").param == "max_tokens"


@pytest.mark.parametrize(("body", "param"), [
    ({"stop": [f"s{i}" for i in range(17)]}, "stop"),
    ({"stop_token_ids": list(range(300))}, "stop_token_ids"),
    ({"logit_bias": {str(i): 1.0 for i in range(1100)}}, "logit_bias"),
])
def test_guards_bound_what_one_request_may_ask_for(body: dict[str, Any], param: str) -> None:
    e = error(preparer().completion, completion(prompt="hi", **body), "r")
    assert e.status == 400 and e.param == param and "at most" in e.message


class NoTokenizing(CharTokenizer):
    """Fails the test if anything is tokenized: limits come first."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise AssertionError("tokenized a request that a limit should have refused")


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": ["a"] * 65}, "prompt"),  # prompts in one request
    ({"prompt": [[1]] * 3, "n": 3}, "n"),  # 9 choices, over 8
    ({"prompt": "a" * (16 * MAX_LEN + 1)}, "prompt"),  # characters, before tokenizing
    ({"prompt": ["a", "b" * (16 * MAX_LEN + 1)]}, "prompt[1]"),
    ({"prompt": [1] * (MAX_LEN + 5000)}, "prompt"),  # token ids: the length first, not each id
    ({"prompt": "a", "stop": ["s" * 1025]}, "stop"),
    ({"prompt": "a", "priority": 2**31}, "priority"),
    ({"prompt": "a", "seed": 2**63 - 1, "n": 2}, "seed"),
    ({"prompt": "a", "top_k": 2**31}, "top_k"),
    ({"prompt": "a", "stop_token_ids": [1000]}, "stop_token_ids"),
    ({"prompt": "a", "cache_salt": "s" * 257}, "cache_salt"),
])
def test_limits_are_checked_before_tokenizing(body: dict[str, Any], param: str) -> None:
    prep = Preparer(NoTokenizing(), "m", max_n=4, max_model_len=lambda: MAX_LEN,  # type: ignore[arg-type]
                    max_prompts=64, max_choices=8)
    e = error(prep.completion, completion(**body), "r")
    assert e.status == 400 and e.param == param, e.message


def test_chat_characters_are_counted_before_the_template() -> None:
    prep = Preparer(NoTokenizing(), "m", max_n=4, max_model_len=lambda: MAX_LEN,  # type: ignore[arg-type]
                    max_prompt_chars=10)
    messages = [{"role": "user", "content": "a" * 6}, {"role": "assistant", "content": "b" * 5}]
    assert error(prep.chat, chat(messages=messages), "r").param == "messages"


def test_min_tokens_over_the_context_left_is_a_400() -> None:
    e = error(preparer().completion, completion(prompt="a" * 60, min_tokens=10), "r")
    assert e.status == 400 and e.param == "min_tokens"
