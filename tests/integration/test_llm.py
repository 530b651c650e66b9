"""The offline API on the real model: bad input, preemption, seeds, n, stop
strings, logprobs, chat, and every block coming back."""

from __future__ import annotations

import dataclasses
import math

import pytest

from engine import LLM, SamplingParams
from engine.layers import huge_pages

PROMPTS = [
    "The three primary colors are",
    "In 1969, the first humans",
    "A haiku about autumn leaves:",
    "def quicksort(arr):",
    "The best way to learn a language is",
    "Photosynthesis converts",
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", num_blocks=256, max_model_len=512, num_threads=2, seed=1)


def free_equals_total(llm: LLM) -> bool:
    kv = llm.engine.kv
    return kv.num_free_blocks == kv.num_blocks


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("make, field", [
    (lambda llm: llm.generate("", GREEDY), "prompt"),
    (lambda llm: llm.generate([[]], GREEDY), "prompt"),
    (lambda llm: llm.generate([[1, 2, 10**9]], GREEDY), "prompt"),
    (lambda llm: llm.generate("word " * 600, GREEDY), "prompt"),
    (lambda llm: llm.generate("hi", SamplingParams(max_tokens=600)), "max_tokens"),
    (lambda llm: llm.generate("hi", SamplingParams(temperature=-0.5)), "temperature"),
    (lambda llm: llm.generate("hi", SamplingParams(temperature=math.nan)), "temperature"),
    (lambda llm: llm.generate("hi", SamplingParams(top_p=0.0)), "top_p"),
    (lambda llm: llm.generate("hi", SamplingParams(top_p=1.5)), "top_p"),
    (lambda llm: llm.generate("hi", SamplingParams(stop=5)), "stop"),  # type: ignore[arg-type]
    (lambda llm: llm.generate("hi", SamplingParams(stop=["ok", 3])), "stop"),  # type: ignore[list-item]
    (lambda llm: llm.generate("hi", SamplingParams(logit_bias={10**7: 1.0})), "logit_bias"),
    (lambda llm: llm.generate(["a", "b"], [GREEDY]), "sampling_params"),
    (lambda llm: llm.chat([{"role": "user"}]), "messages"),
])
def test_bad_input_names_the_field_and_engine_keeps_serving(llm, make, field) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=field):
        make(llm)
    assert free_equals_total(llm) and not llm.engine.has_unfinished()
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


def test_preemption_under_tiny_budget_gives_same_tokens(llm) -> None:  # type: ignore[no-untyped-def]
    ref = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    tiny = LLM(dtype="float32", num_blocks=9, block_size=8, max_model_len=512, num_threads=2)
    got = [o.outputs[0].token_ids for o in tiny.generate(PROMPTS, GREEDY)]
    assert got == ref
    assert tiny.engine.scheduler.num_preemptions > 0
    assert free_equals_total(tiny)


def test_seed_gives_same_tokens_whatever_the_batch(llm) -> None:  # type: ignore[no-untyped-def]
    seeded = SamplingParams(temperature=1.0, top_k=50, max_tokens=16, seed=1234, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    alone = llm.generate(PROMPTS[1], seeded)[0].outputs[0].token_ids
    mixed = llm.generate([PROMPTS[2], PROMPTS[1], PROMPTS[3]], [other, seeded, other])
    assert mixed[1].outputs[0].token_ids == alone
    unseeded = [llm.generate(PROMPTS[1], other)[0].outputs[0].token_ids for _ in range(2)]
    assert unseeded[0] != unseeded[1]


def test_resumed_seeded_request_continues_as_undisturbed(llm) -> None:  # type: ignore[no-untyped-def]
    """A migrated seeded request (prompt + its first tokens, marked resumed)
    goes on with exactly the undisturbed run's tokens: the RNG stands where it
    would, and the penalties count the resumed tokens as output, not prompt."""
    params = SamplingParams(temperature=0.9, seed=11, max_tokens=24, ignore_eos=True,
                            repetition_penalty=1.3, frequency_penalty=0.6)
    prompt = llm.tokenizer.encode(PROMPTS[2])
    whole = llm.generate([prompt], params)[0].outputs[0].token_ids
    cut = 9

    def rest(num_resumed: int) -> list[int]:
        out: list[int] = []
        llm.engine.add_request(f"resumed-{num_resumed}", [*prompt, *whole[:cut]],
                               dataclasses.replace(params, max_tokens=24 - cut),
                               num_resumed_tokens=num_resumed)
        while llm.engine.has_unfinished():
            for o in llm.engine.step():
                out += o.new_token_ids
        return out

    assert whole[:cut] + rest(cut) == whole
    assert whole[:cut] + rest(0) != whole  # as a new prompt it is another sample: the marking matters
    assert free_equals_total(llm)


def test_resumed_tokens_compute_what_decoding_computed(llm) -> None:  # type: ignore[no-untyped-def]
    """The relayed tokens of a resumed request are computed as decode rows (the
    attention kernel decoding used, one row per token), not as a prompt: at any
    cut, the resumed request samples the undisturbed run's tokens from the very
    same logprobs, bit for bit.  Before, they were prefilled like a prompt and a
    draw near a CDF boundary could pick another token (tokens 8, 31 and 42 of
    test_failover's seeded stream)."""
    params = SamplingParams(temperature=0.9, seed=4242, max_tokens=24, ignore_eos=True,
                            repetition_penalty=1.2, frequency_penalty=0.4, logprobs=3)
    prompt = llm.engine.text_tokenizer.encode(PROMPTS[4])
    whole = llm.generate([prompt], params)[0].outputs[0]

    def floats(steps) -> list[dict[int, float]]:  # type: ignore[no-untyped-def]
        return [{t: lp.logprob for t, lp in step.items()} for step in steps]

    for cut in (1, 2, 5, 8, 13, 21):
        llm.engine.add_request(f"exact-{cut}", [*prompt, *whole.token_ids[:cut]],
                               dataclasses.replace(params, max_tokens=24 - cut), num_resumed_tokens=cut)
        tokens: list[int] = []
        steps: list = []  # type: ignore[type-arg]
        while llm.engine.has_unfinished():
            for o in llm.engine.step():
                tokens += o.new_token_ids
                steps += o.new_logprobs or []
        assert whole.token_ids[:cut] + tokens == whole.token_ids, cut
        assert floats(steps) == floats(whole.logprobs)[cut:], cut  # the same floats, not just the same tokens
    assert free_equals_total(llm)


def test_n_samples_share_the_prompt(llm) -> None:  # type: ignore[no-untyped-def]
    out = llm.generate(PROMPTS[4], SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=5,
                                                  ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in out.outputs)
    assert free_equals_total(llm)


def test_stop_string_truncates_text(llm) -> None:  # type: ignore[no-untyped-def]
    full = llm.generate(PROMPTS[5], GREEDY)[0].outputs[0]
    words = full.text.split()
    stop = words[len(words) // 2]
    cut = full.text.index(stop)
    out = llm.generate(PROMPTS[5], SamplingParams(temperature=0, max_tokens=24, stop=[stop]))[0].outputs[0]
    assert out.text == full.text[:cut]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    out = llm.generate(PROMPTS[5], SamplingParams(temperature=0, max_tokens=24, stop=stop,
                                                  include_stop_str_in_output=True))[0].outputs[0]
    assert out.text == full.text[:cut + len(stop)]
    assert free_equals_total(llm)


def test_stop_token_ids_and_max_tokens(llm) -> None:  # type: ignore[no-untyped-def]
    full = llm.generate(PROMPTS[0], GREEDY)[0].outputs[0]
    stop_tok = full.token_ids[5]
    first = full.token_ids.index(stop_tok)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24,
                                                  stop_token_ids=[stop_tok]))[0].outputs[0]
    assert out.token_ids == full.token_ids[:first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_tok)


def test_logprobs(llm) -> None:  # type: ignore[no-untyped-def]
    out = llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=6, logprobs=3))[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 6
    for tok, pos in zip(out.token_ids, out.logprobs, strict=True):
        assert tok in pos and pos[tok].rank == 1  # greedy picks the top raw token here
        assert 3 <= len(pos) <= 4
        assert all(lp.logprob <= 0 for lp in pos.values())
    assert out.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in
                                                       zip(out.token_ids, out.logprobs, strict=True)))


def test_chat_template(llm) -> None:  # type: ignore[no-untyped-def]
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32))[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason in ("stop", "length")


def test_every_ending_returns_every_block(llm) -> None:  # type: ignore[no-untyped-def]
    eng = llm.engine
    start = eng.kv.num_free_blocks
    long_prompt = "Tell me everything about the history of Rome. " * 20
    eng.add_request("mid-prefill", long_prompt, GREEDY)
    eng.add_request("mid-decode", PROMPTS[0], GREEDY)
    eng.add_request("waiting", PROMPTS[1], GREEDY, priority=0)
    eng.step()
    assert eng.kv.num_free_blocks < start
    eng.abort("waiting")
    eng.abort("mid-prefill")
    eng.step()
    eng.step()
    eng.abort("mid-decode")
    assert eng.kv.num_free_blocks == start and not eng.has_unfinished()
    for params in (SamplingParams(temperature=0, max_tokens=3),  # length
                   SamplingParams(temperature=0, max_tokens=50, stop=" "),  # stop string
                   SamplingParams(temperature=0, max_tokens=50)):  # eos or length
        llm.generate(PROMPTS[2], params)
        assert eng.kv.num_free_blocks == start


def test_priority_serves_lower_value_first() -> None:
    order: list[str] = []
    tiny = LLM(dtype="float32", num_blocks=64, max_num_seqs=1, scheduling_policy="priority",
               num_threads=2)
    eng = tiny.engine
    for i, prio in enumerate([5, 0, 3]):
        eng.add_request(f"r{i}", PROMPTS[i], SamplingParams(temperature=0, max_tokens=2), priority=prio)
    while eng.has_unfinished():
        order += [o.request_id for o in eng.step() if o.finished]
    assert order == ["r1", "r2", "r0"]


def test_cache_pages_filled_ahead_of_the_blocks_handed_out(llm, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The engine's block pool tells its Prefault each new high water; the
    filler keeps its lead past it, to within the huge page it wakes for
    (engine/layers/huge_pages.py), and SPLITSERVE_KV_PREFAULT=0 makes none."""
    p, pool = llm.engine.prefault, llm.engine.kv.pool
    assert p is not None and pool.on_fresh == p.ahead_of
    llm.generate(PROMPTS, GREEDY)
    assert pool.high_water >= len(PROMPTS)
    assert p.wait(pool.high_water * p.block_bytes + p.lead - huge_pages.PREFAULT_CHUNK, timeout=60)
    monkeypatch.setenv("SPLITSERVE_KV_PREFAULT", "0")
    assert llm.engine.runner.kv_prefault() is None
