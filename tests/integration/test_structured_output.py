"""Structured output over the split stack (prefill + decode with ngram
speculation, KV over UCX), called with the official openai SDK and gRPC:
json_object and JSON schemas (nested objects, arrays, enums, bounded
numbers, required and optional fields, patterns), streamed and not, n = 2,
regex and choice extras; every output parses and validates with
`jsonschema`.  A bad schema is a 400 naming the field."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import jsonschema
import openai
import pytest

from protos import pb, pb_grpc

from .procs import start_pair
from .test_frontend import MODEL, Frontend, wait_all_blocks_free, workers

THRESHOLD = 32  # chat prompts (system prompt included) are prefilled on the prefill worker
ASK = [{"role": "user", "content": "Reply with a JSON object that fits the schema."}]
NAME = {"type": "string", "maxLength": 12}
SCHEMAS: dict[str, dict[str, Any]] = {
    "nested_object": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": NAME, "id": {"type": "integer", "minimum": 1,
                                                                        "maximum": 9999}},
                 "required": ["name", "id"]}}, "required": ["user"]},
    "array_of_ints": {"type": "object", "properties": {
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                   "minItems": 1, "maxItems": 4}}, "required": ["scores"]},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                              "size": {"type": "string", "enum": ["S", "M", "L"]}},
             "required": ["color", "size"]},
    "bounded_numbers": {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 18, "maximum": 65},
        "level": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}},
        "required": ["age", "level"]},
    "required_and_optional": {"type": "object", "properties": {
        "title": NAME, "done": {"type": "boolean"}, "note": NAME}, "required": ["title", "done"]},
    "string_pattern": {"type": "object", "properties": {
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2}$"}}, "required": ["zip", "code"]},
    "array_of_objects": {"type": "object", "properties": {
        "items": {"type": "array", "maxItems": 2, "minItems": 1, "items": {
            "type": "object", "properties": {"sku": NAME, "qty": {"type": "integer", "minimum": 1,
                                                                   "maximum": 9}},
            "required": ["sku", "qty"]}}}, "required": ["items"]},
    "nullable_and_const": {"type": "object", "properties": {
        "kind": {"const": "point"}, "label": {"type": ["string", "null"], "maxLength": 8},
        "xy": {"type": "array", "prefixItems": [{"type": "integer", "minimum": -9, "maximum": 9},
                                                {"type": "integer", "minimum": -9, "maximum": 9}],
               "items": False}},
        "required": ["kind", "label", "xy"]},
    "any_of": {"type": "object", "properties": {
        "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]}},
        "required": ["value"]},
}
MAX_TOKENS = 96  # every schema above fits well inside: a cut-off output would not parse


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Frontend]:  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("structured")
    p0, d0 = start_pair(tmp, ["--num-blocks", "256"],
                        ["--num-blocks", "256", "--local-prefill-threshold", str(THRESHOLD),
                         "--speculative-method", "ngram", "--num-speculative-tokens", "3",
                         "--prompt-lookup-min", "1", "--no-adaptive-speculation"])
    running: list[Frontend | Any] = [d0, p0]
    try:
        fe = Frontend(tmp, d0.wait_ready(), p0.wait_ready(), "--local-prefill-threshold", str(THRESHOLD))
        running.insert(0, fe)
        fe.wait_healthy()
        yield fe
    finally:
        for proc in running:
            proc.stop()


@pytest.fixture(scope="module")
def client(stack: Frontend) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=300)


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def chat_text(client: openai.OpenAI, stream: bool, messages: list[dict[str, str]] = ASK,
              **kw: Any) -> list[tuple[str, str]]:
    """-> (text, finish_reason) per choice."""
    if not stream:
        resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, **kw)
        return [(c.message.content or "", c.finish_reason) for c in resp.choices]
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                                stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return [(texts[i], reasons[i]) for i in sorted(texts)]


def spec_draft_tokens(fe: Frontend) -> float:
    return float(workers(fe)["d0"]["counters"].get("spec_decode_num_draft_tokens", 0))


def test_json_schemas_validate_streamed_and_not(stack: Frontend, client: openai.OpenAI) -> None:
    """Each schema greedy, streamed and not, all at once (one batch; ngram drafts checked by the grammar)."""
    drafts_before = spec_draft_tokens(stack)
    jobs = [(name, stream) for name in SCHEMAS for stream in (False, True)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: chat_text(client, job[1], temperature=0,
                                                      response_format=schema_format(SCHEMAS[job[0]])), jobs))
    for (name, stream), [(text, reason)] in zip(jobs, results, strict=True):
        assert reason == "stop", (name, stream, text)
        try:
            jsonschema.validate(json.loads(text), SCHEMAS[name])
        except (ValueError, jsonschema.ValidationError) as e:
            raise AssertionError(f"{name} (stream={stream}): {text!r}: {e}") from None
    deadline = time.monotonic() + 30  # load reports carry the counter (every 0.5 s)
    while spec_draft_tokens(stack) <= drafts_before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert spec_draft_tokens(stack) > drafts_before  # speculation was on for these requests
    wait_all_blocks_free(stack)


@pytest.mark.parametrize("stream", [False, True])
def test_n2_sampled_and_json_object(client: openai.OpenAI, stream: bool) -> None:
    schema = SCHEMAS["required_and_optional"]
    for text, reason in chat_text(client, stream, n=2, temperature=0.8, seed=5,
                                  response_format=schema_format(schema)):
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), schema)
    small = [{"role": "user", "content": 'Reply with the JSON object {"ok": true} and nothing else.'}]
    [(text, reason)] = chat_text(client, stream, small, temperature=0,
                                 response_format={"type": "json_object"},
                                 extra_body={"disable_speculation": True})
    assert reason == "stop" and isinstance(json.loads(text), dict), text


def test_completions_regex_choice_and_structured_outputs(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL, prompt="Ticket:", max_tokens=16, n=2, temperature=1.0,
                                     seed=1, extra_body={"guided_regex": r"[A-Z]{3}-[0-9]{4}"})
    for c in resp.choices:
        assert re.fullmatch(r"[A-Z]{3}-[0-9]{4}", c.text), c.text
    options = ["positive", "negative", "neutral"]
    resp = client.completions.create(model=MODEL, prompt="The movie was great. Sentiment:", max_tokens=8,
                                     temperature=0, extra_body={"guided_choice": options})
    assert resp.choices[0].text in options
    chat = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=8, temperature=0,
        extra_body={"structured_outputs": {"choice": options}})
    assert chat.choices[0].message.content in options
    schema = SCHEMAS["enum"]
    resp = client.completions.create(model=MODEL, prompt="A T-shirt as JSON:", max_tokens=MAX_TOKENS,
                                     temperature=0, extra_body={"response_format": schema_format(schema)})
    jsonschema.validate(json.loads(resp.choices[0].text), schema)


@pytest.mark.parametrize("body, param", [
    ({"response_format": schema_format({"type": "object", "properties": {"a": {"type": "integr"}}})},
     "response_format.json_schema.schema.properties.a.type"),
    ({"response_format": schema_format({"type": "object", "required": "a"})},
     "response_format.json_schema.schema.required"),
    ({"extra_body": {"guided_regex": "[0-9"}}, "guided_regex"),
    ({"extra_body": {"guided_choice": []}}, "guided_choice"),
])
def test_invalid_spec_is_400_naming_it(client: openai.OpenAI, body: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, **body)
    err = e.value.body
    assert isinstance(err, dict) and err["param"] == param, err
    assert err["message"].startswith(param)


def test_engine_refusal_is_400_too(client: openai.OpenAI) -> None:
    """A spec that passes the frontend's checks but the grammar engine refuses
    (an EBNF with an undefined rule) comes back as a 400, not a retry or a 500."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8,
                                       extra_body={"guided_grammar": "root ::= nowhere"})
    assert "grammar engine refused" in str(e.value)


def test_grpc_guided_choice(stack: Frontend) -> None:
    options = ["alpha", "beta", "gamma delta"]
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as ch:
        stub = pb_grpc.FrontendStub(ch)
        req = pb.GenerateRequest(model=MODEL, text="Pick a Greek letter:", sampling=pb.SamplingParams(
            temperature=0.9, seed=3, max_tokens=8, n=2,
            guided=pb.GuidedDecoding(choice=pb.GuidedDecoding.Choices(choices=options))))
        texts: dict[int, str] = {}
        for msg in stub.Generate(req, timeout=120):
            texts[msg.index] = texts.get(msg.index, "") + msg.text
        assert len(texts) == 2 and all(t in options for t in texts.values()), texts
        bad = pb.GenerateRequest(model=MODEL, text="x", sampling=pb.SamplingParams(
            guided=pb.GuidedDecoding(json_schema='{"type": "objec"}')))
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(bad, timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling.guided.json_schema" in (e.value.details() or "")
