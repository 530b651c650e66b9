"""Tool calls read out of text (hermes, llama3_json), streamed hold-back, the
grammar that forces required / named calls, and the history rendered for
templates without tool support."""

from __future__ import annotations

import json

import jsonschema
import pytest

from services.frontend.errors import APIError
from services.frontend.prepare import chat_messages
from services.frontend.tool_parsers import HermesParser, Llama3JsonParser, ParsedCall
from services.frontend.tools import (
    ToolPlan,
    ToolStream,
    check_tools,
    forced_output,
    tool_plan,
    tools_in_messages,
)

HERMES, LLAMA = HermesParser(), Llama3JsonParser()
TOOLS = check_tools([{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}},
    {"type": "function", "function": {"name": "g"}}])


def test_hermes_calls_and_the_text_around_them() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>{"name": "g", "arguments": "{}"}</tool_call>')
    content, calls = HERMES.extract(text)
    assert content == "Let me check."
    assert calls == [ParsedCall("f", '{"x": 1}'), ParsedCall("g", "{}")]
    # unclosed at the end (the model stopped at EOS): still a call
    assert HERMES.extract('<tool_call>{"name": "g", "arguments": {}}')[1] == [ParsedCall("g", "{}")]
    # broken JSON stays text
    assert HERMES.extract("<tool_call>{nope</tool_call>") == ("<tool_call>{nope</tool_call>", [])
    assert HERMES.extract("just text") == ("just text", [])


def test_llama3_json_calls() -> None:
    content, calls = LLAMA.extract('<|python_tag|>{"name": "f", "parameters": {"x": 2}}; {"name": "g", '
                                   '"parameters": {}}')
    assert content is None and calls == [ParsedCall("f", '{"x": 2}'), ParsedCall("g", "{}")]
    assert LLAMA.extract("The answer is 4.") == ("The answer is 4.", [])
    assert LLAMA.extract('{"not": "a call"}') == ('{"not": "a call"}', [])


@pytest.mark.parametrize("pieces, content", [
    (["Sure", ", <tool", "_call>", '{"name": "g", "arguments": {}}', "</tool_call>"], "Sure, "),
    (["No calls <to", "day."], "No calls <today."),
])
def test_stream_holds_back_only_what_may_be_a_call(pieces: list[str], content: str) -> None:
    stream = ToolStream(ToolPlan("auto", HERMES))
    sent = "".join(stream.push(p) for p in pieces)
    rest, calls = stream.finish()
    assert sent + rest == content
    assert [c["function"]["name"] for c in calls] == (["g"] if "tool_call>" in "".join(pieces) else [])
    assert all(c["index"] == i and c["id"].startswith("call_") for i, c in enumerate(calls))


def test_forced_output_schemas_accept_only_valid_calls() -> None:
    required = forced_output(ToolPlan("required", HERMES), TOOLS, parallel=False)
    assert required is not None
    schema = json.loads(required.spec)
    jsonschema.validate([{"name": "f", "arguments": {"x": 3}}], schema)
    for bad in ([], [{"name": "f", "arguments": {}}], [{"name": "h", "arguments": {}}],
                [{"name": "g", "arguments": {}}] * 2):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    named = forced_output(ToolPlan("named", HERMES, "f"), TOOLS, parallel=True)
    assert named is not None and json.loads(named.spec) == TOOLS[0]["function"]["parameters"]
    assert forced_output(ToolPlan("auto", HERMES), TOOLS, parallel=True) is None


@pytest.mark.parametrize("tools, choice, param", [
    (TOOLS, "sometimes", "tool_choice"),
    (None, "required", "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "zz"}}, "tool_choice.function.name"),
    (TOOLS, {"type": "function"}, "tool_choice"),
])
def test_bad_tool_choice(tools, choice, param: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(APIError) as e:
        tool_plan(tools, choice, HERMES)
    assert e.value.param == param


def test_history_for_a_template_without_tools() -> None:
    msgs = chat_messages([
        {"role": "user", "content": "x?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"}])
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}  # objects, for templates
    out = tools_in_messages(msgs, TOOLS, HERMES, template_renders_tools=False)
    assert out[0]["role"] == "system" and '"name": "f"' in out[0]["content"]
    assert out[2] == {"role": "assistant",
                      "content": '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'}
    assert out[3] == {"role": "tool", "content": "42"}
    assert tools_in_messages(msgs, TOOLS, HERMES, template_renders_tools=True) == msgs
    with pytest.raises(APIError) as e:
        chat_messages([{"role": "tool", "content": "42"}])
    assert e.value.param == "messages[0].tool_call_id"


def test_a_grammar_too_large_for_the_tools_is_a_400() -> None:
    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 200}
                                            for i in range(200)}}
    tools = check_tools([{"type": "function", "function": {"name": f"f{i}", "parameters": big}}
                         for i in range(3)])
    with pytest.raises(APIError) as e:
        forced_output(ToolPlan("required", HERMES), tools, parallel=True)
    assert e.value.status == 400 and e.value.param == "tools" and "characters" in e.value.message
