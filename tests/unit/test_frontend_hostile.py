"""Issue 14 acceptance 1, a hostile client against the whole frontend (REST + gRPC
on one loop) and fake workers in-process: keys, ids, limits checked before work.

The stack runs with two API keys and the default body cap; each attack is
followed by proof that nothing of it reached a worker or a counter."""

from __future__ import annotations

import gc
import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import pb, pb_grpc
from services.frontend.config import FrontendConfig

from .test_frontend_service import Stack, fake_token, tiny_model_dir

KEY_A, KEY_B = "sk-test-alpha-0123456789", "sk-test-bravo-9876543210"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    d = FrontendConfig.__dataclass_fields__
    s = Stack(tiny_model_dir(tmp_path_factory.mktemp("model")), api_keys=(KEY_A, KEY_B), max_choices=16,
              max_requests_per_tenant=1, max_body_bytes=d["max_body_bytes"].default)
    try:
        s.wait_healthy()
        yield s
    finally:
        s.close()


def auth(key: str = KEY_A) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def post(stack: Stack, path: str, body: Any, headers: dict[str, str] | None = None,
         **kw: Any) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{stack.url}{path}", content=data, timeout=kw.pop("timeout", 10),
                      headers={"content-type": "application/json", **auth(), **(headers or {})}, **kw)


def grpc_generate(stack: Stack, req: pb.GenerateRequest,
                  key: str | None = KEY_A) -> list[pb.GenerateResponse]:
    metadata = [("authorization", f"Bearer {key}")] if key else None
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        return list(pb_grpc.FrontendStub(channel).Generate(req, timeout=10, metadata=metadata))


def counters(stack: Stack) -> dict[str, Any]:
    """Everything a request in flight raises, in one snapshot."""
    workers = httpx.get(f"{stack.url}/cluster", headers=auth(), timeout=5).json()["workers"]
    metrics = httpx.get(f"{stack.url}/metrics", headers=auth(), timeout=5).text
    gauges = [line for line in metrics.splitlines()
              if line.startswith(("splitserve_frontend_requests_in_flight",
                                  "splitserve_frontend_requests_waiting"))]
    return {"worker_inflight": {w["id"]: w["inflight"] for w in workers}, "gauges": gauges,
            "worker_calls": sum(len(d.requests) for d in stack.decodes)}


class HealthWatch:
    """Polls /health from another thread while an attack runs; the slowest answer wins."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.slowest = 0.0
        self.answers = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set():
                t = time.monotonic()
                assert client.get(f"{self.url}/health").status_code == 200
                self.slowest = max(self.slowest, time.monotonic() - t)
                self.answers += 1

    def __enter__(self) -> HealthWatch:
        # This process's own collections are no pause of the server's: none while watching.
        self._collecting = gc.isenabled()
        gc.disable()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        if self._collecting:
            gc.enable()

    def assert_answered(self, work_seconds: float) -> None:
        """/health answered all along: within 200 ms (the issue's bound), or within
        a third of the work's time when a busy machine makes that longer (a
        stalled event loop stalls /health for the whole of the work instead)."""
        assert self.answered(work_seconds), (self.answers, self.slowest, work_seconds)

    def answered(self, work_seconds: float) -> bool:
        return self.answers >= 3 and self.slowest < max(0.2, work_seconds / 3)


def answered_throughout(url: str, work: Callable[[], Any], tries: int = 3) -> tuple[Any, HealthWatch]:
    """Runs work while /health is polled, until a try sees /health answered
    all along (HealthWatch.answered), at most `tries`; the last try's result.
    Work on the event loop stalls /health on every try; a pause that is
    neither's (the machine's, or a collection in the server) hits one now
    and then, and only a run of `tries` such pauses in a row fails."""
    for _ in range(tries):
        with HealthWatch(url) as watch:
            t = time.monotonic()
            result = work()
            took = time.monotonic() - t
        if watch.answered(took):
            break
    watch.assert_answered(took)
    return result, watch


# -- keys ----------------------------------------------------------------------------------

ENDPOINTS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
             ("GET", "/v1/nothing"), ("GET", "/metrics"), ("GET", "/cluster"), ("GET", "/openapi.json")]
BAD_CREDENTIALS = [None, "Bearer", "Bearer wrong", f"Basic {KEY_A}", f"Bearer {KEY_A}x",
                   f"Bearer {KEY_A[:-1]}", f"Bearer {KEY_A.upper()}"]
ANY_BODY = b'{"prompt": "hi", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}'


@pytest.mark.parametrize("authorization", BAD_CREDENTIALS)
def test_every_endpoint_but_health_wants_a_key(stack: Stack, authorization: str | None) -> None:
    headers = {"content-type": "application/json"}
    if authorization is not None:
        headers["Authorization"] = authorization
    before = counters(stack)
    for method, path in ENDPOINTS:
        r = httpx.request(method, f"{stack.url}{path}", headers=headers, timeout=10,
                          content=ANY_BODY if method == "POST" else None)
        assert r.status_code == 401, (path, r.status_code, r.text)
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error" and err["message"]
        assert r.headers["www-authenticate"].startswith("Bearer")
    assert httpx.get(f"{stack.url}/health", timeout=10).status_code == 200
    assert counters(stack) == before


def test_the_key_is_checked_before_the_body_is_read(stack: Stack) -> None:
    big = b'{"prompt": "' + b"x" * (8 << 20) + b'"}'  # over the body cap too: 401 wins
    r = httpx.post(f"{stack.url}/v1/completions", content=big, timeout=10)
    assert r.status_code == 401


@pytest.mark.parametrize("key", [None, "wrong", KEY_A + "x"])
def test_grpc_wants_a_key(stack: Stack, key: str | None) -> None:
    before = counters(stack)
    with pytest.raises(grpc.RpcError) as e:
        grpc_generate(stack, pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=1)), key)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert counters(stack) == before
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:  # health stays open
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert check.status == health_pb2.HealthCheckResponse.SERVING


def test_either_key_works_on_rest_and_grpc(stack: Stack) -> None:
    for key in (KEY_A, KEY_B):
        r = post(stack, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2}, auth(key))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        msgs = grpc_generate(stack, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]),
                                                       sampling=pb.SamplingParams(max_tokens=2)), key)
        assert msgs[-1].usage.completion_tokens == 2
    assert httpx.get(f"{stack.url}/v1/models", headers=auth(KEY_B), timeout=10).status_code == 200


def test_the_key_is_the_tenant_not_what_the_client_calls_itself(stack: Stack) -> None:
    """--max-requests-per-tenant 1: another `user` under the same key is the same tenant."""
    slow = {"prompt": [1], "max_tokens": 100, "stream": True, "cache_salt": "slow", "user": "alice"}
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=slow, headers=auth(KEY_A), timeout=10) as r:
        assert r.status_code == 200
        second = post(stack, "/v1/completions", {"prompt": [1], "max_tokens": 1, "user": "bob"}, auth(KEY_A))
        assert second.status_code == 429, second.text
        other = post(stack, "/v1/completions", {"prompt": [1], "max_tokens": 1, "user": "alice"}, auth(KEY_B))
        assert other.status_code == 200


# -- ids -----------------------------------------------------------------------------------


def test_duplicate_grpc_request_ids_both_complete(stack: Stack) -> None:
    """Two clients both sending request_id "1" at once: each gets its own tokens
    back under its own id; the workers saw two different ids, neither of them "1"."""
    prompts = {KEY_A: [4, 5, 6], KEY_B: [7, 8]}

    def run(key: str) -> list[pb.GenerateResponse]:
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompts[key]), request_id="1", cache_salt="slow",
                                 sampling=pb.SamplingParams(max_tokens=6, seed=3))
        return grpc_generate(stack, req, key)

    before = len([r for d in stack.decodes for r in d.requests])
    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(prompts, pool.map(run, prompts), strict=True))
    for name, msgs in results.items():
        assert [t for m in msgs for t in m.token_ids] == [fake_token(prompts[name], 3, i) for i in range(6)]
        assert {m.request_id for m in msgs} == {"1"}
    ids = [r.request_id for d in stack.decodes for r in d.requests][before:]
    assert len(ids) == 2 and len(set(ids)) == 2 and not any(i.startswith("1") for i in ids)


def test_x_request_id_is_echoed_never_used(stack: Stack) -> None:
    body = {"prompt": [3, 3], "max_tokens": 3, "cache_salt": "slow", "seed": 1}
    def call(b: dict[str, Any], key: str) -> httpx.Response:
        return post(stack, "/v1/completions", b, {**auth(key), "X-Request-Id": "mine"})

    with ThreadPoolExecutor(2) as pool:  # two clients (keys), one id
        rs = list(pool.map(call, [body, {**body, "stream": True}], [KEY_A, KEY_B]))
    assert [r.status_code for r in rs] == [200, 200]
    assert all(r.headers["x-request-id"] == "mine" for r in rs)
    assert rs[0].json()["id"].startswith("cmpl-") and rs[0].json()["choices"][0]["text"] == "".join(
        f" t{fake_token([3, 3], 1, i)}" for i in range(3))
    too_long = post(stack, "/v1/completions", body, {"X-Request-Id": "x" * 300})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "X-Request-Id"


# -- limits before work --------------------------------------------------------------------


def timed(fn: Callable[[], httpx.Response]) -> tuple[httpx.Response, float]:
    t = time.monotonic()
    r = fn()
    return r, time.monotonic() - t


def test_ten_thousand_prompts_times_n_128_is_refused_at_once(stack: Stack) -> None:
    before = counters(stack)
    body = {"prompt": [[1, 2, 3]] * 10_000, "n": 128, "max_tokens": 1}
    r, took = timed(lambda: post(stack, "/v1/completions", body))
    assert r.status_code == 400 and took < 1.0, (r.text, took)
    assert r.json()["error"]["param"] in ("prompt", "n")
    r = post(stack, "/v1/completions", {"prompt": [[1, 2]] * 3, "n": 6, "max_tokens": 1})  # 18 > 16 choices
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "n" and "18 choices" in err["message"]
    assert counters(stack) == before


def test_huge_body_and_huge_prompt_are_refused_while_health_answers(stack: Stack) -> None:
    # The bodies are made before the watch starts: client and server share this
    # process (and its GIL), so only the frontend's own work should be timed.
    huge = json.dumps({"prompt": "x " * (8 << 20), "max_tokens": 1}).encode()  # 16 MiB
    prompt = "hello there " * ((1 << 20) // 12)  # 1 MiB: under the body cap, over the prompt's
    chat = {"messages": [{"role": "user", "content": prompt}]}
    bodies = [("/v1/completions", json.dumps({"prompt": prompt, "max_tokens": 1}).encode(), "prompt"),
              ("/v1/chat/completions", json.dumps(chat).encode(), "messages")]
    grpc_request = pb.GenerateRequest(text=prompt, sampling=pb.SamplingParams(max_tokens=1))
    before = counters(stack)
    t = time.monotonic()
    with HealthWatch(stack.url) as watch:
        r, took = timed(lambda: post(stack, "/v1/completions", huge, timeout=30))
        assert r.status_code == 413 and r.json()["error"]["param"] == "body" and took < 5
        for path, body, param in bodies:
            r, took = timed(lambda: post(stack, path, body, timeout=30))  # noqa: B023
            assert r.status_code == 400 and r.json()["error"]["param"] == param and took < 5, r.text
        with pytest.raises(grpc.RpcError) as e:
            grpc_generate(stack, grpc_request)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "prompt.text" in (e.value.details() or "")
    watch.assert_answered(time.monotonic() - t)
    assert counters(stack) == before


@pytest.mark.parametrize("stop", [["z" * 20_000] * 16, ["z"] * 17, "z" * 1025])
def test_huge_stop_strings_are_refused(stack: Stack, stop: Any) -> None:
    before = counters(stack)
    r = post(stack, "/v1/completions", {"prompt": [1], "max_tokens": 1, "stop": stop})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text
    with pytest.raises(grpc.RpcError) as e:
        stops = [stop] if isinstance(stop, str) else stop
        sampling = pb.SamplingParams(max_tokens=1, stop=stops)
        grpc_generate(stack, pb.GenerateRequest(text="hi", sampling=sampling))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stop" in (e.value.details() or "")
    assert counters(stack) == before


BIG = 2**40
OUT_OF_RANGE = [
    ("/v1/completions", {"priority": 2**31}, "priority"),
    ("/v1/completions", {"priority": -(2**31) - 1}, "priority"),
    ("/v1/completions", {"seed": 2**63}, "seed"), ("/v1/completions", {"seed": -(2**63) - 1}, "seed"),
    ("/v1/completions", {"seed": 2**63 - 1, "n": 2}, "seed"),  # choice 1 samples with seed + 1
    ("/v1/completions", {"top_k": BIG}, "top_k"), ("/v1/completions", {"top_k": -2}, "top_k"),
    ("/v1/completions", {"min_tokens": BIG}, "min_tokens"),
    ("/v1/completions", {"min_tokens": 200}, "min_tokens"),  # more than the context leaves
    ("/v1/completions", {"stop_token_ids": [BIG]}, "stop_token_ids"),
    ("/v1/completions", {"stop_token_ids": [1000]}, "stop_token_ids"),  # the vocabulary is 1000
    ("/v1/completions", {"logit_bias": {str(BIG): 1}}, "logit_bias"),
    ("/v1/completions", {"n": BIG}, "n"), ("/v1/completions", {"max_tokens": BIG}, "max_tokens"),
    ("/v1/completions", {"logprobs": BIG}, "logprobs"), ("/v1/completions", {"best_of": BIG}, "best_of"),
    ("/v1/completions", {"prompt": [BIG]}, "prompt"),
    ("/v1/chat/completions", {"top_logprobs": BIG, "logprobs": True}, "top_logprobs"),
    ("/v1/chat/completions", {"max_completion_tokens": BIG}, "max_completion_tokens"),
    ("/v1/chat/completions", {"priority": BIG}, "priority"),
]


@pytest.mark.parametrize(("path", "fields", "param"), OUT_OF_RANGE)
def test_out_of_range_integers_are_400_and_touch_no_counter(stack: Stack, path: str, fields: dict[str, Any],
                                                            param: str) -> None:
    before = counters(stack)
    body = {"prompt": [1, 2], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
    r = post(stack, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and param in r.json()["error"]["message"]
    assert counters(stack) == before


@pytest.mark.parametrize(("sampling", "field"), [
    (pb.SamplingParams(seed=2**63 - 1, n=2), "seed"), (pb.SamplingParams(top_k=-5), "top_k"),
    (pb.SamplingParams(min_tokens=2**31 - 1), "min_tokens"), (pb.SamplingParams(stop_token_ids=[5000]),
                                                               "stop_token_ids"),
    (pb.SamplingParams(max_tokens=2**31 - 1), "max_tokens"), (pb.SamplingParams(n=2**31 - 1), "n"),
])
def test_out_of_range_grpc_fields(stack: Stack, sampling: pb.SamplingParams, field: str) -> None:
    before = counters(stack)
    with pytest.raises(grpc.RpcError) as e:
        grpc_generate(stack, pb.GenerateRequest(text="hi", sampling=sampling))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in (e.value.details() or "")
    assert counters(stack) == before


def test_still_serving_after_the_attacks(stack: Stack) -> None:
    r = post(stack, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
