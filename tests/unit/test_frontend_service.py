"""The whole frontend (REST + gRPC, one loop) against fake decode/prefill workers in-process.

The fakes speak the real worker protocol (protos/splitserve.proto) with no model:
a request's tokens are a function of its prompt and seed, so tests can check
routing, fan-out, retry, cancellation and the OpenAI shapes in about a second.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import httpx
import openai
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from protos import pb, pb_grpc
from services.decode.session import GenerateSession
from services.frontend.app import serve
from services.frontend.config import FrontendConfig
from services.ports import free_port

T = TypeVar("T")
MAX_MODEL_LEN = 128
THRESHOLD = 16




def tiny_model_dir(path: Path) -> str:
    """A tokenizer (one token per word) and a chat template: all the frontend reads of a model."""
    words = ["[UNK]", "<", ">", "user", "assistant", "system", "Hello", "there", "hi", "x"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "config.json").write_text(json.dumps({"vocab_size": 1000}))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (path / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m.role }}> {{ m.content }} {% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")
    return str(path)


def fake_token(prompt: list[int], seed: int, i: int) -> int:
    return 10 + (sum(prompt) + 7 * seed + i) % 50


class FakeDecode(pb_grpc.DecodeServicer):
    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.address = ""
        self.running = 0  # reported load: lets a test decide which worker the router picks first
        self.fail_salts: dict[str, grpc.StatusCode] = {}  # cache_salt -> error before the first token
        self.requests: list[pb.WorkerGenerateRequest] = []
        self.cancelled: list[str] = []
        self.live: set[str] = set()  # request ids in flight: a second one is refused, as the engine does

    async def Generate(self, request: pb.WorkerGenerateRequest, context: Any):  # type: ignore[no-untyped-def]  # noqa: N802
        self.requests.append(request)
        if request.request_id in self.live:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request_id: {request.request_id!r} is already in the engine")
        self.live.add(request.request_id)
        try:
            async for msg in self._generate(request, context):
                yield msg
        finally:
            self.live.discard(request.request_id)

    async def _generate(self, request: pb.WorkerGenerateRequest, context: Any):  # type: ignore[no-untyped-def]
        code = self.fail_salts.get(request.cache_salt)
        if code is not None:
            await context.abort(code, "max_tokens: fake refusal" if code == grpc.StatusCode.INVALID_ARGUMENT
                                else f"{self.worker_id} is failing")
        sp = request.sampling
        seed = sp.seed if sp.HasField("seed") else 0
        prompt = list(request.prompt_token_ids)
        delay = 0.05 if request.cache_salt == "slow" else 0.0
        try:
            for i in range(sp.max_tokens):
                await asyncio.sleep(delay)
                tok = fake_token(prompt, seed, i)
                lps = []
                if sp.HasField("logprobs"):
                    top = [pb.TopLogprob(token_id=tok + j, logprob=-0.5 - j, token=f"t{tok + j}")
                           for j in range(sp.logprobs)]
                    lps = [pb.TokenLogprobs(token_id=tok, logprob=-0.5, rank=1, token=f" t{tok}", top=top)]
                last = i == sp.max_tokens - 1
                yield pb.WorkerGenerateResponse(
                    token_ids=[tok], text=f" t{tok}", logprobs=lps, finish_reason="length" if last else "",
                    prompt_tokens=len(prompt), cached_tokens=16 if len(prompt) >= 32 else 0,
                    remote_prefill=bool(request.prefill_address))
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise

    async def Session(self, request_iterator: Any, context: Any) -> None:  # noqa: N802
        await GenerateSession(self.Generate, context).run(request_iterator)  # the real session over the fake

    async def Abort(self, request: pb.AbortRequest, context: Any) -> pb.AbortResponse:  # noqa: N802
        return pb.AbortResponse(found=False)

    async def Info(self, request: pb.InfoRequest, context: Any) -> pb.WorkerInfo:  # noqa: N802
        return pb.WorkerInfo(worker_id=self.worker_id, role="decode", pid=1234, grpc_address=self.address,
                             ucx_address="127.0.0.1:1", metrics_url="http://127.0.0.1:1/metrics",
                             model_id="SmolLM2-135M-Instruct", max_model_len=MAX_MODEL_LEN)

    async def WatchLoad(self, request: pb.LoadRequest, context: Any):  # type: ignore[no-untyped-def]  # noqa: N802
        while True:
            yield pb.LoadReport(worker_id=self.worker_id, role="decode", running=self.running,
                                free_blocks=200, total_blocks=256)
            await asyncio.sleep(request.interval_seconds)


def report_running(url: str, fake: FakeDecode, running: int, timeout: float = 10) -> None:
    """Make `fake` report `running` requests and wait until the frontend's
    /cluster shows it, so the router's next pick sees the new load."""
    fake.running = running
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        workers = httpx.get(f"{url}/cluster", timeout=2).json()["workers"]
        if any(w["id"] == fake.worker_id and w["running"] == running for w in workers):
            return
        time.sleep(0.02)
    raise TimeoutError(f"the frontend did not see {fake.worker_id} report running={running}")


class FakePrefill(pb_grpc.PrefillServicer):
    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.address = ""

    async def Info(self, request: pb.InfoRequest, context: Any) -> pb.WorkerInfo:  # noqa: N802
        return pb.WorkerInfo(worker_id=self.worker_id, role="prefill", pid=4321, grpc_address=self.address,
                             max_model_len=MAX_MODEL_LEN)

    async def WatchLoad(self, request: pb.LoadRequest, context: Any):  # type: ignore[no-untyped-def]  # noqa: N802
        while True:
            yield pb.LoadReport(worker_id=self.worker_id, role="prefill", total_blocks=256, free_blocks=256)
            await asyncio.sleep(request.interval_seconds)


class Stack:
    """An event loop in a thread hosting the fake workers and the real frontend."""

    def __init__(self, model_dir: str, **config: Any) -> None:
        """config: FrontendConfig fields over the defaults below."""
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.decodes = [FakeDecode("d0"), FakeDecode("d1")]
        self.prefill = FakePrefill("p0")
        self.servers: list[grpc.aio.Server] = []
        for fake in (*self.decodes, self.prefill):
            fake.address = f"127.0.0.1:{free_port()}"
            self.call(self._start_fake(fake))
        self.dead = f"127.0.0.1:{free_port()}"  # a decode worker that never answers
        self.port, self.grpc_port = free_port(), free_port()
        defaults: dict[str, Any] = dict(
            port=self.port, grpc_port=self.grpc_port, model=model_dir, served_model_name="fake-model",
            decode=(self.decodes[0].address, self.decodes[1].address, self.dead),
            prefill=(self.prefill.address,), local_prefill_threshold=THRESHOLD, worker_wait_seconds=0.5,
            load_interval_seconds=0.05, max_body_bytes=64 << 10, max_n=8, shutdown_grace_seconds=1.0,
            log_level="warning")
        self.config = FrontendConfig(**{**defaults, **config})
        self.stop = self.call(self._event())
        self.frontend = asyncio.run_coroutine_threadsafe(serve(self.config, self.stop), self.loop)
        scheme = "https" if self.config.tls_cert else "http"
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.headers = {"Authorization": f"Bearer {self.config.api_keys[0]}"} if self.config.api_keys else {}

    async def _event(self) -> asyncio.Event:
        return asyncio.Event()

    async def _start_fake(self, fake: Any) -> None:
        server = grpc.aio.server()
        if isinstance(fake, FakeDecode):
            pb_grpc.add_DecodeServicer_to_server(fake, server)
        else:
            pb_grpc.add_PrefillServicer_to_server(fake, server)
        server.add_insecure_port(fake.address)
        await server.start()
        self.servers.append(server)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 10) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def wait_healthy(self, timeout: float = 20, verify: Any = True) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert not self.frontend.done(), self.frontend.result()
            try:
                r = httpx.get(f"{self.url}/health", timeout=1, verify=verify)
                if r.status_code == 200 and r.json()["healthy_decode_workers"] == 2:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise TimeoutError("frontend did not become healthy")

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        try:
            self.frontend.result(10)
        finally:
            for server in self.servers:
                self.call(server.stop(None))
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tiny_model_dir(tmp_path_factory.mktemp("model")))
    try:
        s.wait_healthy()
        yield s
    finally:
        s.close()


@pytest.fixture()
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0, timeout=10)


def post(stack: Stack, path: str, body: Any, **kw: Any) -> httpx.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    kw.setdefault("timeout", 10)
    return httpx.post(f"{stack.url}{path}", content=data, headers={"content-type": "application/json"}, **kw)


def sse_events(text: str) -> list[Any]:
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def wait_for(pred: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


# -- happy paths ----------------------------------------------------------------------


def test_completion_and_usage(stack: Stack, client: openai.OpenAI) -> None:
    out = client.completions.create(model="fake-model", prompt=list(range(1, 5)), max_tokens=3, seed=1)
    toks = [fake_token([1, 2, 3, 4], 1, i) for i in range(3)]
    assert out.choices[0].text == "".join(f" t{t}" for t in toks)
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (4, 3, 7)
    assert out.usage.prompt_tokens_details.cached_tokens == 0


def test_short_prompts_prefill_locally_long_ones_remotely(stack: Stack, client: openai.OpenAI) -> None:
    client.completions.create(model="fake-model", prompt=[5] * (THRESHOLD - 1), max_tokens=1,
                              extra_body={"cache_salt": "short"})
    client.completions.create(model="fake-model", prompt=[5] * THRESHOLD, max_tokens=1,
                              extra_body={"cache_salt": "long"})
    sent = {r.cache_salt: r for d in stack.decodes for r in d.requests}
    assert sent["short"].prefill_address == ""
    assert sent["long"].prefill_address == stack.prefill.address


def test_chat_stream_equals_non_stream_and_counts_usage(stack: Stack, client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Hello"}]
    full = client.chat.completions.create(model="fake-model", messages=messages,  # type: ignore[arg-type]
                                          max_tokens=5, seed=3)
    chunks = list(client.chat.completions.create(model="fake-model", messages=messages,  # type: ignore[arg-type]
                                                 max_tokens=5, seed=3, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 5  # type: ignore[union-attr]
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens > 5  # type: ignore[union-attr]


def test_n_fans_out_with_seed_plus_i(stack: Stack, client: openai.OpenAI) -> None:
    out = client.completions.create(model="fake-model", prompt=[[1, 2], [3, 4]], max_tokens=2, n=3, seed=10,
                                    extra_body={"cache_salt": "fanout"})
    assert [c.index for c in out.choices] == list(range(6))
    seeds = sorted((tuple(r.prompt_token_ids), r.sampling.seed) for d in stack.decodes for r in d.requests
                   if r.cache_salt == "fanout")
    assert seeds == [((1, 2), 10), ((1, 2), 11), ((1, 2), 12), ((3, 4), 10), ((3, 4), 11), ((3, 4), 12)]
    assert all(r.sampling.n in (0, 1) for d in stack.decodes for r in d.requests)
    for c in out.choices:
        prompt, seed = ([1, 2], [3, 4])[c.index // 3], 10 + c.index % 3
        assert c.text == "".join(f" t{fake_token(prompt, seed, i)}" for i in range(2))
    assert out.usage.prompt_tokens == 4 and out.usage.completion_tokens == 12  # type: ignore[union-attr]


def test_cached_tokens_is_reported(stack: Stack, client: openai.OpenAI) -> None:
    out = client.completions.create(model="fake-model", prompt=[3] * 40, max_tokens=1, n=2)
    assert out.usage.prompt_tokens_details.cached_tokens == 16  # type: ignore[union-attr]


def test_logprobs_shapes(stack: Stack, client: openai.OpenAI) -> None:
    out = client.completions.create(model="fake-model", prompt=[1, 2], max_tokens=2, logprobs=2)
    lp = out.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == 2 and lp.text_offset == [0, len(lp.tokens[0])]  # type: ignore[arg-type]
    assert len(lp.top_logprobs[0]) == 3  # type: ignore[index]  # two alternatives and the chosen token
    chat = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x"}],
                                          max_tokens=2, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert len(content) == 2 and len(content[0].top_logprobs) == 2  # type: ignore[arg-type]
    assert content[0].bytes == list(content[0].token.encode())  # type: ignore[index]


def test_completion_stream_text_matches(stack: Stack, client: openai.OpenAI) -> None:
    full = client.completions.create(model="fake-model", prompt="Hello there", max_tokens=4, seed=2)
    stream = client.completions.create(model="fake-model", prompt="Hello there", max_tokens=4, seed=2,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream) == full.choices[0].text


def test_models_health_cluster_metrics(stack: Stack, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["fake-model"]
    workers = httpx.get(f"{stack.url}/cluster").json()["workers"]
    by_id = {w["id"]: w for w in workers}
    assert by_id["d0"]["role"] == "decode" and by_id["d0"]["health"] == "healthy"
    assert by_id["d0"]["total_blocks"] == 256 and by_id["d0"]["pid"] == 1234
    assert by_id["p0"]["role"] == "prefill"
    assert by_id[stack.dead]["health"] == "unhealthy"
    for key in ("id", "role", "pid", "grpc_address", "ucx_address", "metrics_url", "health", "running",
                "waiting", "free_blocks", "total_blocks"):
        assert all(key in w for w in workers)
    metrics = httpx.get(f"{stack.url}/metrics").text
    assert 'splitserve_frontend_requests_total{endpoint="completions",status="200"}' in metrics
    assert "splitserve_time_to_first_token_seconds_bucket" in metrics
    assert httpx.get(f"{stack.url}/health").status_code == 200


# -- failures -------------------------------------------------------------------------


def test_retry_once_on_another_decode_worker(stack: Stack, client: openai.OpenAI) -> None:
    d0, d1 = stack.decodes
    d0.fail_salts["flaky"] = grpc.StatusCode.UNAVAILABLE
    report_running(stack.url, d1, 50)  # the router tries d0 first
    try:
        out = client.completions.create(model="fake-model", prompt=[1], max_tokens=2,
                                        extra_body={"cache_salt": "flaky"})
        assert out.choices[0].finish_reason == "length"
        assert [r.cache_salt for r in d0.requests].count("flaky") == 1
        assert [r.cache_salt for r in d1.requests].count("flaky") == 1
        # The retry is another worker request: the failed one may still linger on a prefill worker.
        first, retry = (next(r.request_id for r in d.requests if r.cache_salt == "flaky") for d in (d0, d1))
        assert retry == f"{first}-r1"
        d1.fail_salts["flaky"] = grpc.StatusCode.UNAVAILABLE  # both fail: 503, after one retry
        r = post(stack, "/v1/completions", {"prompt": [1], "max_tokens": 2, "cache_salt": "flaky"})
        assert r.status_code == 503 and r.json()["error"]["message"]
    finally:
        d0.fail_salts.clear()
        d1.fail_salts.clear()
        report_running(stack.url, d1, 0)
    assert 'splitserve_worker_retries_total{reason="unavailable"}' in httpx.get(f"{stack.url}/metrics").text


def test_worker_invalid_argument_is_a_400_without_retry(stack: Stack) -> None:
    for d in stack.decodes:
        d.fail_salts["refused"] = grpc.StatusCode.INVALID_ARGUMENT
    try:
        r = post(stack, "/v1/completions", {"prompt": [1], "max_tokens": 2, "cache_salt": "refused"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        assert sum([r.cache_salt for r in d.requests].count("refused") for d in stack.decodes) == 1
    finally:
        for d in stack.decodes:
            d.fail_salts.clear()


def _cancelled(stack: Stack) -> int:
    return sum(len(d.cancelled) for d in stack.decodes)


def test_client_disconnect_cancels_worker_calls(stack: Stack) -> None:
    body = {"prompt": [1, 2], "max_tokens": 100, "n": 2, "stream": True, "cache_salt": "slow"}
    before = _cancelled(stack)
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=10) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    wait_for(lambda: _cancelled(stack) == before + 2)
    # non-streaming: the client gives up before the answer
    with pytest.raises(httpx.ReadTimeout):
        post(stack, "/v1/completions", {**body, "stream": False, "n": 1}, timeout=0.3)
    wait_for(lambda: _cancelled(stack) == before + 3)


def test_grpc_generate_and_cancel(stack: Stack) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        stub = pb_grpc.FrontendStub(channel)
        req = pb.GenerateRequest(model="fake-model", token_ids=pb.TokenIds(ids=[4, 5]),
                                 sampling=pb.SamplingParams(n=2, max_tokens=3, seed=1))
        msgs = list(stub.Generate(req, timeout=10))
        assert msgs[-1].usage.completion_tokens == 6 and msgs[-1].usage.prompt_tokens == 2
        texts = {i: "".join(m.text for m in msgs if m.index == i and not m.HasField("usage")) for i in (0, 1)}
        assert texts[1] == "".join(f" t{fake_token([4, 5], 2, i)}" for i in range(3))
        before = _cancelled(stack)
        call = stub.Generate(pb.GenerateRequest(text="hi", cache_salt="slow",
                                                sampling=pb.SamplingParams(max_tokens=100)))
        next(call)
        call.cancel()
        wait_for(lambda: _cancelled(stack) == before + 1)


@pytest.mark.parametrize(("body", "status", "param"), [
    (b"{not json", 400, "body"),
    (b"[1, 2]", 400, "body"),
    ({"model": "nope", "prompt": "x"}, 404, "model"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "n": 9}, 400, "n"),
    ({"prompt": "x", "n": "2"}, 400, "n"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": [1] * MAX_MODEL_LEN}, 400, "prompt"),
    ({"prompt": [1, 10**9]}, 400, "prompt"),
    ({"prompt": [1, "a"]}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": "x", "stop": [1]}, 400, "stop"),
    ({"prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"999999": 1}}, 400, "logit_bias"),
    ({"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ({"prompt": "x", "seed": 1.5}, 400, "seed"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "x", "cache_salt": ""}, 400, "cache_salt"),
    ({"prompt": "x", "priority": "high"}, 400, "priority"),
    ({"prompt": "x" * (70 << 10)}, 413, "body"),
])
def test_bad_completion_requests(stack: Stack, body: Any, status: int, param: str) -> None:
    r = post(stack, "/v1/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] and err["type"]


@pytest.mark.parametrize(("body", "param"), [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": MAX_MODEL_LEN},
     "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0]"),
])
def test_bad_chat_requests(stack: Stack, body: dict[str, Any], param: str) -> None:
    r = post(stack, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and param in r.json()["error"]["message"]


def test_unknown_route_is_openai_shaped(stack: Stack) -> None:
    r = httpx.get(f"{stack.url}/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


@pytest.mark.parametrize(("req", "code", "field"), [
    (pb.GenerateRequest(model="nope", text="x"), grpc.StatusCode.NOT_FOUND, "model"),
    (pb.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(n=0)), grpc.StatusCode.INVALID_ARGUMENT, "n"),
    (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(top_p=3)), grpc.StatusCode.INVALID_ARGUMENT,
     "top_p"),
    (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(max_tokens=MAX_MODEL_LEN)),
     grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * MAX_MODEL_LEN)), grpc.StatusCode.INVALID_ARGUMENT,
     "prompt"),
    (pb.GenerateRequest(text="x" * (70 << 10)), grpc.StatusCode.RESOURCE_EXHAUSTED, ""),
])
def test_bad_grpc_requests(stack: Stack, req: pb.GenerateRequest, code: grpc.StatusCode, field: str) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        with pytest.raises(grpc.RpcError) as e:
            list(pb_grpc.FrontendStub(channel).Generate(req, timeout=10))
        assert e.value.code() == code
        assert field in (e.value.details() or "")


def test_still_serving_after_bad_input(stack: Stack, client: openai.OpenAI) -> None:
    out = client.completions.create(model="fake-model", prompt="still here", max_tokens=1)
    assert out.choices[0].finish_reason == "length"
