"""--decode-dtype int8 on the real model: generated tokens through the 4-bit
layers with x quantized to int8, prompt tokens exact.  A request's tokens and
logprobs do not depend on the batch around it or on a prefix-cache hit (a
chat's next turn included, whose prompt holds tokens generated before); the
int8 path was taken (they differ from the float32 engine's); speculative
decoding gives the tokens decoding one at a time gives; a split pair (its
decode worker int8) equals one engine; where the option cannot run it is
refused at start-up, naming it."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

from .procs import start_pair, stop_all
from .test_workers import generate

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
PROMPT = "A long note on the harbour: the tides, the moon, the boats and the people who mend the nets. " * 5
OTHERS = ["Short one.", "Another prompt, somewhat longer than the first, about trains and timetables " * 2]


def _tokens_and_logprobs(out) -> tuple[list[int], list[float]]:  # type: ignore[no-untyped-def]
    c = out.outputs[0]
    return c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)]


def _llm(decode_dtype: str, cache: bool = True, **kw) -> LLM:  # type: ignore[no-untyped-def]
    # Chunks of 48 tokens: the prompt spans several steps, beside other requests' decodes.
    return LLM(dtype="float32", num_blocks=96, num_threads=1, max_model_len=1024, max_num_batched_tokens=48,
               decode_dtype=decode_dtype, enable_prefix_caching=cache, **kw)


def test_refused_where_it_cannot_run() -> None:
    for dtype in ("float16", "bfloat16"):
        with pytest.raises(ValueError, match="decode_dtype: int8 needs a float32 model on a CPU"):
            LLM(dtype=dtype, num_blocks=16, num_threads=1, decode_dtype="int8")


def test_generated_tokens_are_batch_and_cache_invariant_and_int8() -> None:
    i8 = _llm("int8")
    runner = i8.engine.runner
    assert runner.decode_dtype == "int8" and runner.model.layers[0].down_proj.int8
    assert runner.model.lm_head.int8 and runner.model.lm_head.q8 is not None  # the 8-bit head too
    assert i8.engine.kv.prompt_blocks_only
    ids = i8.tokenizer.encode(PROMPT)
    others = [i8.tokenizer.encode(p) for p in OTHERS]
    # cold, in a batch: the others decode while this prompt's chunks run
    batch = i8.generate([others[0], ids, others[1]], GREEDY)
    assert batch[1].num_cached_tokens == 0
    cold = _tokens_and_logprobs(batch[1])
    # alone, its prefix cached
    warm = i8.generate(ids, GREEDY)[0]
    assert warm.num_cached_tokens >= 48 and _tokens_and_logprobs(warm) == cold
    # alone, cold (an engine without a prefix cache)
    fresh = _llm("int8", cache=False)
    assert _tokens_and_logprobs(fresh.generate(ids, GREEDY)[0]) == cold
    # a chat's next turn: only the first turn's prompt blocks come from the cache
    first = i8.generate(ids, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    turn2 = ids + first.outputs[0].token_ids + i8.tokenizer.encode(" And what happened next?")
    cached = len(ids) // 16 * 16
    while (len(turn2) - cached) % 48 == 1 or len(turn2) % 48 == 1:  # no chunk of one token (decode kernel)
        turn2.append(turn2[-1])
    warm2 = i8.generate(turn2, GREEDY)[0]
    assert warm2.num_cached_tokens == cached
    assert _tokens_and_logprobs(warm2) == _tokens_and_logprobs(fresh.generate(turn2, GREEDY)[0])
    # the float32 engine generates exactly: the prompt's logits are the same, the rest differ
    auto = _llm("auto")
    exact = _tokens_and_logprobs(auto.generate(ids, GREEDY)[0])
    assert exact[1][0] == cold[1][0]  # the first token: the prompt's last row, exact in both (head too)
    assert exact[1][1:] != cold[1][1:]
    # prompt logprobs are prompt rows: the exact head's
    scored = SamplingParams(max_tokens=1, prompt_logprobs=0)
    assert i8.generate(ids, scored)[0].prompt_logprobs == auto.generate(ids, scored)[0].prompt_logprobs
    print(f"\nlogprobs, float32 decodes {exact[1][:4]}, int8 decodes {cold[1][:4]}; "
          f"tokens equal: {exact[0] == cold[0]}")


def test_speculative_decoding_gives_the_same_tokens() -> None:
    """Drafts are checked on the int8 path, as each token would be decoded."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = "one two three four five six seven eight nine ten one two three four five six"
    plain = _llm("int8").generate(prompt, params)[0].outputs[0].token_ids
    spec = _llm("int8", speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                            "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    out = spec.generate(prompt, params)[0].outputs[0].token_ids
    assert out == plain
    assert spec.engine.spec is not None and spec.engine.spec.stats.num_accepted_tokens > 0


@pytest.fixture(scope="module")
def pair(tmp_path_factory):  # type: ignore[no-untyped-def]
    """A prefill worker (prompts exact, the default) and an int8 decode worker."""
    p, d = start_pair(tmp_path_factory.mktemp("decode-int8"), ["--num-blocks", "64"],
                      ["--num-blocks", "64", "--decode-dtype", "int8", "--local-prefill-threshold", "1"])
    try:
        yield {"p": p, "d": d}
    finally:
        stop_all([p, d])


def test_split_equals_one_engine(pair) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    one = LLM(dtype="float32", num_blocks=64, num_threads=1, max_model_len=1024, decode_dtype="int8")
    ids = one.tokenizer.encode(PROMPT)
    chunks = generate(pair["d"].address, pair["p"].address, "i8", ids, params)
    assert chunks[0].remote_prefill and chunks[0].cached_tokens == 0
    assert [t for c in chunks for t in c.token_ids] == one.generate(ids, params)[0].outputs[0].token_ids
