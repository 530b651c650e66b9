"""OpenAI's and vLLM's ways of asking for structured output -> one GuidedDecoding.

    response_format      {"type": "text" | "json_object"} or
                         {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    vLLM's extras        guided_json, guided_regex, guided_choice, guided_grammar
    structured_outputs   {"json" | "regex" | "choice" | "grammar": ..., or "json_object": true}

At most one of them per request.  Specs are validated here (torch-free:
jsonschema, re), so a bad schema is a 400 naming the field before any worker
sees it.
"""

from __future__ import annotations

from typing import Any

from engine.vocab.guided_params import GuidedDecoding
from services.frontend.errors import bad_request, from_value_error
from services.frontend.protocol import _SamplingFields

_EXTRAS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def _from(kind: str, value: Any, field: str) -> GuidedDecoding:
    if kind == "json":
        return GuidedDecoding.json_schema(value, field)
    if kind == "regex":
        return GuidedDecoding.regex(value, field)
    if kind == "choice":
        return GuidedDecoding.choice(value, field)
    return GuidedDecoding.grammar(value, field)


def _response_format(fmt: Any) -> GuidedDecoding | None:
    if not isinstance(fmt, dict):
        raise ValueError("response_format: must be an object with a type")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedDecoding("json_object")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("response_format.json_schema: must be an object with name and schema")
        if "schema" not in spec:  # OpenAI makes it optional: any JSON object then
            return GuidedDecoding("json_object")
        return GuidedDecoding.json_schema(spec["schema"], "response_format.json_schema.schema")
    raise ValueError(f"response_format.type: must be text, json_object or json_schema, got {kind!r}")


def _structured_outputs(so: Any) -> GuidedDecoding | None:
    if not isinstance(so, dict):
        raise ValueError("structured_outputs: must be an object")
    given = [k for k in _STRUCTURED_KEYS if so.get(k) not in (None, False)]
    if len(given) > 1:
        raise ValueError(f"structured_outputs: set only one of {', '.join(given)}")
    if not given:
        return None
    key = given[0]
    if key == "json_object":
        return GuidedDecoding("json_object")
    return _from(key, so[key], f"structured_outputs.{key}")


def guided_decoding(req: _SamplingFields) -> GuidedDecoding | None:
    """The request's structured output spec, or None; APIError 400 naming the field."""
    asked: list[tuple[str, GuidedDecoding | None]] = []
    try:
        if req.response_format is not None:
            asked.append(("response_format", _response_format(req.response_format)))
        for name in _EXTRAS:
            if getattr(req, name) is not None:
                asked.append((name, _from(name.removeprefix("guided_"), getattr(req, name), name)))
        if req.structured_outputs is not None:
            asked.append(("structured_outputs", _structured_outputs(req.structured_outputs)))
    except ValueError as e:
        raise from_value_error(e) from None
    specs = [(name, g) for name, g in asked if g is not None]
    if len(specs) > 1:
        names = ", ".join(name for name, _ in specs)
        raise bad_request(f"set only one way of structured output, got {names}", specs[1][0])
    return specs[0][1] if specs else None
