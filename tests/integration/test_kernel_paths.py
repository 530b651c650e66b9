"""The real model on every linear-kernel path this CPU runs (scalar, AVX2,
AVX-512): the same logits bit for bit, batched or alone.  With the HF-parity,
split == monolithic and batch-invariance tests on the default path, this
carries them to the others (they also pass run whole under
SPLITSERVE_LINEAR_ISA=<set>).  And a prompt's logits, bit for bit, however
it was prefilled."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers.cpu_attention import load_linear_kernel

PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,"]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", num_blocks=128, max_model_len=256, num_threads=2, enable_prefix_caching=False)


def run(llm: LLM, prompts: list[str]) -> Iterator[tuple[list[int], torch.Tensor]]:
    """-> per prompt: greedy tokens and the logits of every step (recorded in the real runner)."""
    runner = llm.engine.runner
    inner = runner.forward_logits
    logits: dict[str, list[torch.Tensor]] = {}

    def recording(seqs):  # type: ignore[no-untyped-def]
        out, prompt = inner(seqs)
        for s, row in zip([s for s in seqs if s.sample], out, strict=True):
            logits.setdefault(s.request.request_id, []).append(row.clone())
        return out, prompt

    runner.forward_logits = recording  # type: ignore[method-assign]
    try:
        outs = llm.generate(prompts, GREEDY)
    finally:
        del runner.forward_logits
    for o in outs:
        yield o.outputs[0].token_ids, torch.stack(logits[f"{o.request_id}-0"])


def test_every_kernel_path_gives_the_same_logits_batched_or_alone(llm: LLM) -> None:
    kernel = load_linear_kernel()
    assert kernel is not None
    isas = kernel.supported_isas()
    before = kernel.isa()
    got: dict[str, list[tuple[list[int], torch.Tensor]]] = {}
    try:
        for name in isas:
            kernel.set_isa(name)
            got[name] = list(run(llm, PROMPTS))
            alone = [next(run(llm, [p])) for p in PROMPTS]
            for (tb, lb), (ta, la) in zip(got[name], alone, strict=True):
                assert tb == ta and torch.equal(lb, la), f"{name}: a prompt's logits depend on its batch"
    finally:
        kernel.set_isa(before)
    first = isas[0]
    for name in isas[1:]:
        for (t0, l0), (t1, l1) in zip(got[first], got[name], strict=True):
            assert t0 == t1 and torch.equal(l0, l1), f"{name} differs from {first}"


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float16", "fp8_e4m3"])
def test_a_prompt_gives_the_same_logits_whole_chunked_or_after_a_cached_prefix(kv_cache_dtype: str) -> None:
    """The CPU prefill attention cuts every query's sums at fixed key positions
    and the projections are row by row, so a prompt's logits do not depend on
    how it was prefilled: in one step, in chunks of 48 tokens, or after the
    first ones came from the prefix cache.  With an fp8 cache too: every query
    reads the keys as stored, its own chunk's included."""
    prompt = " ".join(f"Line {i}: the tide rose over the harbour wall and the boats turned."
                      for i in range(20))
    common = {"dtype": "float32", "num_blocks": 128, "max_model_len": 512, "num_threads": 2,
              "kv_cache_dtype": kv_cache_dtype}
    whole = LLM(**common, enable_prefix_caching=False)  # type: ignore[arg-type]
    chunked = LLM(**common, enable_prefix_caching=True, max_num_batched_tokens=48)  # type: ignore[arg-type]
    assert len(whole.tokenizer.encode(prompt)) > 4 * 48  # several chunks, several cache blocks
    tokens, logits = next(run(whole, [prompt]))
    for time in ("first", "again"):  # again: the prompt's full blocks come from the cache
        t, lg = next(run(chunked, [prompt]))
        assert t == tokens and torch.equal(lg, logits), time
    assert chunked.engine.kv.prefix_hits >= 4 * 48
    # 193 tokens, the first 192 cached (12 blocks of 16, from the prompt above): the
    # 193rd is computed alone, a prompt's token all the same, attended as a prefill
    # (the decode kernel's bits are not the prefill kernel's)
    ids = whole.tokenizer.encode(prompt)[:193]
    tokens, logits = next(run(whole, [ids]))
    before = chunked.engine.kv.prefix_hits
    for time in ("first", "again"):
        t, lg = next(run(chunked, [ids]))
        assert t == tokens and torch.equal(lg, logits), time
    assert chunked.engine.kv.prefix_hits - before == 2 * 192
