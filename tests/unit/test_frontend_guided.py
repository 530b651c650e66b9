"""OpenAI's response_format and vLLM's guided_* / structured_outputs -> one
GuidedDecoding on the request's SamplingParams; bad specs are 400s naming the field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.vocab.guided_params import GuidedDecoding
from services.convert import sampling_from_proto, sampling_to_proto
from tests.unit.test_frontend_prepare import chat, completion, error, preparer

MSGS = [{"role": "user", "content": "x"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def guided_of(**body: Any) -> GuidedDecoding | None:
    return preparer().chat(chat(messages=MSGS, **body), "r").prompts[0].params.guided


@pytest.mark.parametrize("body, kind, spec", [
    ({"response_format": {"type": "json_object"}}, "json_object", ""),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
     "json", json.dumps(SCHEMA, separators=(",", ":"))),
    ({"guided_json": SCHEMA}, "json", json.dumps(SCHEMA, separators=(",", ":"))),
    ({"guided_json": json.dumps(SCHEMA)}, "json", json.dumps(SCHEMA, separators=(",", ":"))),
    ({"guided_regex": "[0-9]+"}, "regex", "[0-9]+"),
    ({"guided_choice": ["a", "b"]}, "choice", '["a", "b"]'),
    ({"guided_grammar": 'root ::= "x"'}, "grammar", 'root ::= "x"'),
    ({"structured_outputs": {"choice": ["a"]}}, "choice", '["a"]'),
    ({"structured_outputs": {"json_object": True}}, "json_object", ""),
])
def test_each_way_maps_to_one_spec(body: dict[str, Any], kind: str, spec: str) -> None:
    g = guided_of(**body)
    assert g is not None and (g.kind, g.spec) == (kind, spec)
    # and survives the trip to the workers
    assert sampling_from_proto(sampling_to_proto(preparer().chat(
        chat(messages=MSGS, **body), "r").prompts[0].params)).guided == g


def test_text_and_nothing_mean_free_text() -> None:
    assert guided_of(response_format={"type": "text"}) is None
    assert guided_of() is None
    plan = preparer().completion(completion(prompt="a", guided_regex="[ab]+"), "r")
    assert plan.prompts[0].params.guided == GuidedDecoding.regex("[ab]+")


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"n": {"type": "number", "maximum": "9"}}}}}},
     "response_format.json_schema.schema.properties.n.maximum"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": "json"}, "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"guided_json": {"type": 5}}, "guided_json.type"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
])
def test_bad_specs_are_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    e = error(preparer().chat, chat(messages=MSGS, **body), "r")
    assert e.status == 400 and e.param == param, (e.param, e.message)
    assert e.message.startswith(param)


def test_a_migrated_choice_tells_the_worker_which_tokens_are_its_output() -> None:
    """resume(): the relayed tokens join the prompt and are marked as output,
    so the new worker's grammar advances over them instead of starting over."""
    from services.frontend.dispatch import plan_jobs, resume

    plan = preparer().chat(chat(messages=MSGS, guided_json=SCHEMA, max_tokens=10), "r")
    [job] = plan_jobs(plan)
    moved = resume(job, [5, 6, 7], migration=1)
    assert moved is not None
    msg = moved.to_proto("")
    assert list(msg.prompt_token_ids[-3:]) == [5, 6, 7] and msg.resumed_output_tokens == 3
    assert msg.sampling.guided.json_schema == job.params.guided.spec  # type: ignore[union-attr]
    assert job.to_proto("").resumed_output_tokens == 0
