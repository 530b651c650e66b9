"""--prefill-dtype bfloat16 on the real model: prompt tokens through bfloat16
projections, the rest exact.  A request's tokens and logprobs do not depend on
the batch around it, on how its prompt was chunked, or on a prefix-cache hit
(a chat's next turn included, whose prompt holds tokens generated before);
the bfloat16 path was taken (they differ from the float32 engine's); a split
pair equals one engine; a decode worker refuses a prefill worker of the
other prefill dtype at the layout check, naming the field; and where the
option cannot run it is refused at start-up."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.layers.cpu_attention import attention_isa
from engine.layers.cpu_features import has
from protos import pb_grpc

from .procs import address, free_port, peer_flag, start_worker
from .test_workers import generate, load

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
PROMPT = "A long note on the harbour: the tides, the moon, the boats and the people who mend the nets. " * 5
OTHERS = ["Short one.", "Another prompt, somewhat longer than the first, about trains and timetables " * 2]

# The CPU's flags, not the kernel's availability: a kernel that failed to build
# on a CPU that has the instructions must fail these tests, not skip them.
BF16_CPU = all(has(f) for f in ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"))
needs_bf16 = pytest.mark.skipif(not BF16_CPU, reason="this CPU lacks AVX512-BF16 (lscpu: no avx512_bf16), "
                                                     "which --prefill-dtype bfloat16 needs")


def test_refused_where_it_cannot_run() -> None:
    """A float16 model everywhere, and any model on a CPU without AVX512-BF16:
    a clear error at start-up naming the option, never a silent float32 path."""
    with pytest.raises(ValueError, match="prefill_dtype: bfloat16 needs a float32 model on a CPU with "):
        LLM(dtype="float16", num_blocks=16, num_threads=1, prefill_dtype="bfloat16")
    if not BF16_CPU:
        with pytest.raises(ValueError, match="prefill_dtype"):
            LLM(dtype="float32", num_blocks=16, num_threads=1, prefill_dtype="bfloat16")
    # a bfloat16 model's prompts already are: taken as it is (on the packed
    # kernels where the CPU runs them: its prompts through the bfloat16 panels)
    layout = LLM(dtype="bfloat16", num_blocks=16, num_threads=1, prefill_dtype="bfloat16").engine.kv_layout
    assert (layout.dtype, layout.prefill_dtype) == (("float32", "bfloat16") if BF16_CPU else ("bfloat16", ""))


def _tokens_and_logprobs(out) -> tuple[list[int], list[float]]:  # type: ignore[no-untyped-def]
    c = out.outputs[0]
    return c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)]


def _llm(prefill_dtype: str, cache: bool = True) -> LLM:
    # Chunks of 48 tokens: the prompt spans several steps, beside other requests' decodes.
    return LLM(dtype="float32", num_blocks=96, num_threads=1, max_model_len=1024, max_num_batched_tokens=48,
               prefill_dtype=prefill_dtype, enable_prefix_caching=cache)


@needs_bf16
def test_prompt_rows_are_batch_chunk_and_cache_invariant_and_bf16() -> None:
    bf = _llm("bfloat16")
    assert bf.engine.kv_layout.prefill_dtype == "bfloat16"
    assert bf.engine.runner.model.layers[0].qkv_proj.bf16 is not None
    ids = bf.tokenizer.encode(PROMPT)
    assert len(ids) > 2 * 48
    others = [bf.tokenizer.encode(p) for p in OTHERS]
    # cold, in a batch: the others decode while this prompt's chunks run
    batch = bf.generate([others[0], ids, others[1]], GREEDY)
    assert batch[1].num_cached_tokens == 0
    cold = _tokens_and_logprobs(batch[1])
    # alone, its prefix cached: only the last blocks' tokens are computed again
    warm_out = bf.generate(ids, GREEDY)[0]
    assert warm_out.num_cached_tokens >= 48
    assert _tokens_and_logprobs(warm_out) == cold
    # alone, cold (an engine without a prefix cache)
    fresh = _llm("bfloat16", cache=False)
    alone = fresh.generate(ids, GREEDY)[0]
    assert alone.num_cached_tokens == 0 and _tokens_and_logprobs(alone) == cold
    # the prompt rows attend in bfloat16 too: in float32 the logprobs differ
    # (not in an AVX2 machine's attention build, SPLITSERVE_ATTENTION_ISA=avx2)
    runner = fresh.engine.runner
    assert runner.bf16_attention == (attention_isa() == "native")
    if runner.bf16_attention:
        runner.bf16_attention = False
        float32_attention = _tokens_and_logprobs(fresh.generate(ids, GREEDY)[0])
        runner.bf16_attention = True
        assert float32_attention[1] != cold[1]
    # a chat's next turn holds this turn's output, now prompt tokens: only the blocks
    # of the first turn's prompt come from the cache, never those of its output
    first = bf.generate(ids, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    turn2 = ids + first.outputs[0].token_ids + bf.tokenizer.encode(" And what happened next?")
    assert (len(ids) + 40 - 1) // 16 > len(ids) // 16  # the first turn filled blocks with its output
    # No chunk of one token in either run: one token attends through the decode kernel,
    # whose bits are not the prefill kernel's (in every dtype, this mode or not).
    cached = len(ids) // 16 * 16
    while (len(turn2) - cached) % 48 == 1 or len(turn2) % 48 == 1:
        turn2.append(turn2[-1])
    warm2 = bf.generate(turn2, GREEDY)[0]
    assert warm2.num_cached_tokens == cached
    assert _tokens_and_logprobs(warm2) == _tokens_and_logprobs(fresh.generate(turn2, GREEDY)[0])
    del fresh
    # the float32 engine computes the prompt exactly: other logprobs
    exact = _tokens_and_logprobs(_llm("auto").generate(ids, GREEDY)[0])
    assert exact[1] != cold[1]
    print(f"\nfirst logprobs, float32 prompt {exact[1][:3]}, bfloat16 prompt {cold[1][:3]}; "
          f"tokens equal: {exact[0] == cold[0]}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):  # type: ignore[no-untyped-def]
    """A bfloat16-prefill pair and a float32 (auto) prefill worker the decode may also reach."""
    tmp = tmp_path_factory.mktemp("prefill-bf16")
    ports = {name: free_port() for name in ("p-bf16", "p-auto", "d-bf16")}
    decode, prefills = [address(ports["d-bf16"])], [address(ports["p-bf16"]), address(ports["p-auto"])]
    bf16 = ["--prefill-dtype", "bfloat16"]
    flags = {"p-bf16": [*bf16, *peer_flag("prefill", decode)], "p-auto": peer_flag("prefill", decode),
             "d-bf16": [*bf16, "--local-prefill-threshold", "1", *peer_flag("decode", prefills)]}
    procs = {name: start_worker("prefill" if name[0] == "p" else "decode", name, tmp, "--num-blocks", "64",
                                "--grpc-port", str(ports[name]), *extra) for name, extra in flags.items()}
    try:
        for p in procs.values():
            p.wait_ready()
        yield procs
    finally:
        for p in procs.values():
            p.stop()


@needs_bf16
def test_split_equals_one_engine_and_refuses_the_other_prefill_dtype(cluster) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    one = LLM(dtype="float32", num_blocks=64, num_threads=1, max_model_len=1024, prefill_dtype="bfloat16")
    ids = one.tokenizer.encode(PROMPT)
    p, d = cluster["p-bf16"], cluster["d-bf16"]
    chunks = generate(d.address, p.address, "bf16", ids, params)
    assert chunks[0].remote_prefill and chunks[0].cached_tokens == 0
    assert [t for c in chunks for t in c.token_ids] == one.generate(ids, params)[0].outputs[0].token_ids
    # a float32-prompt prefill worker: refused at the layout check, no byte moves, served locally
    p32 = cluster["p-auto"]
    other = list(range(200, 260))
    before_p, before_d = load(p32.address, pb_grpc.PrefillStub), load(d.address, pb_grpc.DecodeStub)
    chunks = generate(d.address, p32.address, "mixed", other, params)
    after_p, after_d = load(p32.address, pb_grpc.PrefillStub), load(d.address, pb_grpc.DecodeStub)
    assert [t for c in chunks for t in c.token_ids] == one.generate(other, params)[0].outputs[0].token_ids
    assert after_p.counters["bytes_sent"] == before_p.counters["bytes_sent"]
    assert after_d.counters["kv_transfer_failures"] == before_d.counters["kv_transfer_failures"] + 1
    assert "KV layout mismatch (prefill_dtype: local '' vs remote 'bfloat16')" in d.tail(), d.tail()
    assert after_d.free_blocks == after_d.total_blocks
