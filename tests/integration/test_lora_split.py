"""LoRA across the split, end to end on the real SmolLM2 model: a prefill and
a decode worker with LoRA on and a frontend serving a random adapter made in
the test (--lora-modules) give the colocated engine's greedy tokens with that
adapter (prefilled on the prefill worker: the adapter travelled there, and on
the decode worker), the base model's output is unchanged by the adapter, and
adapters load and unload through the API while requests run, losing none."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest

from protos import pb, pb_grpc
from tests.integration.procs import address, free_port, peer_flag, start_worker, wait_until
from tests.integration.test_frontend import LONG, SHORT, THRESHOLD, Frontend, workers
from tests.integration.test_lora import make_adapter

MODEL = "SmolLM2-135M-Instruct"
NEW_TOKENS = 16
LORA_FLAGS = ["--enable-lora", "--max-loras", "2"]
# Big enough to change SmolLM2's greedy output, small enough to keep it text.
ADAPTERS: dict[str, dict[str, Any]] = {
    "a1": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]),
    "a2": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj", "gate_proj"]),
}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, model_dir) -> dict[str, Path]:  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter(model_dir, root / name, i, std=0.05, **cfg)
            for i, (name, cfg) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, adapters) -> Iterator[Frontend]:  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("lora_split")
    p_port, d_port = free_port(), free_port()
    p0 = start_worker("prefill", "p0", tmp, "--num-blocks", "256", "--grpc-port", str(p_port),
                      *LORA_FLAGS, "--max-lora-rank", "8", *peer_flag("prefill", [address(d_port)]))
    d0 = start_worker("decode", "d0", tmp, "--num-blocks", "256", "--local-prefill-threshold", str(THRESHOLD),
                      "--grpc-port", str(d_port), *LORA_FLAGS, "--max-lora-rank", "8",
                      *peer_flag("decode", [address(p_port)]))
    fe = None
    try:
        fe = Frontend(tmp, d0.wait_ready(), p0.wait_ready(), *LORA_FLAGS,
                      "--lora-modules", f"a1={adapters['a1']}")
        fe.wait_healthy()
        yield fe
    finally:
        if fe is not None:
            fe.stop()
        for p in (d0, p0):
            p.stop()


@dataclass(frozen=True)
class Ref:
    prompt: list[int]
    tokens: list[int]
    text: str


@pytest.fixture(scope="module")
def reference(adapters) -> dict[tuple[str, str], Ref]:  # type: ignore[no-untyped-def]
    """The colocated engine's greedy output per (model, conversation)."""
    from engine import LLM, LoRARequest, SamplingParams

    llm = LLM(dtype="float32", num_blocks=128, num_threads=1, max_model_len=1024, enable_lora=True,
              max_loras=2, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    out: dict[tuple[str, str], Ref] = {}
    for model in (MODEL, *adapters):
        lora = None if model == MODEL else LoRARequest(model, str(adapters[model]))
        for name, conv in (("short", SHORT), ("long", LONG)):
            ids = llm.apply_chat_template(conv)
            done = llm.generate(ids, params, lora_request=lora)[0].outputs[0]
            out[model, name] = Ref(ids, done.token_ids, done.text)
    return out


def grpc_tokens(fe: Frontend, model: str, prompt: list[int]) -> list[int]:
    with grpc.insecure_channel(f"127.0.0.1:{fe.grpc_port}") as ch:
        msgs = list(pb_grpc.FrontendStub(ch).Generate(pb.GenerateRequest(
            model=model, token_ids=pb.TokenIds(ids=prompt),
            sampling=pb.SamplingParams(temperature=0, max_tokens=NEW_TOKENS)), timeout=120))
    return [t for m in msgs for t in m.token_ids]


def load(url: str, name: str, path: Path) -> httpx.Response:
    return httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                      timeout=30)


def unload(url: str, name: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=30)


def remote_prefills(fe: Frontend) -> float:
    return float(workers(fe)["d0"]["counters"]["remote_prefills"])


def test_models_lists_the_adapters(stack) -> None:  # type: ignore[no-untyped-def]
    cards = httpx.get(f"{stack.url}/v1/models", timeout=10).json()["data"]
    assert [c["id"] for c in cards] == [MODEL, "a1"]
    assert cards[1]["parent"] == MODEL
    assert httpx.get(f"{stack.url}/v1/models/a1", timeout=10).json()["id"] == "a1"
    r = httpx.post(f"{stack.url}/v1/completions", json={"model": "nope", "prompt": "hi"}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_split_with_adapter_equals_colocated(stack, reference) -> None:  # type: ignore[no-untyped-def]
    assert reference["a1", "long"].tokens != reference[MODEL, "long"].tokens  # the adapter matters
    for name in ("long", "short"):
        prompt = reference[MODEL, name].prompt
        assert (len(prompt) >= THRESHOLD) == (name == "long")
        before = remote_prefills(stack)
        assert grpc_tokens(stack, "a1", prompt) == reference["a1", name].tokens, name
        # The base model, with the adapter loaded on every worker, is unchanged.
        assert grpc_tokens(stack, MODEL, prompt) == reference[MODEL, name].tokens, name
        if name == "long":  # both went through the prefill worker (counted in d0's next load report)
            wait_until(lambda want=before + 2: remote_prefills(stack) >= want, 10,
                       "d0's load reports never counted both remote prefills")


def test_load_unload_while_requests_run(stack, reference, adapters) -> None:  # type: ignore[no-untyped-def]
    url = stack.url
    r = load(url, "a2", adapters["a2"])
    assert r.status_code == 200, r.text
    assert [c["id"] for c in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]] == [MODEL, "a1", "a2"]
    again = load(url, "a2", adapters["a2"])
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    texts: dict[str, str] = {}
    started = threading.Event()

    def run(model: str) -> None:
        stream = client.chat.completions.create(model=model, messages=LONG, temperature=0,  # type: ignore[arg-type]
                                                max_tokens=NEW_TOKENS, stream=True)
        parts = []
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
                if model == "a2":
                    started.set()
        texts[model] = "".join(parts)

    threads = [threading.Thread(target=run, args=(m,)) for m in (MODEL, "a1", "a2")]
    for t in threads:
        t.start()
    assert started.wait(120), "the a2 stream sent nothing"
    # Mid-stream: a2 goes away (its stream finishes with it), a1 comes back under another name.
    assert unload(url, "a2").status_code == 200
    r = load(url, "a1-again", adapters["a1"])
    assert r.status_code == 200, r.text
    for t in threads:
        t.join(180)
    for model in (MODEL, "a1", "a2"):
        assert texts.get(model) == reference[model, "long"].text, model
    assert grpc_tokens(stack, "a1-again", reference[MODEL, "long"].prompt) == reference["a1", "long"].tokens
    gone = httpx.post(f"{url}/v1/completions", json={"model": "a2", "prompt": "hi"}, timeout=10)
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "model"
    r = unload(url, "a2")
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"
    full = load(url, "a3", adapters["a2"])  # a1 and a1-again: --max-loras 2 is reached
    assert full.status_code == 400 and "max-loras" in full.json()["error"]["message"]
    assert unload(url, "a1-again").status_code == 200
    r = load(url, "bad", Path("/nonexistent"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
