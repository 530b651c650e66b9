"""The smaller OpenAI / vLLM surfaces, over the frontend with fake workers:
GET /v1/models/{id}, /tokenize and /detokenize in vLLM's shapes, and echo."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.unit.test_frontend_service import Stack, client, post, sse_events, stack  # noqa: F401


def test_models_retrieve(stack: Stack, client: openai.OpenAI) -> None:  # noqa: F811
    card = client.models.retrieve("fake-model")
    assert card.id == "fake-model" and card.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("other-model")
    assert isinstance(e.value.body, dict) and e.value.body["code"] == "model_not_found"


def test_tokenize_and_detokenize(stack: Stack) -> None:  # noqa: F811
    r = post(stack, "/tokenize", {"model": "fake-model", "prompt": "Hello there x",
                                  "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == [6, 7, 9] and body["count"] == 3
    assert body["token_strs"] == ["Hello", "there", "x"]
    assert body["max_model_len"] == httpx.get(f"{stack.url}/v1/models").json()["data"][0]["max_model_len"]
    chat = post(stack, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    # "<user> hi <assistant>" with one token per word (and < >)
    assert chat["tokens"] == [1, 3, 2, 8, 1, 4, 2] and chat["token_strs"] is None
    r = post(stack, "/detokenize", {"tokens": [6, 7]})
    assert r.status_code == 200 and r.json() == {"prompt": "Hello there"}
    for path, body, param in (("/tokenize", {"prompt": "x", "messages": []}, "prompt"),
                              ("/detokenize", {"tokens": [5000]}, "tokens"),
                              ("/detokenize", {"tokens": "x"}, "tokens"),
                              ("/tokenize", {"prompt": "x", "model": "other"}, "model")):
        r = post(stack, path, body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, (path, r.text)


def test_echo_puts_the_prompt_first(stack: Stack, client: openai.OpenAI) -> None:  # noqa: F811
    plain = client.completions.create(model="fake-model", prompt="Hello there", max_tokens=3, seed=1)
    echoed = client.completions.create(model="fake-model", prompt="Hello there", max_tokens=3, seed=1,
                                       echo=True)
    assert echoed.choices[0].text == "Hello there" + plain.choices[0].text
    ids = client.completions.create(model="fake-model", prompt=[6, 7], max_tokens=2, echo=True)
    assert ids.choices[0].text.startswith("Hello there")
    r = post(stack, "/v1/completions", {"prompt": "Hello there", "max_tokens": 3, "seed": 1, "echo": True,
                                        "stream": True})
    text = "".join(e["choices"][0]["text"] for e in sse_events(r.text) if e != "[DONE]" and e["choices"])
    assert text == echoed.choices[0].text
    r = post(stack, "/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
