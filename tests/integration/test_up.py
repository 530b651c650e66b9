"""`splitserve up --prefill 2 --decode 2` as users run it: the whole stack in
separate processes, called with the official openai SDK and over gRPC.  Greedy
float32 tokens equal the offline engine's for prompts above and below the
local-prefill threshold (invariant 5), both workers of each role take work,
and SIGTERM stops every process."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import httpx
import openai
import pytest

from engine import LLM, SamplingParams
from protos import pb, pb_grpc

from .procs import UpProc, wait_until

MODEL = "SmolLM2-135M-Instruct"
THRESHOLD = 32
PROMPTS = [
    "Summer",  # short: prefilled on a decode worker
    "The quick brown fox",
    "Write a limerick about a cat who learned to code. " * 4,  # long: prefilled remotely
    "Explain why the sky is blue, step by step, for a curious child. " * 4,
    "List five uses of a paperclip that have nothing to do with paper. " * 4,
    "Describe the rules of chess briefly, as if to a newcomer. " * 4,
]



@pytest.fixture(scope="module")
def stack(tmp_path_factory):  # type: ignore[no-untyped-def]
    up = UpProc(tmp_path_factory.mktemp("up"), "--prefill", "2", "--decode", "2", "--dtype", "float32",
                "--num-blocks", "128", "--max-model-len", "1024", "--num-threads", "1",
                "--local-prefill-threshold", str(THRESHOLD))
    pids = [w["pid"] for w in httpx.get(f"{up.url}/cluster").json()["workers"]]
    yield up.url, up.grpc_address
    up.stop()
    for pid in pids:  # every worker is gone too
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.fixture(scope="module")
def offline():  # type: ignore[no-untyped-def]
    return LLM(dtype="float32", num_blocks=128, num_threads=1, max_model_len=1024)


def grpc_tokens(address: str, ids: list[int], max_tokens: int) -> list[int]:
    with grpc.insecure_channel(address) as ch:
        req = pb.GenerateRequest(model=MODEL, token_ids=pb.TokenIds(ids=ids),
                                 sampling=pb.SamplingParams(temperature=0, max_tokens=max_tokens,
                                                            ignore_eos=True))
        return [t for r in pb_grpc.FrontendStub(ch).Generate(req, timeout=180) for t in r.token_ids]


def by_role(url: str) -> dict[str, list[dict[str, Any]]]:
    roles: dict[str, list[dict[str, Any]]] = {"prefill": [], "decode": []}
    for w in httpx.get(f"{url}/cluster").json()["workers"]:
        roles[w["role"]].append(w)
    return roles


def counted(roles: dict[str, list[dict[str, Any]]], requests: int) -> bool:
    """Every request's prefill and some generated tokens are in the workers' reports."""
    decode = [w["counters"] for w in roles["decode"]]
    return (sum(c["remote_prefills"] + c["local_prefills"] for c in decode) >= requests
            and all(c["generation_tokens"] > 0 for c in decode)
            and any(w["counters"]["prompt_tokens_computed"] > 0 for w in roles["prefill"]))


def test_two_by_two_matches_offline_and_spreads_work(stack, offline) -> None:  # type: ignore[no-untyped-def]
    url, grpc_address = stack
    ids = [offline.tokenizer.encode(p) for p in PROMPTS]
    assert min(len(i) for i in ids[2:]) >= THRESHOLD > max(len(i) for i in ids[:2])
    refs = [o.outputs[0].token_ids for o in
            offline.generate(ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))]
    with ThreadPoolExecutor(len(ids)) as pool:
        got = list(pool.map(lambda i: grpc_tokens(grpc_address, i, 12), ids))
    assert got == refs

    # /cluster's counters come with each worker's next load report, after the request ends.
    wait_until(lambda: counted(by_role(url), len(ids)), 10,
               lambda: f"the load reports never counted the requests: {by_role(url)}")
    roles = by_role(url)
    decode = [w["counters"] for w in roles["decode"]]
    assert len(roles["prefill"]) == 2 and len(decode) == 2
    assert all(c["generation_tokens"] > 0 for c in decode)
    assert sum(c["remote_prefills"] for c in decode) == 4
    assert sum(c["local_prefills"] for c in decode) == 2
    assert any(w["counters"]["prompt_tokens_computed"] > 0 for w in roles["prefill"])


def test_openai_sdk_chat_stream_equals_non_stream(stack, offline) -> None:  # type: ignore[no-untyped-def]
    url, _ = stack
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=180)
    messages = [{"role": "user", "content": PROMPTS[3]}]
    ref = offline.chat(messages, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert full.choices[0].message.content == ref.text
    assert full.usage.completion_tokens == len(ref.token_ids)
    assert full.usage.prompt_tokens == len(offline.engine.tokenize(
        offline.apply_chat_template(messages)))
    chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                            temperature=0.9, seed=3, stream=True,
                                            stream_options={"include_usage": True})
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                           temperature=0.9, seed=3)
    assert streamed == again.choices[0].message.content

    def workers() -> list[dict]:  # type: ignore[type-arg]
        return httpx.get(f"{url}/cluster").json()["workers"]  # type: ignore[no-any-return]

    # load reports arrive every 0.2 s
    wait_until(lambda: all(w["free_blocks"] == w["total_blocks"] for w in workers()), 10,
               lambda: f"blocks still held: {workers()}")
