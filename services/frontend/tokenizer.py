"""Torch-free tokenizer: the `tokenizers` library on tokenizer.json, jinja2 for the chat template.

transformers' AutoTokenizer imports torch, which the frontend must not.  This
reproduces what the engine's tokenizer does for the two things the frontend
needs: `encode(text)` with the tokenizer's own special-token post-processing,
and `apply_chat_template` (rendered the way transformers renders it, then
encoded without special tokens).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.vocab.tokenizer import TextTokenizer, read_json


class ChatTemplateError(ValueError):
    pass


class Tokenizer(TextTokenizer):
    def __init__(self, model_dir: Path) -> None:
        super().__init__(model_dir)
        source = _chat_template_source(model_dir, self.config)
        self._template = _compile(source)
        # Templates that render `tools` get them; others get a system message (services/frontend/tools.py).
        self.renders_tools = source is not None and "tools" in source
        model_config = read_json(model_dir / "config.json")
        # The model's vocabulary (embedding rows) may be larger than the tokenizer's.
        self.vocab_size = int(model_config.get("vocab_size") or self._tok.get_vocab_size(True))

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return super().decode(ids, skip_special_tokens)

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> str:
        if self._template is None:
            raise ChatTemplateError("messages: this model has no chat template; use /v1/completions")
        try:
            return str(self._template.render(messages=list(messages), tools=tools, documents=None,
                                             add_generation_prompt=add_generation_prompt,
                                             **self.special_tokens))
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"messages: the chat template refused them: {e}") from e

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        # The rendered text already holds the template's special tokens.
        return self.encode(self.render_chat(messages, add_generation_prompt, tools), add_special_tokens=False)


def _chat_template_source(model_dir: Path, config: dict[str, Any]) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask markers): render the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return str(caller())


def _compile(source: str | None) -> jinja2.Template | None:
    """Same environment as transformers' chat templates."""
    if source is None:
        return None

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)
