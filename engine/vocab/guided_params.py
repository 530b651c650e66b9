"""What a request's output must match (structured output), validated.  Torch-free.

The frontend validates here before dispatch, so a bad schema is a 400 naming
the field; the workers compile the same spec with the grammar engine
(engine/guided.py).  One spec is one grammar: (kind, spec) is the cache key.

    json         spec: a JSON Schema (JSON text); checked with `jsonschema`
    json_object  any JSON object (spec empty)
    regex        spec: a regular expression the whole output matches
    choice       spec: a JSON list of strings; the output is exactly one of them
    grammar      spec: an EBNF grammar (xgrammar's GBNF dialect, rule `root`)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 64 * 1024  # a schema this long already takes the compiler a while
MAX_CHOICES = 256


@dataclass(frozen=True)
class GuidedDecoding:
    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"guided.kind: must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ValueError("guided.spec: must be a string")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(f"guided.spec: {len(self.spec)} characters, at most {MAX_SPEC_CHARS}")

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.spec)

    @property
    def choices(self) -> list[str]:
        assert self.kind == "choice"
        return list(json.loads(self.spec))

    @staticmethod
    def json_schema(schema: Any, field: str = "guided_json") -> GuidedDecoding:
        return GuidedDecoding("json", json.dumps(check_json_schema(schema, field), separators=(",", ":")))

    @staticmethod
    def regex(pattern: Any, field: str = "guided_regex") -> GuidedDecoding:
        return GuidedDecoding("regex", check_regex(pattern, field))

    @staticmethod
    def choice(options: Any, field: str = "guided_choice") -> GuidedDecoding:
        return GuidedDecoding("choice", json.dumps(check_choices(options, field)))

    @staticmethod
    def grammar(text: Any, field: str = "guided_grammar") -> GuidedDecoding:
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{field}: must be a non-empty EBNF grammar string")
        return GuidedDecoding("grammar", text)

    def validate(self, field: str = "guided") -> None:
        """For a spec that arrived already encoded (gRPC): the same checks."""
        if self.kind == "json":
            check_json_schema(_loads(self.spec, field), field)
        elif self.kind == "regex":
            check_regex(self.spec, field)
        elif self.kind == "choice":
            check_choices(_loads(self.spec, field), field)
        elif self.kind == "grammar":
            GuidedDecoding.grammar(self.spec, field)


def _loads(text: str, field: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{field}: not valid JSON: {e}") from None


def check_json_schema(schema: Any, field: str) -> dict[str, Any] | bool:
    """A JSON Schema as an object (or true/false); raises ValueError naming the field
    and the schema's bad part."""
    if isinstance(schema, str):
        schema = _loads(schema, field)
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"{field}: a JSON Schema must be an object, got {type(schema).__name__}")
    import jsonschema

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "".join(f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in e.absolute_path)
        raise ValueError(f"{field}{where}: invalid JSON Schema: {e.message}") from None
    return schema


def check_regex(pattern: Any, field: str) -> str:
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"{field}: must be a non-empty regular expression string")
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"{field}: invalid regular expression: {e}") from None
    return pattern


def check_choices(options: Any, field: str) -> list[str]:
    if not isinstance(options, list) or not options:
        raise ValueError(f"{field}: must be a non-empty list of strings")
    if len(options) > MAX_CHOICES:
        raise ValueError(f"{field}: at most {MAX_CHOICES} choices, got {len(options)}")
    for i, o in enumerate(options):
        if not isinstance(o, str) or not o:
            raise ValueError(f"{field}[{i}]: must be a non-empty string")
    return list(options)
