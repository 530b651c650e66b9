"""prompt_logprobs without a model: the limit, which positions a chunk computes,
no prefix hits while they are wanted, the fan-out, the proto round trip and
vLLM's response shape."""

from __future__ import annotations

from typing import Any

import pytest

from engine.kv_cache_manager import KVCacheManager
from engine.model_runner import prompt_logprob_positions
from engine.outputs import Logprob
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq
from engine.vocab.hashing import extra_keys
from protos import pb
from services.convert import (
    logprobs_from_proto,
    prompt_logprobs_to_proto,
    sampling_from_proto,
    sampling_to_proto,
)
from services.frontend import openai_format as fmt
from services.frontend.dispatch import Event, plan_jobs, resume
from services.frontend.errors import APIError
from services.frontend.prepare import Plan, PromptPlan
from services.frontend.results import Results

from .test_frontend_prepare import chat, completion, preparer


def request(prompt: list[int], prompt_logprobs: int | None) -> Request:
    params = SamplingParams(max_tokens=4, prompt_logprobs=prompt_logprobs)
    return Request("r", prompt, params, max_tokens=4, extra_keys=extra_keys("toy"))


def test_limit_names_the_field() -> None:
    assert SamplingParams(prompt_logprobs=20).prompt_logprobs == 20
    for bad in (21, -1, True, 1.5):
        with pytest.raises(ValueError, match=r"^prompt_logprobs: must be an integer in \[0, 20\]"):
            SamplingParams(prompt_logprobs=bad)  # type: ignore[arg-type]


def test_rest_refuses_over_the_limit_and_with_stream() -> None:
    def refused(fn: Any, req: Any) -> APIError:
        with pytest.raises(APIError) as e:
            fn(req, "r")
        return e.value

    p = preparer()
    e = refused(p.completion, completion(model="m", prompt="hi", prompt_logprobs=21))
    assert (e.status, e.param) == (400, "prompt_logprobs") and "[0, 20]" in e.message
    e = refused(p.chat, chat(model="m", messages=[{"role": "user", "content": "x"}], prompt_logprobs=30))
    assert (e.status, e.param) == (400, "prompt_logprobs")
    e = refused(p.completion, completion(model="m", prompt="hi", prompt_logprobs=2, stream=True))
    assert (e.status, e.param) == (400, "prompt_logprobs") and "stream" in e.message
    # As vLLM: 0 with stream is accepted (and computes nothing).
    plan = p.completion(completion(model="m", prompt="hi", prompt_logprobs=0, stream=True), "r")
    assert not plan.prompt_logprobs
    plan = p.completion(completion(model="m", prompt="hi", prompt_logprobs=3), "r")
    assert plan.prompt_logprobs and plan.prompts[0].params.prompt_logprobs == 3


def test_positions_per_chunk_and_after_a_preemption() -> None:
    req = request(list(range(10, 20)), 2)  # 10 tokens: positions 0..8 predict tokens 1..9

    def span(start: int, n: int) -> range:
        return prompt_logprob_positions(ScheduledSeq(req, start, n, [], sample=start + n == 10))

    assert span(0, 4) == range(0, 4)
    req.prompt_logprobs += [{}] * 4
    assert span(4, 6) == range(4, 9)  # the last prompt position samples; it predicts no prompt token
    req.prompt_logprobs += [{}] * 5
    assert span(0, 10) == range(0)  # recomputed after a preemption: nothing twice
    assert prompt_logprob_positions(ScheduledSeq(request([1, 2, 3], None), 0, 3, [], True)) == range(0)


def test_no_prefix_hits_while_prompt_logprobs_are_wanted() -> None:
    kv = KVCacheManager(16, 4)
    first = request(list(range(9)), None)
    assert kv.allocate_slots(first, 9) is not None
    assert kv.get_computed_blocks(request(list(range(9)), None))[1] == 8  # two full blocks cached
    wants = request(list(range(9)), 1)
    assert kv.get_computed_blocks(wants) == ([], 0)
    wants.prompt_logprobs = None  # sent: a recompute may use the cache again
    assert kv.get_computed_blocks(wants)[1] == 8


def test_choices_share_one_computation_and_a_migration_asks_for_none() -> None:
    params = SamplingParams(n=3, max_tokens=4, prompt_logprobs=2)
    jobs = plan_jobs(Plan("r", [PromptPlan([1, 2, 3], params), PromptPlan([4, 5], params)]))
    assert [j.params.prompt_logprobs for j in jobs] == [2, None, None, 2, None, None]
    resumed = resume(jobs[0], [7, 8], 1)
    assert resumed is not None and resumed.params.prompt_logprobs is None
    assert sampling_from_proto(sampling_to_proto(params)).prompt_logprobs == 2


def test_proto_round_trip_keeps_ranks() -> None:
    pos = {5: Logprob(-0.125, 1, "a"), 6: Logprob(-2.5, 2, "b"), 9: Logprob(-7.0, 40, "z")}
    msgs = prompt_logprobs_to_proto([3, 9], [None, pos])
    assert len(msgs) == 1 and msgs[0].token_id == 9 and msgs[0].rank == 40
    assert logprobs_from_proto(msgs[0]) == pos
    assert prompt_logprobs_to_proto([3, 9, 4], []) == []


def test_vllm_response_shape() -> None:
    params = SamplingParams(n=2, max_tokens=1, prompt_logprobs=1)
    plan = Plan("cmpl-1", [PromptPlan([1, 2], params)])
    results = Results(plan)
    entry = pb.TokenLogprobs(token_id=2, logprob=-3.0, rank=4, token="b",
                             top=[pb.TopLogprob(token_id=7, logprob=-0.5, token="x", rank=1),
                                  pb.TopLogprob(token_id=2, logprob=-3.0, token="b", rank=4)])
    results.add(Event(0, pb.WorkerGenerateResponse(token_ids=[8], text="y", finish_reason="length",
                                                   prompt_logprobs=[entry])))
    results.add(Event(1, pb.WorkerGenerateResponse(token_ids=[9], text="z", finish_reason="length")))
    env = fmt.Envelope("cmpl-1", 1, "m")
    want = [None, {7: {"logprob": -0.5, "rank": 1, "decoded_token": "x"},
                   2: {"logprob": -3.0, "rank": 4, "decoded_token": "b"}}]
    body = fmt.completion_response(env, results.choices, results.usage(), None, prompt_logprobs=True)
    assert [c["prompt_logprobs"] for c in body["choices"]] == [want, want]  # each choice of the prompt
    chat_body = fmt.chat_response(env, results.choices, results.usage(), None, prompt_logprobs=True)
    assert chat_body["prompt_logprobs"] == want and "prompt_logprobs" not in chat_body["choices"][0]
    assert "prompt_logprobs" not in fmt.completion_response(env, results.choices, results.usage(),
                                                            None)["choices"][0]
