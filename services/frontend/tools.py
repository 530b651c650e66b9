"""Tool calling on /v1/chat/completions: `tools`, `tool_choice`, `parallel_tool_calls`.

    tool_choice  none      tools are not shown to the model; plain text back
                 auto      (the default with tools) the model may call: its text goes through
                           the --tool-call-parser; calls found become `tool_calls`
                 required  the output is forced (grammar) to a JSON array of
                           {"name": <one of the tools>, "arguments": <its parameters schema>}
                 {"type": "function", "function": {"name": N}}
                           the output is forced to N's arguments (its parameters schema)

So `required` and named calls always parse and their arguments validate.
Tools reach the model through its chat template when the template renders
`tools`; otherwise as a system message (the parser's `instructions`, with
each tool's JSON), the documented default.  Earlier calls and `tool`
results in the history are passed to the template as they are (arguments
as objects) or, for templates without tool support, written into the text
in the parser's format.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from engine.vocab.guided_params import GuidedDecoding, check_json_schema
from services.frontend.errors import bad_request, from_value_error
from services.frontend.tool_parsers import ParsedCall, ToolParser

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
MAX_TOOLS = 128


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # auto | required | named
    parser: ToolParser
    function: str | None = None  # named mode


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """OpenAI tool definitions, checked:
    [{"type": "function", "function": {name, description?, parameters?}}]."""
    if not isinstance(tools, list) or not tools:
        raise bad_request("must be a non-empty list of tools", "tools")
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    out = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise bad_request('must be {"type": "function", "function": {...}}', where)
        fn = t["function"]
        if not isinstance(fn.get("name"), str) or not _NAME.match(fn["name"]):
            raise bad_request("must be 1-64 letters, digits, _ . or -", f"{where}.function.name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        try:
            check_json_schema(params, f"{where}.function.parameters")
        except ValueError as e:
            raise from_value_error(e) from None
        out.append({"type": "function", "function": {**fn, "parameters": params}})
    return out


def tool_plan(tools: list[dict[str, Any]] | None, choice: Any, parser: ToolParser,
              ) -> ToolPlan | None:
    """None: no tool calling for this request (no tools, or tool_choice none)."""
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None
    if isinstance(choice, str):
        if choice not in ("auto", "required"):
            raise bad_request(f"must be none, auto, required or a function, got {choice!r}", "tool_choice")
        if not tools:
            raise bad_request(f"{choice} needs tools", "tool_choice")
        return ToolPlan(choice, parser)
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(fn, dict) or choice.get("type") != "function" or not isinstance(fn.get("name"), str):
        raise bad_request('must be {"type": "function", "function": {"name": ...}}', "tool_choice")
    if not tools or fn["name"] not in {t["function"]["name"] for t in tools}:
        raise bad_request(f"function {fn['name']!r} is not in tools", "tool_choice.function.name")
    return ToolPlan("named", parser, fn["name"])


def forced_output(plan: ToolPlan, tools: list[dict[str, Any]], parallel: bool) -> GuidedDecoding | None:
    """The grammar that makes `required` and named calls parse."""
    params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    if plan.mode == "named":
        assert plan.function is not None
        return _grammar(params[plan.function])
    if plan.mode != "required":
        return None
    one_call = {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                           "required": ["name", "arguments"]} for name, schema in params.items()]}
    array: dict[str, Any] = {"type": "array", "items": one_call, "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    return _grammar(array)


def _grammar(schema: dict[str, Any]) -> GuidedDecoding:
    try:
        return GuidedDecoding.json_schema(schema, "tools")
    except ValueError as e:  # too large, say (each tool's schema was checked already)
        raise bad_request(str(e).split(": ", 1)[-1], "tools") from None


def tools_in_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      parser: ToolParser, template_renders_tools: bool) -> list[dict[str, Any]]:
    """For templates without tool support: the tools as a system message and the
    history's calls written as text.  Templates with it get the messages as they are."""
    if template_renders_tools:
        return messages
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [parser.render_call(c["function"]["name"], c["function"]["arguments"])
                     for c in m["tool_calls"]]
            m = {"role": "assistant", "content": "\n".join([m["content"], *calls]).strip()}
        elif m["role"] == "tool":
            m = {"role": "tool", "content": m["content"]}
        out.append(m)
    if tools:
        text = parser.instructions([json.dumps(t, ensure_ascii=False) for t in tools])
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def extract_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[ParsedCall]]:
    """-> (content, calls) of one finished choice."""
    if plan.mode == "named":
        assert plan.function is not None
        return None, [ParsedCall(plan.function, text)]
    if plan.mode == "required":
        try:
            items = json.loads(text)
        except json.JSONDecodeError:  # cut off by max_tokens
            return text, []
        return None, [ParsedCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in items]
    return plan.parser.extract(text)


def openai_calls(calls: list[ParsedCall], streamed: bool = False) -> list[dict[str, Any]]:
    out = []
    for i, c in enumerate(calls):
        call: dict[str, Any] = {"id": new_call_id(), "type": "function",
                                "function": {"name": c.name, "arguments": c.arguments}}
        out.append({"index": i, **call} if streamed else call)
    return out


class ToolStream:
    """One streamed choice: text deltas pass until a call may begin; from there
    the text is held, and parsed into tool-call deltas when the choice ends."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.held = ""

    def push(self, text: str) -> str:
        """-> the content that may go out now."""
        self.held += text
        if self.plan.mode != "auto":
            return ""
        cut = self.plan.parser.may_start(self.held)
        out, self.held = self.held[:cut], self.held[cut:]
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """-> (content still to send, tool-call deltas)."""
        content, calls = extract_calls(self.plan, self.held)
        if not calls:
            return self.held, []
        return content or "", openai_calls(calls, streamed=True)
