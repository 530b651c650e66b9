"""prompt_logprobs against Hugging Face transformers' own forward in float32:
the offline engine (chunked prefill, a warm prefix cache, n = 2), and
`splitserve up --prefill 1 --decode 1` over REST and gRPC: a long prompt
prefilled on the prefill worker (the logprobs come back through the decode
worker's stream) and a short one prefilled on the decode worker itself
(colocated).  Logprobs agree within 1e-3, the tolerance of the HF parity tests."""

from __future__ import annotations

import time
from typing import Any

import grpc
import httpx
import pytest
import torch

from engine import LLM, SamplingParams
from protos import pb, pb_grpc

from .procs import UpProc

MODEL = "SmolLM2-135M-Instruct"
TOL = 1e-3
K = 3
THRESHOLD = 32
SHORT = "The capital of France is Paris, and the capital of Italy is"
LONG = "Write a summary of the following text.\n" + " ".join(
    f"Paragraph {i}: the committee met on day {i} to discuss item {i * 7 % 13}." for i in range(12))


@pytest.fixture(scope="module")
def hf_logprobs(model_dir, tokenizer):  # type: ignore[no-untyped-def]
    """ids -> [len - 1, V] float32 logprobs: row p is the distribution of token p + 1."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cache: dict[tuple[int, ...], torch.Tensor] = {}

    def ref(ids: list[int]) -> torch.Tensor:
        if tuple(ids) not in cache:
            with torch.inference_mode():
                cache[tuple(ids)] = hf(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
        return cache[tuple(ids)]

    return ref


def check(ids: list[int], got: list[Any], ref: torch.Tensor, k: int) -> None:
    """got: vLLM's shape, entries as {token id: (logprob, rank)}."""
    assert len(got) == len(ids) and got[0] is None
    for p, entry in enumerate(got[1:]):
        row, tok = ref[p], ids[p + 1]
        lp, rank = entry[tok]
        assert abs(lp - row[tok].item()) < TOL, f"position {p + 1}: {lp} vs {row[tok].item()}"
        # Rank: 1 + tokens more likely; within the tolerance either way.
        assert int((row > row[tok] + TOL).sum()) + 1 <= rank <= int((row > row[tok] - TOL).sum()) + 1
        alts = sorted((v for t, v in entry.items() if t != tok or v[1] <= k), key=lambda v: v[1])
        assert [r for _, r in alts][:k] == list(range(1, k + 1)), entry
        kth_best = row.topk(k).values[-1].item()
        assert all(v[0] >= kth_best - TOL for v in alts[:k])
        for t, (v, _) in entry.items():
            assert abs(v - row[t].item()) < TOL


def engine_entries(pl: list[Any]) -> list[Any]:
    return [None] + [{t: (lp.logprob, lp.rank) for t, lp in pos.items()} for pos in pl[1:]]


def rest_entries(pl: list[Any]) -> list[Any]:
    return [None] + [{int(t): (v["logprob"], v["rank"]) for t, v in pos.items()} for pos in pl[1:]]


def test_offline_chunked_and_after_a_warm_prefix(hf_logprobs, tokenizer) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(dtype="float32", num_blocks=128, num_threads=2, block_size=8, max_num_batched_tokens=37)
    ids = tokenizer.encode(LONG)
    assert len(ids) > 3 * 37  # several chunks
    warm = llm.generate([ids], SamplingParams(temperature=0, max_tokens=2))[0]
    assert warm.prompt_logprobs is None
    params = SamplingParams(temperature=0, max_tokens=2, n=2, prompt_logprobs=K)
    computed = llm.engine.prompt_tokens_computed
    out = llm.generate([ids], params)[0]
    # Choice 0 computed every position (no warm prefix taken); choice 1, asked
    # for none (they are shared), took the cache.
    assert llm.engine.prompt_tokens_computed - computed > len(ids) and out.num_cached_tokens > 0
    check(ids, engine_entries(out.prompt_logprobs), hf_logprobs(ids), K)
    assert out.outputs[0].token_ids == warm.outputs[0].token_ids == out.outputs[1].token_ids
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


@pytest.fixture(scope="module")
def stack(tmp_path_factory):  # type: ignore[no-untyped-def]
    up = UpProc(tmp_path_factory.mktemp("up"), "--prefill", "1", "--decode", "1", "--dtype", "float32",
                "--num-blocks", "128", "--max-model-len", "1024", "--num-threads", "1",
                "--local-prefill-threshold", str(THRESHOLD))
    yield up.url, up.grpc_address
    up.stop()


def counters(url: str) -> dict[str, float]:
    decode = next(w for w in httpx.get(f"{url}/cluster").json()["workers"] if w["role"] == "decode")
    return decode["counters"]


def test_split_and_colocated_match_transformers(stack, hf_logprobs, tokenizer) -> None:  # type: ignore[no-untyped-def]
    url, _ = stack
    short, long = tokenizer.encode(SHORT), tokenizer.encode(LONG)
    assert len(short) < THRESHOLD <= len(long)
    with httpx.Client(timeout=300) as http:
        for ids, where in ((long, "remote_prefills"), (short, "local_prefills"), (long, "remote_prefills")):
            before = counters(url)[where]
            r = http.post(f"{url}/v1/completions", json={
                "model": MODEL, "prompt": ids, "max_tokens": 2, "temperature": 0, "n": 2,
                "prompt_logprobs": K})
            assert r.status_code == 200, r.text
            choices = r.json()["choices"]
            for c in choices:  # the third call repeats the first: a warm prefix takes no shortcut
                check(ids, rest_entries(c["prompt_logprobs"]), hf_logprobs(ids), K)
            deadline = time.monotonic() + 30  # /cluster's counters come with the next load report
            while counters(url)[where] < before + 1:
                assert time.monotonic() < deadline, (where, before, counters(url))
                time.sleep(0.05)
        r = http.post(f"{url}/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": LONG}], "max_tokens": 2,
            "temperature": 0, "prompt_logprobs": 1})
        assert r.status_code == 200, r.text
        body = r.json()
        chat_ids = tokenizer.apply_chat_template([{"role": "user", "content": LONG}],
                                                 add_generation_prompt=True, tokenize=True)
        chat_ids = list(chat_ids if isinstance(chat_ids, list) else chat_ids["input_ids"])
        assert body["usage"]["prompt_tokens"] == len(chat_ids)
        check(chat_ids, rest_entries(body["prompt_logprobs"]), hf_logprobs(chat_ids), 1)
        for extra, field in (({"prompt_logprobs": 21}, "prompt_logprobs"),
                             ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs")):
            r = http.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_grpc_first_chunk_carries_them(stack, hf_logprobs, tokenizer) -> None:  # type: ignore[no-untyped-def]
    _, address = stack
    ids = tokenizer.encode(LONG)
    with grpc.insecure_channel(address) as ch:
        req = pb.GenerateRequest(model=MODEL, token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
            temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=2))
        msgs = list(pb_grpc.FrontendStub(ch).Generate(req, timeout=300))
    first = msgs[0].prompt_logprobs
    assert all(not m.prompt_logprobs for m in msgs[1:])
    got = [None] + [{t.token_id: (t.logprob, t.rank) for t in pos.top}
                    | {pos.token_id: (pos.logprob, pos.rank)} for pos in first]
    assert [pos.token_id for pos in first] == ids[1:]
    check(ids, got, hf_logprobs(ids), 2)
