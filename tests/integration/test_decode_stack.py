"""The decode stack (engine/models/decode_stack.py, csrc/decode_stack.cpp):
a step of generated tokens runs every layer in one kernel call.  On the real
model, on every decode path this CPU has and with float32, float16 and fp8
caches, it gives the Python layer loop's logits bit for bit, batched, and it
is what ran those steps (no layer's Python forward did); steps with prompt
tokens keep the loop; a model the stack does not cover keeps it too."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers.cpu_attention import load_cpu_kernel
from engine.models import decode_stack
from engine.models.llama import LlamaLayer
from tests.unit.test_linear_q4bf16 import needs_cpu as needs_q4bf16

from .test_decode_quantized import needs_bf16
from .test_hf_parity import LogitRecorder

PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,",
           "A list of the planets, in order from the sun:"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# (decode_dtype, prefill_dtype, kv_cache_dtype): each decode path (the exact
# 4- and 8-bit blocks and float32 panels; int8; bfloat16 inputs; bfloat16
# panels, prompt rows on them too) and each kind of cache.
CASES = [("auto", "auto", "auto"), ("int8", "auto", "fp8_e4m3"),
         pytest.param("bfloat16", "auto", "float16", marks=needs_q4bf16),
         pytest.param("bfloat16-weights", "bfloat16", "bfloat16", marks=needs_bf16),
         pytest.param("bfloat16-weights", "bfloat16", "fp8_e4m3", marks=needs_bf16)]


@contextmanager
def counting() -> Iterator[dict[str, int]]:
    """Counts the stack's steps and the Python loop's layer calls by the rows they ran."""
    counts = {"stack": 0, "layer_decode_rows": 0, "layer_calls": 0}
    stack_forward, layer_forward = decode_stack.DecodeStack.forward, LlamaLayer.forward

    def stack(self, x, *args, **kwargs):  # type: ignore[no-untyped-def]
        counts["stack"] += 1
        return stack_forward(self, x, *args, **kwargs)

    def layer(self, x, cos, sin, kv_cache, meta, attn):  # type: ignore[no-untyped-def]
        counts["layer_calls"] += 1
        counts["layer_decode_rows"] += meta.num_decodes
        return layer_forward(self, x, cos, sin, kv_cache, meta, attn)

    decode_stack.DecodeStack.forward = stack  # type: ignore[method-assign]
    LlamaLayer.forward = layer  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        decode_stack.DecodeStack.forward = stack_forward  # type: ignore[method-assign]
        LlamaLayer.forward = layer_forward  # type: ignore[method-assign]


def run(llm: LLM, rec: LogitRecorder, prompts: list[str] | list[list[int]] = PROMPTS,
        ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens of the prompts, batched, and each one's logits of every step (rec: llm's recorder)."""
    outs = llm.generate(prompts, GREEDY)
    return ([o.outputs[0].token_ids for o in outs],
            [torch.stack(rec.logits[f"{o.request_id}-0"]) for o in outs])


def use_stack(llm: LLM, on: bool) -> None:
    """The stack built again at the next decode step (on), or the loop for every step."""
    model = llm.engine.runner.model
    model._layers_changed()
    model._decode_stack_built = not on


def assert_same_steps(stacked: list[torch.Tensor], looped: list[torch.Tensor], what: str) -> None:
    """Per prompt, every step's logits bit for bit."""
    assert len(stacked) == len(looped)
    for i, (a, b) in enumerate(zip(stacked, looped, strict=True)):
        assert torch.equal(a, b), f"{what}, prompt {i}: the stack's logits differ from the loop's"


@pytest.mark.parametrize(("decodes", "prefill", "kv"), CASES)
def test_the_stack_gives_the_layer_loops_logits(decodes: str, prefill: str, kv: str) -> None:
    llm = LLM(dtype="float32", num_blocks=64, max_model_len=256, num_threads=2, enable_prefix_caching=False,
              decode_dtype=decodes, prefill_dtype=prefill, kv_cache_dtype=kv)
    rec = LogitRecorder(llm)
    # bfloat16 decodes (with bfloat16 prompts) attend in bfloat16 on both paths, where the kernel can.
    attention = load_cpu_kernel()
    can = attention is not None and attention.decode_bf16_supported() and prefill == "bfloat16"
    assert llm.engine.runner.bf16_decode_attention == (decodes in ("bfloat16", "bfloat16-weights") and can)
    with counting() as on:
        tokens, logits = run(llm, rec)
    layers = len(llm.engine.runner.model.layers)
    # Every step after the prompts' is generated tokens alone: the stack ran them, no layer loop did.
    assert on["stack"] == GREEDY.max_tokens - 1
    assert on["layer_decode_rows"] == 0 and on["layer_calls"] == layers  # the prompts' step
    use_stack(llm, False)
    with counting() as off:
        tokens_loop, logits_loop = run(llm, rec)
    assert off["stack"] == 0 and off["layer_decode_rows"] == layers * len(PROMPTS) * (GREEDY.max_tokens - 1)
    assert tokens == tokens_loop
    assert_same_steps(logits, logits_loop, f"{decodes}, {kv} cache")


def test_steps_with_prompt_tokens_keep_the_loop() -> None:
    """A prompt chunk beside running decodes: the loop runs that step (rows of both kinds)."""
    llm = LLM(dtype="float32", num_blocks=64, max_model_len=256, num_threads=2, enable_prefix_caching=False,
              max_num_batched_tokens=16)
    long_prompt = " ".join(["the harbour wall"] * 20)
    with counting() as counts:
        llm.generate(["Hi there", long_prompt], GREEDY)
    assert counts["layer_decode_rows"] > 0  # a step mixed the first request's decodes with prompt chunks
    assert counts["stack"] > 0


def test_a_model_the_stack_does_not_cover_keeps_the_loop() -> None:
    """A layer's projection swapped for one that is not packed (as a LoRA wrapper
    is): the stack is built again, finds it, and the loop runs every step."""
    llm = LLM(dtype="float32", num_blocks=64, max_model_len=256, num_threads=2, enable_prefix_caching=False)
    model = llm.engine.runner.model
    tokens, _ = run(llm, LogitRecorder(llm))
    assert model._decode_stack is not None
    layer = model.layers[3]

    class Wrapped(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner.forward(x)

    layer.o_proj = Wrapped(layer.o_proj)
    with counting() as counts:
        wrapped_tokens, _ = run(llm, LogitRecorder(llm))
    assert counts["stack"] == 0 and counts["layer_decode_rows"] > 0
    assert model._decode_stack is None
    assert wrapped_tokens == tokens



@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "qwen3_bias", "mistral_window"])
def test_the_stack_covers_biases_head_norms_and_windows(kind, tmp_path, model_dir) -> None:  # type: ignore[no-untyped-def]
    """Tiny random models of the families whose layers differ from SmolLM2's
    (qkv biases, every projection biased, per-head q and k norms, a sliding
    window shorter than the prompt): the stack runs their decode steps and
    gives the loop's logits bit for bit."""
    from .test_model_families import make_model

    llm = LLM(model=str(make_model(kind, tmp_path / kind, model_dir)), dtype="float32", num_blocks=64,
              num_threads=2, enable_prefix_caching=False)
    prompts = [list(range(1000, 1090)), list(range(2000, 2030))]  # 90 tokens: past mistral_window's 24
    rec = LogitRecorder(llm)
    with counting() as on:
        tokens, logits = run(llm, rec, prompts)
    assert on["stack"] == GREEDY.max_tokens - 1 and on["layer_decode_rows"] == 0
    use_stack(llm, False)
    with counting() as off:
        tokens_loop, logits_loop = run(llm, rec, prompts)
    assert off["stack"] == 0
    assert tokens == tokens_loop
    assert_same_steps(logits, logits_loop, kind)
