"""--decode-dtype int8, bfloat16 and bfloat16-weights on the real model:
generated tokens through the 4-bit layers with x quantized to int8 (or
rounded to bfloat16), or through bfloat16 panels of every projection and the
head, prompt tokens exact.  A request's tokens and logprobs do not depend on the
batch around it or on a prefix-cache hit (a chat's next turn included, whose
prompt holds tokens generated before); the path was taken (they differ from
the float32 engine's); speculative decoding gives the tokens decoding one at
a time gives; a split pair (its decode worker int8 or bfloat16) equals one
engine; where the option cannot run it is refused at start-up, naming it.
Under bfloat16-weights plain greedy rows take their tokens from the head's
own argmax, the tokens sampling gives."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.layers.cpu_attention import load_cpu_kernel
from tests.unit.test_linear_q4bf16 import Q4BF16_CPU
from tests.unit.test_linear_q4bf16 import needs_cpu as needs_q4bf16

from .procs import start_pair, stop_all
from .test_prefill_bf16 import BF16_CPU
from .test_workers import generate

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
PROMPT = "A long note on the harbour: the tides, the moon, the boats and the people who mend the nets. " * 5
OTHERS = ["Short one.", "Another prompt, somewhat longer than the first, about trains and timetables " * 2]
# bfloat16 decodes: AVX512-BF16 and VBMI (q4bf16_linear)
# bfloat16-weights: AVX512-BF16 (bf16_linear)
needs_bf16 = pytest.mark.skipif(not BF16_CPU, reason="this CPU lacks AVX512-BF16 (lscpu: no avx512_bf16), "
                                                     "which --decode-dtype bfloat16-weights needs")
DECODES = ["int8", pytest.param("bfloat16", marks=needs_q4bf16),
           pytest.param("bfloat16-weights", marks=needs_bf16)]
# The flag each decode path sets on a packed layer that takes it.
PATH_FLAG = {"int8": "int8", "bfloat16": "bf16_decodes", "bfloat16-weights": "bf16_weights"}


def _tokens_and_logprobs(out) -> tuple[list[int], list[float]]:  # type: ignore[no-untyped-def]
    c = out.outputs[0]
    return c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)]


def _llm(decode_dtype: str, cache: bool = True, **kw) -> LLM:  # type: ignore[no-untyped-def]
    # Chunks of 48 tokens: the prompt spans several steps, beside other requests' decodes.
    return LLM(dtype="float32", num_blocks=96, num_threads=1, max_model_len=1024, max_num_batched_tokens=48,
               decode_dtype=decode_dtype, enable_prefix_caching=cache, **kw)


@pytest.mark.parametrize("decodes", ["int8", "bfloat16", "bfloat16-weights"])
def test_refused_where_it_cannot_run(decodes: str) -> None:
    for dtype in ("float16", "bfloat16"):
        if dtype == "bfloat16" and BF16_CPU and (decodes == "bfloat16-weights" or
                                                 decodes == "bfloat16" and Q4BF16_CPU):
            # a bfloat16 model on the packed kernels runs its decodes so (the default here or not): taken
            assert LLM(dtype=dtype, num_blocks=16, num_threads=1, decode_dtype=decodes).engine.runner \
                .decode_dtype == decodes
            continue
        with pytest.raises(ValueError, match=f"decode_dtype: {decodes} needs a float32 model on a CPU"):
            LLM(dtype=dtype, num_blocks=16, num_threads=1, decode_dtype=decodes)
    if decodes == "bfloat16" and not Q4BF16_CPU:  # a float32 model, on a CPU without the instructions
        with pytest.raises(ValueError, match="AVX512-BF16 and AVX512-VBMI .*the CPU without them"):
            LLM(dtype="float32", num_blocks=16, num_threads=1, decode_dtype=decodes)
    if decodes == "bfloat16-weights" and not BF16_CPU:
        with pytest.raises(ValueError, match="AVX512-BF16 .*the CPU without it"):
            LLM(dtype="float32", num_blocks=16, num_threads=1, decode_dtype=decodes)


@pytest.mark.parametrize("decodes", DECODES)
def test_generated_tokens_are_batch_and_cache_invariant_and_quantized(decodes: str) -> None:
    llm = _llm(decodes)
    runner = llm.engine.runner
    layer, head = runner.model.layers[0].down_proj, runner.model.lm_head
    assert runner.decode_dtype == decodes and getattr(layer, PATH_FLAG[decodes])
    # bfloat16-weights: silu(gate) * up comes out of the gate and up projection's own call
    gate_up = runner.model.layers[0].gate_up_proj
    assert (gate_up._fused_inputs is not None and gate_up._fused_inputs[2] is not None) == (
        decodes == "bfloat16-weights")
    # the 8-bit head too
    assert getattr(head, PATH_FLAG[decodes]) and head.q8 is not None
    assert llm.engine.kv.prompt_blocks_only
    ids = llm.tokenizer.encode(PROMPT)
    others = [llm.tokenizer.encode(p) for p in OTHERS]
    # cold, in a batch: the others decode while this prompt's chunks run
    batch = llm.generate([others[0], ids, others[1]], GREEDY)
    assert batch[1].num_cached_tokens == 0
    cold = _tokens_and_logprobs(batch[1])
    # alone, its prefix cached
    warm = llm.generate(ids, GREEDY)[0]
    assert warm.num_cached_tokens >= 48 and _tokens_and_logprobs(warm) == cold
    # alone, cold (an engine without a prefix cache)
    fresh = _llm(decodes, cache=False)
    assert _tokens_and_logprobs(fresh.generate(ids, GREEDY)[0]) == cold
    # a chat's next turn: only the first turn's prompt blocks come from the cache
    first = llm.generate(ids, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    turn2 = ids + first.outputs[0].token_ids + llm.tokenizer.encode(" And what happened next?")
    cached = len(ids) // 16 * 16
    while (len(turn2) - cached) % 48 == 1 or len(turn2) % 48 == 1:  # no chunk of one token (decode kernel)
        turn2.append(turn2[-1])
    warm2 = llm.generate(turn2, GREEDY)[0]
    assert warm2.num_cached_tokens == cached
    assert _tokens_and_logprobs(warm2) == _tokens_and_logprobs(fresh.generate(turn2, GREEDY)[0])
    # the float32 engine generates exactly: the prompt's logits are the same, the rest differ
    auto = _llm("auto")
    exact = _tokens_and_logprobs(auto.generate(ids, GREEDY)[0])
    assert exact[1][0] == cold[1][0]  # the first token: the prompt's last row, exact in both (head too)
    assert exact[1][1:] != cold[1][1:]
    # prompt logprobs are prompt rows: the exact head's
    scored = SamplingParams(max_tokens=1, prompt_logprobs=0)
    assert llm.generate(ids, scored)[0].prompt_logprobs == auto.generate(ids, scored)[0].prompt_logprobs
    print(f"\nlogprobs, float32 decodes {exact[1][:4]}, {decodes} decodes {cold[1][:4]}; "
          f"tokens equal: {exact[0] == cold[0]}")


@needs_bf16
def test_greedy_tokens_come_from_the_heads_own_argmax() -> None:
    """bfloat16-weights, greedy rows that ask for nothing but their tokens:
    the head takes each row's argmax in its kernel (compute_argmax, the
    logits never made), in steps of decodes only; a step with a prompt's
    last token, a row with logprobs or a penalty samples from the logits.
    The tokens are those sampling from the logits gives."""
    llm = _llm("bfloat16-weights")
    runner = llm.engine.runner
    model = runner.model
    calls: list[int] = []  # rows of each compute_argmax call
    inner = model.compute_argmax

    def spy(hidden):  # type: ignore[no-untyped-def]
        calls.append(hidden.shape[0])
        return inner(hidden)

    model.compute_argmax = spy  # type: ignore[method-assign]
    prompts = [llm.tokenizer.encode(p) for p in [PROMPT, *OTHERS]]
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    fused = [o.outputs[0].token_ids for o in llm.generate(prompts, plain)]
    # the three decoding together, each after its first token (a prompt's last row: the logits)
    assert max(calls) == 3 and 0 < len(calls) < 3 * 12
    runner.fused_argmax = False
    seen = len(calls)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, plain)] == fused
    assert len(calls) == seen
    runner.fused_argmax = True
    # min_tokens with nothing to ban (EOS ignored, no stop tokens) leaves the logits as they are
    held = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, min_tokens=12)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, held)] == fused
    assert len(calls) > seen
    seen = len(calls)
    penalized = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.0001)
    for asks in (GREEDY, penalized, SamplingParams(temperature=0, max_tokens=12, min_tokens=12)):
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, asks)]
        assert len(calls) == seen
        if asks is GREEDY:
            assert got == fused


@pytest.mark.parametrize("closer", [pytest.param("bfloat16", marks=needs_q4bf16),
                                    pytest.param("bfloat16-weights", marks=needs_bf16)])
def test_bfloat16_decodes_round_less_than_int8(closer: str) -> None:
    """Only x rounds under bfloat16 (8 bits of mantissa; int8 keeps about 7 of
    a block's largest), x and the weights under bfloat16-weights: either's
    logprobs sit far closer to the exact engine's."""
    ids = _llm("auto").tokenizer.encode(PROMPT)
    lps = {d: _tokens_and_logprobs(_llm(d).generate(ids, GREEDY)[0]) for d in ("auto", "int8", closer)}
    assert lps[closer][0] == lps["auto"][0]  # the same tokens on this prompt
    gap = {d: max(abs(a - b) for a, b in zip(lps[d][1], lps["auto"][1], strict=True))
           for d in ("int8", closer)}
    assert 0 < gap[closer] < gap["int8"] / 4, gap


@pytest.mark.parametrize("decodes", [*DECODES, pytest.param("bfloat16-weights+prompts", marks=needs_bf16)])
def test_speculative_decoding_gives_the_same_tokens(decodes: str) -> None:
    """Drafts are checked on the quantized path, as each token would be
    decoded; with bfloat16 prompts too, generated tokens attend in bfloat16
    (where the kernel can), drafts as bfloat16 rows of the prefill kernel."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = "one two three four five six seven eight nine ten one two three four five six"
    decodes, _, prompts = decodes.partition("+")
    kw = {"prefill_dtype": "bfloat16"} if prompts else {}
    plain = _llm(decodes, **kw).generate(prompt, params)[0].outputs[0].token_ids
    spec = _llm(decodes, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                            "prompt_lookup_max": 3, "prompt_lookup_min": 1}, **kw)
    out = spec.generate(prompt, params)[0].outputs[0].token_ids
    assert out == plain
    assert spec.engine.spec is not None and spec.engine.spec.stats.num_accepted_tokens > 0
    if prompts:
        attention = load_cpu_kernel()
        assert spec.engine.runner.bf16_decode_attention == (attention is not None
                                                            and attention.decode_bf16_supported())


@pytest.fixture(scope="module", params=DECODES)
def pair(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    """A prefill worker (prompts exact, the default) and an int8 (or bfloat16) decode worker."""
    decodes = request.param
    p, d = start_pair(tmp_path_factory.mktemp(f"decode-{decodes}"), ["--num-blocks", "64"],
                      ["--num-blocks", "64", "--decode-dtype", decodes, "--local-prefill-threshold", "1"])
    try:
        yield {"p": p, "d": d, "decodes": decodes}
    finally:
        stop_all([p, d])


def test_split_equals_one_engine(pair) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    one = LLM(dtype="float32", num_blocks=64, num_threads=1, max_model_len=1024, decode_dtype=pair["decodes"])
    ids = one.tokenizer.encode(PROMPT)
    chunks = generate(pair["d"].address, pair["p"].address, "i8", ids, params)
    assert chunks[0].remote_prefill and chunks[0].cached_tokens == 0
    assert [t for c in chunks for t in c.token_ids] == one.generate(ids, params)[0].outputs[0].token_ids
