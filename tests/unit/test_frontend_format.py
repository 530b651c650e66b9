import json

from engine.sampling_params import SamplingParams
from protos import pb
from services.frontend import openai_format as fmt
from services.frontend.prepare import Plan, PromptPlan
from services.frontend.results import Event, Results

ENV = fmt.Envelope("cmpl-1", 1700000000, "m")


def lp(tok: int, text: str, logprob: float, alts: int) -> pb.TokenLogprobs:
    top = [pb.TopLogprob(token_id=tok + j, logprob=logprob - j, token=f"{text}{j}") for j in range(alts)]
    return pb.TokenLogprobs(token_id=tok, logprob=logprob, rank=1, token=text, top=top)


def test_sse_framing() -> None:
    assert fmt.sse({"a": "é"}) == 'data: {"a":"é"}\n\n'
    assert fmt.SSE_DONE == "data: [DONE]\n\n"


def test_completion_logprobs_offsets_and_top() -> None:
    out = fmt.completion_logprobs([lp(1, "ab", -0.5, 2), lp(2, "c", float("-inf"), 0)], 1, text_offset=5)
    assert out["tokens"] == ["ab", "c"]
    assert out["text_offset"] == [5, 7]
    assert out["token_logprobs"] == [-0.5, fmt.MIN_LOGPROB]  # JSON has no -inf
    # top 1, plus the chosen token
    assert out["top_logprobs"] == [{"ab0": -0.5, "ab": -0.5}, {"c": fmt.MIN_LOGPROB}]
    json.dumps(out, allow_nan=False)


def test_chat_logprobs_shape() -> None:
    out = fmt.chat_logprobs([lp(1, "hé", -0.5, 3)], 2)
    entry = out["content"][0]
    assert entry["token"] == "hé" and entry["bytes"] == list("hé".encode())
    assert [t["token"] for t in entry["top_logprobs"]] == ["hé0", "hé1"]


def test_chat_chunks() -> None:
    role = fmt.chat_role_chunk(ENV, 0, include_usage=True)
    assert role["object"] == "chat.completion.chunk" and role["usage"] is None
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    mid = fmt.chat_chunk(ENV, 1, pb.WorkerGenerateResponse(token_ids=[3], text="hi"), None, False)
    assert mid["choices"][0] == {"index": 1, "delta": {"content": "hi"}, "logprobs": None,
                                 "finish_reason": None, "stop_reason": None}
    assert "usage" not in mid
    last = fmt.chat_chunk(ENV, 1, pb.WorkerGenerateResponse(finish_reason="stop", stop_reason="\n"), None,
                          False)
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "stop"


def test_results_and_responses() -> None:
    params = SamplingParams(n=2, max_tokens=4)
    plan = Plan("cmpl-1", [PromptPlan([1, 2, 3], params), PromptPlan([4], params)])
    results = Results(plan)
    results.add(Event(0, pb.WorkerGenerateResponse(token_ids=[5], text="a", cached_tokens=2)))
    results.add(Event(1, pb.WorkerGenerateResponse(token_ids=[6, 7], text="bc", cached_tokens=3,
                                                   finish_reason="length")))
    results.add(Event(0, pb.WorkerGenerateResponse(token_ids=[8], text="d", finish_reason="stop",
                                                   stop_reason="x")))
    for i in (2, 3):
        results.add(Event(i, pb.WorkerGenerateResponse(token_ids=[9], text="e", finish_reason="length")))
    assert results.finished
    usage = results.usage()
    # cached: max over the choices of each prompt (3 and 0), summed over prompts
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (4, 6, 3)
    body = fmt.completion_response(ENV, results.choices, usage, None)
    assert [c["text"] for c in body["choices"]] == ["ad", "bc", "e", "e"]
    assert body["choices"][0]["stop_reason"] == "x"
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10,
                             "prompt_tokens_details": {"cached_tokens": 3}}
    chat = fmt.chat_response(ENV, results.choices[:1], usage, None)
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "ad"}
    assert fmt.usage_chunk(ENV, "text_completion", usage)["choices"] == []
