"""A bfloat16 model on a CPU whose packed kernels run bfloat16 (AVX512-BF16 or
AMX; model_runner.packed_bf16): its weights held as bfloat16 panels only (and
a layer's 4-bit blocks, read for few rows with the same bits), every token
through them, activations and sums in float32.  Each token is then computed
exactly as a float32 model computes it under --prefill-dtype bfloat16
--decode-dtype bfloat16-weights with a bfloat16 KV cache, but for the head's
logits of a prompt's last token (bfloat16 panels, not float32)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers.packed_linear import PackedLinear

from .procs import start_pair, stop_all
from .test_prefill_bf16 import BF16_CPU, _tokens_and_logprobs
from .test_workers import generate

needs_bf16 = pytest.mark.skipif(not BF16_CPU, reason="this CPU lacks AVX512-BF16 (lscpu: no avx512_bf16), "
                                                     "which a bfloat16 model's packed kernels need")

PROMPTS = ["The capital of France is", "def fib(n):\n    ", "Once upon a time, in a land far away, a"]


def _generate(llm: LLM, prompts: list[str]) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, logprobs=1))
    return [_tokens_and_logprobs(o) for o in outs]


@needs_bf16
def test_bf16_model_holds_bf16_panels_only_and_computes_as_float32_with_bf16_options() -> None:
    bf = LLM(dtype="bfloat16", num_blocks=96, num_threads=1)
    runner = bf.engine.runner
    assert runner.bf16_weights_model
    assert (runner.model_dtype, runner.dtype) == (torch.bfloat16, torch.float32)  # weights, activations
    assert (runner.prefill_dtype, runner.decode_dtype, runner.kv_cache.dtype) == (
        "bfloat16", "bfloat16-weights", torch.bfloat16)
    for path in runner.model.linear_names():
        layer = runner.model.get_submodule(path)
        assert isinstance(layer, PackedLinear), path
        # every row on the bfloat16 panels (the head's prompt rows too): no float32 copy held
        assert layer.bf16 is not None and layer.panels is None and layer._one_path, path
    f32 = LLM(dtype="float32", num_blocks=96, num_threads=1, prefill_dtype="bfloat16",
              decode_dtype="bfloat16-weights", kv_cache_dtype="bfloat16")
    assert bf.engine.kv_layout == f32.engine.kv_layout  # the same prompt blocks: pairs with such a worker
    # the head's weight is the float32 one rounded to bfloat16, read back from its panels
    head, ref = runner.model.lm_head, f32.engine.runner.model.lm_head
    assert ref.panels is not None  # there the head's prompt rows stay float32
    assert torch.equal(head.weight(), ref.weight().bfloat16().float())
    got, want = _generate(bf, PROMPTS), _generate(f32, PROMPTS)
    for (tokens, lps), (ref_tokens, ref_lps) in zip(got, want, strict=True):
        assert tokens == ref_tokens
        assert lps[1:] == ref_lps[1:]  # every decode the same bits
        # the first token's logits: the head on bfloat16 panels here, float32 there
        assert 0 < abs(lps[0] - ref_lps[0]) < 0.05
    # a prompt alone gives what it gave among the others: a row's result never depends on its batch
    assert [_generate(bf, [p])[0] for p in PROMPTS] == got


@pytest.fixture(scope="module")
def pair(tmp_path_factory):  # type: ignore[no-untyped-def]
    """A prefill worker of a bfloat16 model and a decode worker of a float32
    model whose tokens all run in bfloat16 (every prompt sent to the prefill worker)."""
    if not BF16_CPU:
        pytest.skip("this CPU lacks AVX512-BF16 (lscpu: no avx512_bf16), which a bfloat16 model's "
                    "packed kernels need")
    p, d = start_pair(tmp_path_factory.mktemp("bf16-model"), ["--num-blocks", "64", "--dtype", "bfloat16"],
                      ["--num-blocks", "64", "--dtype", "float32", "--prefill-dtype", "bfloat16",
                       "--decode-dtype", "bfloat16-weights", "--kv-cache-dtype", "bfloat16",
                       "--local-prefill-threshold", "1"])
    try:
        yield p, d
    finally:
        stop_all([p, d])


def test_split_with_a_float32_decode_worker_equals_one_bf16_engine(pair) -> None:  # type: ignore[no-untyped-def]
    """The two kinds of worker compute a prompt's blocks alike, so their layouts
    pair; the prefill worker samples the first token (its bfloat16 head), the
    decode worker the rest as the bfloat16 model does."""
    p, d = pair
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    one = LLM(dtype="bfloat16", num_blocks=64, num_threads=1, max_model_len=1024)
    ids = one.tokenizer.encode(PROMPTS[2])
    chunks = generate(d.address, p.address, "bf16-split", ids, params)
    assert chunks[0].remote_prefill and chunks[0].cached_tokens == 0
    assert [t for c in chunks for t in c.token_ids] == one.generate(ids, params)[0].outputs[0].token_ids
