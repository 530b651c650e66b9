"""The frontend over real processes: one prefill and one decode worker (KV over UCX)
and the frontend itself, called with the official `openai` SDK, raw HTTP and gRPC.

Issue 3 acceptance 1 (SDK chat and completions, streaming and not; streamed text
equals non-streamed for the same seed; usage counts) and 5 (bad input on REST and
gRPC gets a 4xx naming the field, and the server keeps serving)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest

from protos import pb, pb_grpc
from services.frontend.tokenizer import Tokenizer

from .procs import ROOT, free_port, start_worker

MODEL = "SmolLM2-135M-Instruct"
THRESHOLD = 64  # prompts at least this long are prefilled on the prefill worker (SHORT: 37 tokens)
MAX_MODEL_LEN = 1024  # procs.WORKER_FLAGS
SHORT = [{"role": "user", "content": "What is the capital of France?"}]
LONG = [{"role": "user", "content": "Describe a quiet harbour town at dawn, the boats, the gulls and the "
                                    "people who live there, in a few vivid sentences. " * 3}]



class Frontend:
    def __init__(self, tmp: Path, decode: str, prefill: str) -> None:
        self.port, self.grpc_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / "frontend.log"
        with open(self.log, "wb") as log:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "services.frontend", "--port", str(self.port),
                 "--grpc-port", str(self.grpc_port), "--decode", decode, "--prefill", prefill,
                 "--local-prefill-threshold", str(THRESHOLD), "--worker-wait", "60",
                 "--log-level", "warning"],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_healthy(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"frontend exited ({self.popen.returncode}):\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"frontend not healthy in {timeout} s:\n{self.tail()}")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def stop(self) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                return self.popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
        return self.popen.wait()


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[tuple[Frontend, Any, Any]]:  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("frontend")
    p0 = start_worker("prefill", "p0", tmp, "--num-blocks", "256")
    d0 = start_worker("decode", "d0", tmp, "--num-blocks", "256", "--local-prefill-threshold", str(THRESHOLD))
    fe = None
    try:
        fe = Frontend(tmp, d0.wait_ready(), p0.wait_ready())
        fe.wait_healthy()
        yield fe, p0, d0
        assert fe.stop() == 0, fe.tail()  # SIGTERM: a clean, graceful exit
    finally:
        if fe is not None:
            fe.stop()
        for p in (d0, p0):
            p.stop()


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=f"{stack[0].url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> Tokenizer:  # type: ignore[no-untyped-def]
    return Tokenizer(model_dir)


def workers(fe: Frontend) -> dict[str, dict[str, Any]]:
    return {w["id"]: w for w in httpx.get(f"{fe.url}/cluster", timeout=5).json()["workers"]}


def wait_all_blocks_free(fe: Frontend, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ws = workers(fe).values()
        if all(w["free_blocks"] == w["total_blocks"] and w["running"] == w["waiting"] == 0 for w in ws):
            return
        time.sleep(0.2)
    raise AssertionError(f"blocks not freed: {workers(fe)}")


def test_torch_free_tokenizer_matches_transformers(tokenizer, model_dir) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(model_dir)
    for text in ("Hello world", " leading space", "emoji 🔥 and ünïcödé", "<|im_start|>user\nhi<|im_end|>"):
        assert tokenizer.encode(text) == list(hf.encode(text, add_special_tokens=True))
    multi_turn = [{"role": "system", "content": "Be brief."}, *SHORT,
                  {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "Why?"}]
    for conv in (SHORT, LONG, multi_turn):
        ids = hf.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
        ids = ids if isinstance(ids, list) else ids["input_ids"]
        assert tokenizer.apply_chat_template(conv) == list(ids)


def test_cluster_health_models(stack, client) -> None:  # type: ignore[no-untyped-def]
    fe, p0, d0 = stack
    ws = workers(fe)
    assert ws["d0"]["role"] == "decode" and ws["p0"]["role"] == "prefill"
    for w in ws.values():
        assert w["health"] == "healthy" and w["pid"] and w["total_blocks"] == 256
    assert ws["d0"]["ucx_address"]
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_greedy_matches_the_offline_engine(stack, client, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """DESIGN.md invariant 5 through the frontend: its chat template and tokenizer,
    REST and gRPC, prompts prefilled on the decode worker and on the prefill worker."""
    from engine import LLM, SamplingParams

    llm = LLM(dtype="float32", num_blocks=64, num_threads=1, max_model_len=MAX_MODEL_LEN)
    for messages in (SHORT, LONG):
        ids = tokenizer.apply_chat_template(messages)
        assert (len(ids) >= THRESHOLD) == (messages is LONG)
        ref = llm.chat(messages, SamplingParams(temperature=0, max_tokens=12))[0]
        assert ref.prompt_token_ids == ids
        out = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12)
        assert out.choices[0].message.content == ref.outputs[0].text
        with grpc.insecure_channel(f"127.0.0.1:{stack[0].grpc_port}") as ch:
            msgs = list(pb_grpc.FrontendStub(ch).Generate(pb.GenerateRequest(
                model=MODEL, token_ids=pb.TokenIds(ids=ids),
                sampling=pb.SamplingParams(temperature=0, max_tokens=12)), timeout=120))
        assert [t for m in msgs for t in m.token_ids] == ref.outputs[0].token_ids
        assert msgs[-1].usage.prompt_tokens == len(ids)


def test_chat_stream_equals_non_stream_with_usage(client, tokenizer) -> None:  # type: ignore[no-untyped-def]
    for messages in (SHORT, LONG):
        kw: dict[str, Any] = dict(model=MODEL, messages=messages, max_tokens=10, temperature=0.9, seed=7,
                                  extra_body={"ignore_eos": True})
        full = client.chat.completions.create(**kw)
        chunks = list(client.chat.completions.create(**kw, stream=True,
                                                     stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == full.choices[0].message.content
        num_prompt = len(tokenizer.apply_chat_template(messages))
        for usage in (full.usage, chunks[-1].usage):
            assert usage.prompt_tokens == num_prompt
            assert usage.completion_tokens == 10 and usage.total_tokens == num_prompt + 10
        assert full.choices[0].finish_reason == "length"


def test_completion_stream_equals_non_stream(client) -> None:  # type: ignore[no-untyped-def]
    kw: dict[str, Any] = dict(model=MODEL, prompt="The three primary colours are", max_tokens=8, seed=3,
                              temperature=0.7)
    full = client.completions.create(**kw)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))
    assert streamed == full.choices[0].text
    assert full.usage.completion_tokens == 8 or full.choices[0].finish_reason == "stop"


def test_n_and_prefix_cache_hits_are_reported(client) -> None:  # type: ignore[no-untyped-def]
    kw: dict[str, Any] = dict(model=MODEL, messages=LONG, max_tokens=4, temperature=1.0, seed=11)
    first = client.chat.completions.create(**kw, n=2)
    assert len(first.choices) == 2 and first.usage.completion_tokens <= 8
    again = client.chat.completions.create(**kw)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16  # at least one full block
    assert again.choices[0].message.content == first.choices[0].message.content  # seed + 0


def test_disconnect_frees_every_block(stack) -> None:  # type: ignore[no-untyped-def]
    fe = stack[0]
    body = {"model": MODEL, "messages": LONG, "max_tokens": 200, "stream": True, "extra": 1,
            "ignore_eos": True}
    with httpx.stream("POST", f"{fe.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert sum(1 for line, _ in zip(r.iter_lines(), range(6), strict=False) if line)
    wait_all_blocks_free(fe)


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/v1/chat/completions", b'{"messages": [', 400, "body"),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": SHORT}, 404, "model"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": SHORT, "n": 0}, 400, "n"),
    ("/v1/chat/completions", {"model": MODEL, "messages": SHORT, "max_tokens": MAX_MODEL_LEN}, 400,
     "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": [1] * MAX_MODEL_LEN}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": "warm"}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": 42}, 400, "prompt"),
])
def test_bad_rest_input(stack, path: str, body: Any, status: int, param: str) -> None:  # type: ignore[no-untyped-def]
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{stack[0].url}{path}", content=data, headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"]


@pytest.mark.parametrize(("req", "code", "field"), [
    (pb.GenerateRequest(model="gpt-4", text="hi"), grpc.StatusCode.NOT_FOUND, "model"),
    (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(n=1000)), grpc.StatusCode.INVALID_ARGUMENT,
     "n"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * MAX_MODEL_LEN)), grpc.StatusCode.INVALID_ARGUMENT,
     "prompt"),
    (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=MAX_MODEL_LEN)),
     grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
])
def test_bad_grpc_input(stack, req: pb.GenerateRequest, code: grpc.StatusCode, field: str) -> None:  # type: ignore[no-untyped-def]
    with grpc.insecure_channel(f"127.0.0.1:{stack[0].grpc_port}") as ch, pytest.raises(grpc.RpcError) as e:
        list(pb_grpc.FrontendStub(ch).Generate(req, timeout=30))
    assert e.value.code() == code and field in e.value.details()


def test_still_serving_after_bad_input(stack, client) -> None:  # type: ignore[no-untyped-def]
    fe = stack[0]
    out = client.chat.completions.create(model=MODEL, messages=SHORT, temperature=0, max_tokens=4)
    assert out.choices[0].message.content
    metrics = httpx.get(f"{fe.url}/metrics", timeout=5).text
    assert 'splitserve_frontend_requests_total{endpoint="chat.completions",status="400"}' in metrics
    assert any(line.startswith("splitserve_time_to_first_token_seconds_count{")
               and 'endpoint="grpc.Generate"' in line and 'role="frontend"' in line
               for line in metrics.splitlines())
    wait_all_blocks_free(fe)


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> tuple[set[str], Samples]:
    """(metric family names, samples) of one /metrics, parsed by prometheus-client."""
    from prometheus_client.parser import text_string_to_metric_families

    families = list(text_string_to_metric_families(httpx.get(url, timeout=10).text))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}
    return {f.name for f in families}, samples


def total(samples: Samples, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items()
               if n == name and all(dict(ls).get(k) == want for k, want in labels.items()))


def test_metrics_name_everything_and_count_a_known_workload(stack, client) -> None:  # type: ignore[no-untyped-def]
    """Issue 6 acceptance 2: each service's /metrics parses, holds its vLLM-named
    metrics, and after a known workload its counters equal the known counts."""
    from services.observability import metric_names as names

    fe = stack[0]
    urls = {"frontend": f"{fe.url}/metrics",
            **{w["role"]: w["metrics_url"] for w in workers(fe).values()}}
    assert set(urls) == {"frontend", "prefill", "decode"}
    routing = {"router_decisions", "index_fallbacks", "requests_migrated"}
    engine = {"request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
              "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions",
              "prefix_cache_queries", "prefix_cache_hits", "spec_decode_num_drafts",
              "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "kv_transfer_bytes",
              "kv_transfer_seconds", "kv_transfer_failures", "kv_transfer_recomputes"}
    every = {*names.HISTOGRAMS, *names.GAUGES, *names.COUNTERS}
    expected = {"frontend": every - engine, "prefill": every - routing, "decode": every - routing}
    before = {role: scrape(url)[1] for role, url in urls.items()}

    # One long prompt (prefilled remotely), one short (locally); one ends by length, one by a stop token.
    runs = [client.completions.create(model=MODEL, prompt=LONG[0]["content"], max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True}),
            client.completions.create(model=MODEL, prompt="Count: one, two, three,", max_tokens=3,
                                      temperature=0, extra_body={"ignore_eos": True})]
    first = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=1, temperature=0)
    runs.append(client.completions.create(model=MODEL, prompt="The sky is", max_tokens=8, temperature=0,
                                          stop=[first.choices[0].text]))
    runs.append(first)
    prompt = sum(r.usage.prompt_tokens for r in runs)
    generated = sum(r.usage.completion_tokens for r in runs)
    reasons = {"length": sum(c.finish_reason == "length" for r in runs for c in r.choices),
               "stop": sum(c.finish_reason == "stop" for r in runs for c in r.choices)}
    assert reasons == {"length": 3, "stop": 1}

    deadline = time.monotonic() + 10
    while True:  # the frontend counts a request as it closes, just after answering
        after = {role: scrape(url) for role, url in urls.items()}
        d = {role: {n: total(after[role][1], n) - total(before[role], n)
                    for n in ("splitserve_prompt_tokens_total", "splitserve_generation_tokens_total")}
             for role in urls}
        if d["frontend"]["splitserve_prompt_tokens_total"] == prompt or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for role, (families, _) in after.items():
        missing = {n for n in expected[role] if "splitserve_" + n not in families}
        assert not missing, f"{role} /metrics lacks {sorted(missing)}"
    for role in ("frontend", "decode"):  # every request ran on the one decode worker
        assert d[role] == {"splitserve_prompt_tokens_total": prompt,
                           "splitserve_generation_tokens_total": generated}, role
        for reason, count in reasons.items():
            got = (total(after[role][1], "splitserve_request_success_total", finished_reason=reason)
                   - total(before[role], "splitserve_request_success_total", finished_reason=reason))
            assert got == count, (role, reason)
    long_prompt = runs[0].usage.prompt_tokens
    assert long_prompt >= THRESHOLD > max(r.usage.prompt_tokens for r in runs[1:])
    assert d["prefill"] == {"splitserve_prompt_tokens_total": long_prompt,
                            "splitserve_generation_tokens_total": 0}
    moved = {role: total(after[role][1], "splitserve_kv_transfer_bytes_total")
             - total(before[role], "splitserve_kv_transfer_bytes_total") for role in ("prefill", "decode")}
    assert moved["prefill"] == moved["decode"] > 0
    assert (total(after["decode"][1], "splitserve_request_queue_time_seconds_count")
            - total(before["decode"], "splitserve_request_queue_time_seconds_count")) == len(runs)
