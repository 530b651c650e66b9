"""Scheduler + KV cache manager driven offline by a toy 'model' whose next
token is a pure function of the tokens so far: no torch, milliseconds."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.vocab.hashing import extra_keys


@dataclass
class Tok:
    token_id: int


def toy_next(tokens: list[int]) -> int:
    return 10 + (31 * sum(tokens) + len(tokens)) % 50


def make(num_blocks: int = 64, block_size: int = 4, caching: bool = True, **cfg) -> Scheduler:  # type: ignore[no-untyped-def]
    kw = dict(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=256)
    kw.update(cfg)
    return Scheduler(SchedulerConfig(**kw), KVCacheManager(num_blocks, block_size, caching))  # type: ignore[arg-type]


def req(rid: str, prompt: list[int], max_tokens: int = 8, priority: int = 0,
        arrival: float | None = None) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens,
                   priority=priority, arrival_time=arrival, extra_keys=extra_keys("toy"))


def run(s: Scheduler, max_steps: int = 10_000) -> tuple[dict[str, list[int]], list]:  # type: ignore[type-arg]
    outs: dict[str, list[int]] = {}
    plans = []
    for _ in range(max_steps):
        if not s.has_unfinished():
            return outs, plans
        plan = s.schedule()
        assert not plan.is_empty, "scheduler stalled with unfinished requests"
        assert plan.num_tokens <= s.config.max_num_batched_tokens
        assert len(s.running) <= s.config.max_num_seqs
        for seq in plan.seqs:  # every scheduled token has a slot
            assert len(seq.block_ids) * s.kv.block_size >= seq.start + seq.num_new_tokens
        plans.append([(q.request.request_id, q.start, q.num_new_tokens) for q in plan.seqs])
        sampled = {q.request.request_id: Tok(toy_next(q.request.all_token_ids))
                   for q in plan.seqs if q.sample}
        for r in s.update(plan, sampled):
            outs[r.request_id] = list(r.output_token_ids)
    raise AssertionError("did not finish")


def test_decodes_never_wait_behind_a_long_prompt() -> None:
    s = make(max_num_batched_tokens=16)
    for i in range(3):
        s.add_request(req(f"d{i}", [1, 2, 3], max_tokens=30))
    run_until(s, 2)
    s.add_request(req("long", list(range(100, 200)), max_tokens=2))
    outs, plans = run(s)
    chunks = [n for plan in plans for rid, _, n in plan if rid == "long"]
    assert sum(chunks[:-1]) == 100 and chunks[-1] == 1  # prompt chunks, then one decode
    assert max(chunks) == 13  # 16 minus the three running decodes
    for plan in plans[:len(chunks)]:
        assert {"d0", "d1", "d2"} <= {rid for rid, _, _ in plan}
    assert s.kv.num_free_blocks == s.kv.num_blocks


def run_until(s: Scheduler, steps: int, token: int | None = None) -> None:
    for _ in range(steps):
        plan = s.schedule()
        s.update(plan, {q.request.request_id: Tok(toy_next(q.request.all_token_ids)
                                                  if token is None else token)
                        for q in plan.seqs if q.sample})


def test_prefix_hit_reuses_exact_blocks() -> None:
    s = make(block_size=4)
    prompt = list(range(1, 12))  # 11 tokens: 2 full blocks
    s.add_request(req("a", prompt, max_tokens=1))
    plan = s.schedule()
    first_blocks = plan.seqs[0].block_ids
    s.update(plan, {"a": Tok(5)})
    assert s.kv.num_free_blocks == s.kv.num_blocks
    s.add_request(req("b", prompt, max_tokens=1))
    plan = s.schedule()
    seq = plan.seqs[0]
    assert seq.start == 8 and seq.num_new_tokens == 3
    assert seq.block_ids[:2] == first_blocks[:2]
    assert seq.request.num_cached_tokens == 8


def test_full_prompt_hit_still_computes_last_token() -> None:
    s = make(block_size=4)
    s.add_request(req("a", list(range(8)), max_tokens=1))
    run(s)
    s.add_request(req("b", list(range(8)), max_tokens=1))
    plan = s.schedule()
    assert (plan.seqs[0].start, plan.seqs[0].num_new_tokens) == (4, 4)


def test_cache_salt_isolates() -> None:
    s = make(block_size=4)
    s.add_request(req("a", list(range(9)), max_tokens=1))
    run(s)
    b = Request("b", list(range(9)), SamplingParams(max_tokens=1), max_tokens=1,
                extra_keys=extra_keys("toy", cache_salt="tenant-2"))
    s.add_request(b)
    assert s.schedule().seqs[0].start == 0


def prompts(n: int) -> list[list[int]]:
    return [[(7 * i + j) % 40 + 1 for j in range(5 + 3 * i)] for i in range(n)]


def test_preemption_under_tiny_budget_gives_same_tokens() -> None:
    big = make(num_blocks=200)
    tiny = make(num_blocks=12)
    for s in (big, tiny):
        for i, p in enumerate(prompts(6)):
            s.add_request(req(f"r{i}", p, max_tokens=20))
    ref, _ = run(big)
    got, _ = run(tiny)
    assert got == ref
    assert tiny.num_preemptions > 0 and big.num_preemptions == 0
    assert tiny.kv.num_free_blocks == 12


def test_preemption_without_caching() -> None:
    big = make(num_blocks=200, caching=False)
    tiny = make(num_blocks=9, caching=False)
    for s in (big, tiny):
        for i, p in enumerate(prompts(5)):
            s.add_request(req(f"r{i}", p, max_tokens=16))
    assert run(tiny)[0] == run(big)[0]
    assert tiny.num_preemptions > 0 and tiny.kv.num_free_blocks == 9


def test_priority_order_and_victim() -> None:
    s = make(num_blocks=6, block_size=4, policy="priority", max_num_batched_tokens=256)
    s.add_request(req("low", [1] * 4, max_tokens=12, priority=5, arrival=0.0))
    s.add_request(req("high", [2] * 4, max_tokens=12, priority=0, arrival=1.0))
    s.add_request(req("mid", [3] * 4, max_tokens=12, priority=1, arrival=2.0))
    plan = s.schedule()
    assert [q.request.request_id for q in plan.seqs] == ["high", "mid", "low"]
    preempted = []
    while s.has_unfinished():
        plan = s.schedule()
        preempted += [r.request_id for r in plan.preempted]
        s.update(plan, {q.request.request_id: Tok(9) for q in plan.seqs if q.sample})
    assert preempted and preempted[0] == "low"
    assert "high" not in preempted


def test_fcfs_victim_is_latest_arrival() -> None:
    s = make(num_blocks=6, block_size=4, max_num_batched_tokens=256)
    for i in range(3):
        s.add_request(req(f"r{i}", [i + 1] * 4, max_tokens=12, arrival=float(i), priority=-i))
    preempted = []
    while s.has_unfinished():
        plan = s.schedule()
        preempted += [r.request_id for r in plan.preempted]
        s.update(plan, {q.request.request_id: Tok(9) for q in plan.seqs if q.sample})
    assert preempted[0] == "r2"


def test_refused_up_front() -> None:
    s = make(num_blocks=4, block_size=4, max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len"):
        s.add_request(req("a", [1] * 30, max_tokens=8))
    with pytest.raises(ValueError, match="KV blocks"):
        s.add_request(req("b", [1] * 10, max_tokens=10))
    s.add_request(req("c", [1] * 4, max_tokens=4))
    with pytest.raises(ValueError, match="request_id"):
        s.add_request(req("c", [1] * 4, max_tokens=4))
    assert run(s)[0]["c"]


def test_abort_frees_blocks_at_every_stage() -> None:
    s = make(num_blocks=32, max_num_batched_tokens=8)
    s.add_request(req("waiting", [1] * 4))
    assert s.abort("waiting") is not None
    s.add_request(req("mid-prefill", list(range(20))))
    s.add_request(req("decoding", [5, 6]))
    run_until(s, 1)
    assert s.kv.num_free_blocks < 32
    s.abort("mid-prefill")
    run_until(s, 2)
    s.abort("decoding")
    assert s.kv.num_free_blocks == 32 and not s.has_unfinished()
    assert s.abort("nope") is None


def test_stop_conditions() -> None:
    s = make()
    r = Request("e", [1, 2], SamplingParams(max_tokens=5, min_tokens=2), max_tokens=5,
                eos_token_ids=frozenset({9}))
    s.add_request(r)
    run_until(s, 2, token=9)  # two 9s: the first is under min_tokens
    assert r.status == RequestStatus.FINISHED_STOPPED and r.output_token_ids == [9, 9]
    r2 = Request("s", [1, 2], SamplingParams(max_tokens=5, stop_token_ids=[9]), max_tokens=5)
    s.add_request(r2)
    run_until(s, 1, token=9)
    assert r2.status == RequestStatus.FINISHED_STOPPED and r2.stop_reason == 9
    r3 = Request("l", [1, 2], SamplingParams(max_tokens=3, ignore_eos=True), max_tokens=3,
                 eos_token_ids=frozenset({9}))
    s.add_request(r3)
    run_until(s, 3, token=9)
    assert r3.status == RequestStatus.FINISHED_LENGTH and r3.num_output_tokens == 3
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_max_num_seqs() -> None:
    s = make(max_num_seqs=2)
    for i in range(5):
        s.add_request(req(f"r{i}", [i + 1] * 3, max_tokens=3))
    plan = s.schedule()
    assert len(plan.seqs) == 2 and s.num_waiting == 3
    outs, _ = run(s)
    assert len(outs) == 5


# -- the split: decode reserves, prefill holds ---------------------------------


def test_reserve_remote_then_land() -> None:
    s = make(num_blocks=16, block_size=4)
    r = req("r", list(range(1, 11)), max_tokens=4)  # 10 tokens: 3 blocks
    table = s.reserve_remote(r)
    assert table is not None and len(table) == 3
    assert s.kv.num_free_blocks == 13
    # Blocks being received are not in the prefix cache: nobody can hit them.
    other = req("o", list(range(1, 11)), max_tokens=1)
    assert s.kv.get_computed_blocks(other) == ([], 0)
    assert s.schedule().is_empty  # nothing runnable while the KV is in flight
    s.remote_kv_landed("r", Tok(42))
    assert r.output_token_ids == [42] and r.num_computed_tokens == 10
    hits, n = s.kv.get_computed_blocks(other)
    assert n == 8 and [b.block_id for b in hits] == table[:2]
    plan = s.schedule()
    assert [(q.start, q.num_new_tokens, q.sample) for q in plan.seqs] == [(10, 1, True)]
    run(s)
    assert s.kv.num_free_blocks == 16


def test_reserve_remote_uses_local_prefix_and_refuses_over_budget() -> None:
    s = make(num_blocks=6, block_size=4)
    s.add_request(req("warm", list(range(1, 10)), max_tokens=1))
    run(s)
    r = req("r", list(range(1, 10)) + [50, 51, 52], max_tokens=2)  # 12 tokens, 2 blocks cached
    table = s.reserve_remote(r)
    assert table is not None and r.num_computed_tokens == 8 and r.num_cached_tokens == 8
    big = req("big", list(range(100, 120)), max_tokens=2)  # needs 5 more blocks: only 3 free
    free = s.kv.num_free_blocks
    assert s.reserve_remote(big) is None
    assert s.kv.num_free_blocks == free and "big" not in s.requests


def test_remote_failure_recomputes_locally() -> None:
    s = make(num_blocks=16, block_size=4)
    r = req("r", list(range(1, 11)), max_tokens=3)
    table = s.reserve_remote(r)
    s.remote_kv_failed("r")
    plan = s.schedule()
    seq = plan.seqs[0]
    assert (seq.start, seq.num_new_tokens, seq.sample) == (0, 10, True)
    assert seq.block_ids == table  # the reserved blocks are reused, nothing over budget
    ref = make(num_blocks=16, block_size=4)
    ref.add_request(req("r", list(range(1, 11)), max_tokens=3))
    s.update(plan, {"r": Tok(toy_next(r.all_token_ids))})
    assert run(s)[0]["r"] == run(ref)[0]["r"]


def test_failed_transfers_of_one_prompt_recompute_in_their_own_blocks() -> None:
    """Two requests for one prompt both reserved with no hit and both lost their
    transfer: the first one admitted caches its blocks as it is planned; the
    second must not take those as hits on top of the table it already holds
    (that put its reserved, never-filled blocks where the prefix should be)."""
    s = make(num_blocks=16, block_size=4)
    a, b = req("a", list(range(1, 11)), max_tokens=3), req("b", list(range(1, 11)), max_tokens=3)
    tables = {"a": s.reserve_remote(a), "b": s.reserve_remote(b)}
    s.remote_kv_failed("a")
    s.remote_kv_failed("b")
    plan = s.schedule()
    assert [(q.request.request_id, q.start, q.num_new_tokens, q.block_ids) for q in plan.seqs] == \
        [("a", 0, 10, tables["a"]), ("b", 0, 10, tables["b"])]
    ref = make(num_blocks=16, block_size=4)
    ref.add_request(req("a", list(range(1, 11)), max_tokens=3))
    s.update(plan, {r: Tok(toy_next(list(range(1, 11)))) for r in "ab"})
    outs = run(s)[0]
    assert outs["a"] == outs["b"] == run(ref)[0]["a"]
    assert s.kv.num_free_blocks == 16


def test_abort_while_waiting_for_kv_frees_blocks() -> None:
    s = make(num_blocks=16, block_size=4)
    s.reserve_remote(req("r", list(range(1, 11))))
    s.abort("r")
    assert s.kv.num_free_blocks == 16 and not s.has_unfinished()


def test_hold_blocks_until_released() -> None:
    s = make(num_blocks=16, block_size=4)
    r = Request("p", list(range(1, 11)), SamplingParams(max_tokens=1), max_tokens=1, hold_blocks=True)
    s.add_request(r)
    run(s)
    assert r.status.finished and s.kv.block_ids("p") and s.kv.num_free_blocks == 13
    s.release("p")
    assert s.kv.num_free_blocks == 16
    r2 = Request("q", list(range(1, 11)), SamplingParams(max_tokens=1), max_tokens=1, hold_blocks=True)
    s.add_request(r2)
    run(s)
    s.abort("q")  # abort of a held request frees too
    assert s.kv.num_free_blocks == 16 and not s.held
