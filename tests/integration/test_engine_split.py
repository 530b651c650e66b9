"""The split at the engine level, in one process: a prefill engine computes
the prompt and holds its blocks, a decode engine reserves blocks first, the
blocks are copied between the two KV tensors (what the UCX transport does
between processes), and the tokens equal a single engine's (invariant 5)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine import LLM, SamplingParams
from engine.sampler import SampledToken

PROMPTS = [
    "The history of the printing press begins",
    "def merge_sort(xs):",
    "Three reasons to learn statistics are",
]


def engines(**kw):  # type: ignore[no-untyped-def]
    args = dict(dtype="float32", num_blocks=128, block_size=8, num_threads=2, max_model_len=512)
    args.update(kw)
    return LLM(**args).engine  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def trio():  # type: ignore[no-untyped-def]
    return engines(), engines(), engines()


def drain(eng, request_id: str, first: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    toks = list(first)
    while eng.has_unfinished():
        for out in eng.step():
            if out.request_id == request_id:
                toks += out.new_token_ids
    return toks


def remote_generate(prefill, decode, rid: str, prompt: str, params: SamplingParams) -> list[int]:  # type: ignore[no-untyped-def]
    ids = decode.tokenize(prompt)
    handoff = decode.reserve_remote(rid, ids, params)
    assert handoff is not None
    assert list(handoff.block_ids) == decode.kv.block_ids(rid)  # the whole table, as the scheduler holds it
    handoff.check_layout(prefill.kv_layout)  # the decode engine's layout travels with it
    p_params = replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
    prefill.add_request(rid, ids, p_params, hold_blocks=True)
    token = drain(prefill, rid, [])[0]
    src, dst = handoff.pair(prefill.held_block_ids(rid))
    for s, d in zip(src, dst, strict=True):
        decode.runner.kv_cache[d].copy_(prefill.runner.kv_cache[s])
    prefill.release(rid)
    out = decode.remote_kv_landed(rid, SampledToken(token, float("nan"), 0))
    assert out.new_token_ids == [token]
    return drain(decode, rid, [token])


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True),
], ids=["greedy", "seeded"])
def test_split_equals_single_engine(trio, params) -> None:  # type: ignore[no-untyped-def]
    single, prefill, decode = trio
    for i, prompt in enumerate(PROMPTS):
        single.add_request("ref", prompt, params)
        ref = drain(single, "ref", [])
        got = remote_generate(prefill, decode, f"{params.temperature}-{i}", prompt, params)
        assert got == ref
    for eng in trio:
        assert eng.kv.num_free_blocks == eng.kv.num_blocks


def test_decode_prefix_hit_sends_only_missing_blocks(trio) -> None:  # type: ignore[no-untyped-def]
    single, prefill, decode = trio
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = PROMPTS[0] + " in the fifteenth century, when"
    single.add_request("ref", prompt, params)
    ref = drain(single, "ref", [])
    assert remote_generate(prefill, decode, "warm", prompt, params) == ref
    handoff = decode.reserve_remote("again", decode.tokenize(prompt), params)
    assert handoff is not None and handoff.first_block > 0  # decode's own cache had the prefix
    assert len(handoff.blocks_to_fill) == len(handoff.block_ids) - handoff.first_block
    decode.abort("again")
    assert decode.kv.num_free_blocks == decode.kv.num_blocks


def test_failed_transfer_recomputes_on_decode(trio) -> None:  # type: ignore[no-untyped-def]
    single, _, decode = trio
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    single.add_request("ref", PROMPTS[2], params)
    ref = drain(single, "ref", [])
    decode.reserve_remote("lost", decode.tokenize(PROMPTS[2]), params)
    decode.remote_kv_failed("lost")  # e.g. the prefill worker died mid-transfer
    assert drain(decode, "lost", []) == ref
    assert decode.kv.num_free_blocks == decode.kv.num_blocks


def test_failed_transfers_of_one_prompt_both_recompute_exactly(trio) -> None:  # type: ignore[no-untyped-def]
    """Two requests for one prompt, both reserved with nothing cached and both
    failed (the prefill worker died while they waited; the chaos test met it):
    each recomputes in the blocks it reserved, whatever a failed transfer left
    in them (here: garbage), though the first one caches the prefix before the
    second is planned."""
    single, _, decode = trio
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = PROMPTS[1] + " a fresh prompt that no engine has cached yet"
    single.add_request("ref", prompt, params)
    ref = drain(single, "ref", [])
    for rid in ("lost-a", "lost-b"):
        handoff = decode.reserve_remote(rid, decode.tokenize(prompt), params)
        assert handoff is not None and handoff.first_block == 0
        for b in handoff.blocks_to_fill:  # what a transfer cut short leaves behind
            decode.runner.kv_cache[b].normal_()
    decode.remote_kv_failed("lost-a")
    decode.remote_kv_failed("lost-b")
    got: dict[str, list[int]] = {"lost-a": [], "lost-b": []}
    while decode.has_unfinished():
        for out in decode.step():
            got[out.request_id] += out.new_token_ids
    assert got == {"lost-a": ref, "lost-b": ref}
    assert decode.kv.num_free_blocks == decode.kv.num_blocks
