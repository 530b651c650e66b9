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

from .test_prefill_bf16 import BF16_CPU

needs_bf16 = pytest.mark.skipif(not BF16_CPU, reason="this CPU lacks AVX512-BF16 (lscpu: no avx512_bf16), "
                                                     "which a bfloat16 model's packed kernels need")

PROMPTS = ["The capital of France is", "def fib(n):\n    ", "Once upon a time, in a land far away, a"]


def _generate(llm: LLM) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0, logprobs=1))
    return [(o.outputs[0].token_ids,
             [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)])
            for o in outs]


@needs_bf16
def test_bf16_model_holds_bf16_panels_only_and_computes_as_float32_with_bf16_options() -> None:
    bf = LLM(dtype="bfloat16", num_blocks=96, num_threads=1)
    runner = bf.engine.runner
    assert runner.bf16_weights_model
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
    got, want = _generate(bf), _generate(f32)
    for (tokens, lps), (ref_tokens, ref_lps) in zip(got, want, strict=True):
        assert tokens == ref_tokens
        assert lps[1:] == ref_lps[1:]  # every decode the same bits
        # the first token's logits: the head on bfloat16 panels here, float32 there
        assert abs(lps[0] - ref_lps[0]) < 0.05
