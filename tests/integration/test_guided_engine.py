"""Structured output in the engine on the real model: outputs match their
grammar, speculation changes nothing, n > 1, and a request resumed after
its first tokens (a migration) continues the grammar where it was."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.vocab.guided_params import GuidedDecoding

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"]}
PROMPT = [{"role": "user", "content": 'Describe a person as JSON with "name", "age" and "tags".'}]
GREEDY = SamplingParams(temperature=0, max_tokens=64, guided=GuidedDecoding.json_schema(PERSON))


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", num_blocks=256, max_model_len=512, num_threads=2, seed=1)


@pytest.fixture(scope="module")
def spec_llm() -> LLM:
    return LLM(dtype="float32", num_blocks=256, max_model_len=512, num_threads=2, seed=1,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                   "prompt_lookup_max": 4, "prompt_lookup_min": 1})


def free_equals_total(llm: LLM) -> bool:
    return llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_json_schema_output_validates(llm: LLM) -> None:
    out = llm.chat(PROMPT, GREEDY)[0].outputs[0]
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), PERSON)
    assert free_equals_total(llm)


def test_n_sampled_choices_each_follow_the_grammar(llm: LLM) -> None:
    params = replace(GREEDY, temperature=1.0, n=3, seed=7)
    outs = llm.chat(PROMPT, params)[0].outputs
    assert len(outs) == 3
    for o in outs:
        jsonschema.validate(json.loads(o.text), PERSON)


def test_regex_and_choice(llm: LLM) -> None:
    rx = SamplingParams(temperature=1.0, seed=3, max_tokens=20, n=4,
                        guided=GuidedDecoding.regex(r"[0-9]{3}-[a-z]{2,5}"))
    for o in llm.generate("My code is", rx)[0].outputs:
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", o.text), o.text
    ch = SamplingParams(temperature=1.0, seed=3, max_tokens=20, n=4,
                        guided=GuidedDecoding.choice(["yes", "no", "not sure"]))
    for o in llm.generate("Is the sky green?", ch)[0].outputs:
        assert o.text in ("yes", "no", "not sure")


def test_speculation_keeps_greedy_guided_output(llm: LLM, spec_llm: LLM) -> None:
    """Drafts are checked against the grammar (refused ones are rejected), so
    greedy output with ngram speculation is the output without it."""
    prompt = [{"role": "user", "content": 'Repeat exactly: {"name": "Ada", "age": 36, "tags": ["red", '
                                          '"blue"]} and {"name": "Ada", "age": 36, "tags": ["red"]}'}]
    plain = llm.chat(prompt, GREEDY)[0].outputs[0]
    spec = spec_llm.chat(prompt, GREEDY)[0].outputs[0]
    assert spec.token_ids == plain.token_ids
    jsonschema.validate(json.loads(spec.text), PERSON)
    stats = spec_llm.engine.spec.stats  # type: ignore[union-attr]
    assert stats.num_draft_tokens > 0  # drafts were made and checked
    assert free_equals_total(spec_llm)


def test_resumed_request_continues_the_grammar(llm: LLM) -> None:
    """A migrated request: prompt + its first tokens, which the grammar
    advances over; the rest is what the undisturbed request made."""
    whole = llm.chat(PROMPT, GREEDY)[0].outputs[0].token_ids
    prompt_ids = llm.engine.tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True)
    if not isinstance(prompt_ids, list):
        prompt_ids = prompt_ids["input_ids"]
    cut = 5
    eng = llm.engine
    eng.add_request("resumed", [*prompt_ids, *whole[:cut]], replace(GREEDY, max_tokens=64 - cut),
                    num_resumed_tokens=cut)
    rest: list[int] = []
    while eng.has_unfinished():
        for out in eng.step():
            rest += out.new_token_ids
    assert whole[:cut] + rest == whole
    # Without advancing, the grammar would insist on a new "{" here.
    with pytest.raises(ValueError, match="^guided: resumed output token 0"):
        eng.add_request("bad", [*prompt_ids, 11], GREEDY, num_resumed_tokens=1)


def test_refused_grammar_names_it(llm: LLM) -> None:
    with pytest.raises(ValueError, match="^guided.grammar: the grammar engine refused it"):
        llm.generate("hi", SamplingParams(guided=GuidedDecoding.grammar("root ::= undefined_rule")))
    assert free_equals_total(llm)
