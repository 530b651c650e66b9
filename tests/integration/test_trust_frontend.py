"""Issue 14 over real processes: a frontend with two API keys and
--cache-isolation tenant in front of a real prefill and decode worker.

Acceptance 4 (two keys sending one long prompt: the second sees no cached
tokens, the same key sees its hit) and the parts of acceptance 1 that need the
real model: duplicate client request ids on real workers, and a 1 MiB prompt
tokenized while /health keeps answering."""

from __future__ import annotations

import concurrent.futures
import json
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest

from protos import pb, pb_grpc
from tests.unit.test_frontend_hostile import answered_throughout

from .procs import start_pair
from .test_frontend import Frontend

KEY_A, KEY_B = "sk-integration-a", "sk-integration-b"
# Long enough for several full blocks.
LONG = ("Write a ship's log for a lighthouse keeper who counts the storms of one winter, "
        "the supply boats that came and the ones that did not, in plain short entries. ") * 3


@pytest.fixture(scope="module")
def fe(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Frontend]:
    tmp = tmp_path_factory.mktemp("trust")
    p0, d0 = start_pair(tmp, ["--num-blocks", "256"],
                        ["--num-blocks", "256", "--local-prefill-threshold", "64"])
    frontend = None
    try:
        # Prompts may run to 4 MiB of characters here, so that a huge one is really tokenized.
        frontend = Frontend(tmp, d0.wait_ready(), p0.wait_ready(), "--api-key", KEY_A, "--api-key", KEY_B,
                            "--cache-isolation", "tenant", "--max-prompt-chars", str(4 << 20))
        frontend.wait_healthy()
        yield frontend
    finally:
        if frontend is not None:
            frontend.stop()
        for p in (d0, p0):
            p.stop()


def complete(fe: Frontend, key: str | None, **body: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{fe.url}/v1/completions", json={"max_tokens": 1, **body}, headers=headers,
                      timeout=120)


def test_no_key_no_service(fe: Frontend) -> None:
    assert complete(fe, None, prompt="Hi").status_code == 401
    assert complete(fe, "sk-integration-c", prompt="Hi").status_code == 401
    assert httpx.get(f"{fe.url}/cluster", timeout=10).status_code == 401
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):  # adapters change behind the key
        body = {"lora_name": "x", "lora_path": "/x"}
        assert httpx.post(f"{fe.url}{path}", json=body, timeout=10).status_code == 401
        keyed = httpx.post(f"{fe.url}{path}", json=body, headers={"Authorization": f"Bearer {KEY_A}"},
                           timeout=10)
        assert keyed.status_code == 400 and keyed.json()["error"]["param"] == "lora_name"  # LoRA is off
    with grpc.insecure_channel(f"127.0.0.1:{fe.grpc_port}") as ch, pytest.raises(grpc.RpcError) as e:
        list(pb_grpc.FrontendStub(ch).Generate(pb.GenerateRequest(text="Hi"), timeout=30))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert complete(fe, KEY_A, prompt="Hi").status_code == 200


def test_tenants_never_share_prefix_blocks(fe: Frontend) -> None:
    prompt = f"Log {uuid.uuid4().hex[:8]}. {LONG}"  # a prefix no run has cached yet

    def cached(key: str) -> int:
        r = complete(fe, key, prompt=prompt, temperature=0)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] >= 64  # several blocks, prefilled remotely
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert cached(KEY_A) == 0
    assert cached(KEY_B) == 0  # the same prompt, another key: nothing to learn from the cache
    assert cached(KEY_A) >= 16  # the first key's own blocks are still there for it
    assert cached(KEY_B) >= 16


def _greedy(fe: Frontend, key: str, text: str, request_id: str = "") -> tuple[list[int], set[str]]:
    req = pb.GenerateRequest(text=text, request_id=request_id,
                             sampling=pb.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    with grpc.insecure_channel(f"127.0.0.1:{fe.grpc_port}") as ch:
        msgs = list(pb_grpc.FrontendStub(ch).Generate(req, timeout=120,
                                                      metadata=[("authorization", f"Bearer {key}")]))
    return [t for m in msgs for t in m.token_ids], {m.request_id for m in msgs}


def test_two_clients_with_one_request_id_both_get_their_tokens(fe: Frontend) -> None:
    texts = {KEY_A: "The capital of France is", KEY_B: "Once upon a time, in a small village,"}
    alone = {key: _greedy(fe, key, text)[0] for key, text in texts.items()}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        together = dict(zip(texts, pool.map(lambda k: _greedy(fe, k, texts[k], "1"), texts), strict=True))
    for key in texts:
        tokens, ids = together[key]
        assert tokens == alone[key] and len(tokens) == 16
        assert ids == {"1"}  # echoed back; the workers saw the frontend's own ids


def test_a_huge_prompt_is_tokenized_off_the_event_loop(fe: Frontend) -> None:
    """3 MiB of text (far more tokens than the context holds, which only
    tokenizing can tell: most of a second's work) while another client polls
    /health, which a stalled event loop would keep waiting all that time."""
    prompt = "hello world " * ((3 << 20) // 12)
    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 1}
    for path, body, param in (("/v1/completions", {"prompt": prompt, "max_tokens": 1}, "prompt"),
                              ("/v1/chat/completions", chat, "messages")):
        data = json.dumps(body).encode()  # made before the watch: only the frontend's work is timed

        def send(data: bytes = data, path: str = path) -> httpx.Response:
            headers = {"Authorization": f"Bearer {KEY_A}", "content-type": "application/json"}
            return httpx.post(f"{fe.url}{path}", content=data, headers=headers, timeout=120)

        r, watch = answered_throughout(fe.url, send)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert r.json()["error"]["code"] == "context_length_exceeded"  # known only once tokenized
        print(f"{path}: 3 MiB prompt refused; /health slowest {1000 * watch.slowest:.0f} ms "
              f"of {watch.answers}")
