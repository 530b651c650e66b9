"""Tool calling over the split stack with the official openai SDK: required
and named tool_choice give calls whose arguments validate against the tool's
schema (the grammar enforces them), streamed as OpenAI tool-call deltas; a
two-turn conversation with the tool's result sent back completes."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from .test_frontend import MODEL
from .test_structured_output import client, stack  # noqa: F401 - the same split stack, started here

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                        "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
       "required": ["a", "b"]}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def check_calls(calls: list[Any]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_gives_a_valid_call(client: openai.OpenAI) -> None:  # noqa: F811
    resp = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=False, max_tokens=64, temperature=0)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
    check_calls(choice.message.tool_calls)


def test_named_function_is_called(client: openai.OpenAI) -> None:  # noqa: F811
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is 2 plus 40?"}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=48, temperature=0, n=2)
    for choice in resp.choices:
        assert choice.message.tool_calls is not None, choice
        assert [c.function.name for c in choice.message.tool_calls] == ["add"]
        check_calls(choice.message.tool_calls)


def test_streamed_tool_call_deltas(client: openai.OpenAI) -> None:  # noqa: F811
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                                tool_choice="required", parallel_tool_calls=False,
                                                max_tokens=64, temperature=0, stream=True):
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                entry["name"] += (d.function.name or "") if d.function else ""
                entry["arguments"] += (d.function.arguments or "") if d.function else ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1, calls
    [call] = calls.values()
    assert call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_two_turn_conversation_with_the_tool_result(client: openai.OpenAI) -> None:  # noqa: F811
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named,
                                           max_tokens=48, temperature=0)
    [call] = first.choices[0].message.tool_calls or []
    history: list[Any] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "clear"})}]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                            max_tokens=24, temperature=0)
    choice = second.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.content
    assert choice.message.tool_calls is None
    # the history (call and result) reached the model
    alone = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1)
    assert second.usage is not None and alone.usage is not None
    assert second.usage.prompt_tokens > alone.usage.prompt_tokens + 20


def test_auto_completes_with_text_or_parsed_calls(client: openai.OpenAI) -> None:  # noqa: F811
    resp = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=48,
                                          temperature=0)
    choice = resp.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        check_calls(choice.message.tool_calls)
    else:
        assert choice.message.content and "<tool_call>" not in choice.message.content


@pytest.mark.parametrize("kw, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": {"type": "objet"}}}]},
     "tools[0].function.parameters.type"),
])
def test_bad_tool_requests_are_400(client: openai.OpenAI, kw: dict[str, Any], param: str) -> None:  # noqa: F811
    body: dict[str, Any] = {"tools": TOOLS, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, **body)
    assert isinstance(e.value.body, dict) and e.value.body["param"] == param, e.value.body
