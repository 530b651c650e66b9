"""Tool calls out of generated text, one parser per model family (--tool-call-parser).

    hermes       Hermes / Qwen: <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number,
                 with free text around them
    llama3_json  Llama 3.x: the whole reply is {"name": ..., "parameters": {...}} (optionally after
                 <|python_tag|>), several separated by ";"

Each parser also says how to ask for its format when the model's chat
template cannot render tools (`instructions`), and how to write an earlier
call back into the history (`render_call`).  A call whose JSON does not parse
stays text, as in vLLM.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object


def _call(obj: Any, args_keys: tuple[str, ...]) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args: Any = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


class HermesParser:
    name = "hermes"
    start = "<tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def instructions(self, tools_json: list[str]) -> str:
        return ("You can call functions. To call one, reply with\n<tool_call>\n"
                '{"name": "<function name>", "arguments": {<arguments as JSON>}}\n</tool_call>\n'
                "(one block per call). The functions:\n" + "\n".join(tools_json))

    def render_call(self, name: str, arguments: Any) -> str:
        call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"<tool_call>\n{call}\n</tool_call>"

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        calls: list[ParsedCall] = []
        content = text
        for m in self._CALL.finditer(text):
            try:
                call = _call(json.loads(m.group(1)), ("arguments", "parameters"))
            except json.JSONDecodeError:
                call = None
            if call is not None:
                calls.append(call)
                content = content.replace(m.group(0), "", 1)
        content = content.strip()
        return (content or None) if calls else text, calls

    def may_start(self, text: str) -> int:
        """Where a call may begin in streamed text: the index of the start tag,
        or of a trailing prefix of it; len(text) when none can."""
        i = text.find(self.start)
        if i >= 0:
            return i
        for k in range(min(len(self.start) - 1, len(text)), 0, -1):
            if self.start.startswith(text[-k:]):
                return len(text) - k
        return len(text)


class Llama3JsonParser:
    name = "llama3_json"
    start = "{"
    _TAG = "<|python_tag|>"

    def instructions(self, tools_json: list[str]) -> str:
        return ("You can call functions. To call one, reply with only a JSON object "
                '{"name": "<function name>", "parameters": {<arguments as JSON>}}; separate several '
                "with ;. The functions:\n" + "\n".join(tools_json))

    def render_call(self, name: str, arguments: Any) -> str:
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        body = text.strip().removeprefix(self._TAG).strip()
        if not body.startswith("{"):
            return text, []
        calls: list[ParsedCall] = []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                return text, []
            call = _call(obj, ("parameters", "arguments"))
            if call is None:
                return text, []
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \n\t;":
                pos += 1
        return None, calls

    def may_start(self, text: str) -> int:
        """A reply that is (or may become) a call starts with "{" or the tag: hold all of it."""
        head = text.lstrip()
        if not head or head.startswith("{") or self._TAG.startswith(head[:len(self._TAG)]):
            return 0
        return len(text)


ToolParser = HermesParser | Llama3JsonParser
PARSERS: dict[str, type[HermesParser] | type[Llama3JsonParser]] = {
    "hermes": HermesParser, "llama3_json": Llama3JsonParser}


def make_parser(name: str) -> ToolParser:
    return PARSERS[name]()
