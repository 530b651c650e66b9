"""Verification in the scheduler, driven by the toy model of test_scheduler
(next token = a pure function of the tokens so far) and a toy proposer whose
drafts are partly wrong: tokens match the run without drafts, rejected tokens
are rolled back, and no block holding one is ever cached.  No torch."""

from __future__ import annotations

from engine.request import Request
from engine.scheduler import Scheduler, SchedulerOutput
from tests.unit.test_scheduler import Tok, make, req, run, toy_next

WRONG = 999  # a token the toy model never produces


def toy_drafts(r: Request, k: int, step: int) -> list[int]:
    """The true continuation, with a wrong token at a position that varies by step."""
    toks = list(r.all_token_ids)
    out = []
    for j in range(k):
        t = WRONG if (step + j) % 3 == 2 else toy_next(toks)
        out.append(t)
        toks.append(t)
    return out


def verify(plan: SchedulerOutput) -> dict[str, list[Tok]]:
    """Greedy verification against the toy model: accept while drafts match."""
    out = {}
    for q in plan.seqs:
        if not q.sample:
            continue
        toks = list(q.request.all_token_ids)
        emitted = []
        for d in q.spec_token_ids:
            if d != toy_next(toks):
                break
            emitted.append(Tok(d))
            toks.append(d)
        emitted.append(Tok(toy_next(toks)))
        out[q.request.request_id] = emitted
    return out


def run_speculative(s: Scheduler, k: int) -> dict[str, list[int]]:
    outs: dict[str, list[int]] = {}
    for step in range(10_000):
        if not s.has_unfinished():
            return outs
        for r in s.running:
            if r.num_tokens - r.num_computed_tokens == 1:
                r.spec_token_ids = toy_drafts(r, k, step)
        plan = s.schedule()
        assert plan.num_tokens <= s.config.max_num_batched_tokens
        for q in plan.seqs:
            assert len(q.block_ids) * s.kv.block_size >= q.start + q.num_new_tokens
        for r in s.update(plan, verify(plan)):
            outs[r.request_id] = list(r.output_token_ids)
            if not r.status.finished:  # rolled back: no block beyond the real tokens
                assert len(s.kv.block_ids(r.request_id)) <= s.kv.blocks_needed(r.num_tokens)
                assert r.num_computed_tokens == r.num_tokens - 1
        for block in s.kv.pool.blocks:
            assert WRONG not in block.token_ids, "a block holding a rejected token was cached"
    raise AssertionError("did not finish")


def add_all(s: Scheduler) -> None:
    shared = list(range(1, 14))  # a shared prefix: prefix caching in play
    for i in range(8):
        s.add_request(req(f"r{i}", shared + [20 + i] * (i % 4 + 1), max_tokens=20 + i))


def test_same_tokens_as_without_drafts_with_chunking_caching_and_preemption() -> None:
    s = make(num_blocks=64, max_num_batched_tokens=24)
    add_all(s)
    ref, _ = run(s)
    for num_blocks in (64, 14):  # 14: preemptions happen
        spec = make(num_blocks=num_blocks, max_num_batched_tokens=24)
        add_all(spec)
        assert run_speculative(spec, k=4) == ref
        assert spec.kv.num_free_blocks == spec.kv.num_blocks
        assert (spec.num_preemptions > 0) == (num_blocks == 14)


def test_plan_carries_drafts_within_budget_and_max_tokens() -> None:
    s = make(max_num_batched_tokens=64)
    s.add_request(req("a", [1, 2, 3], max_tokens=4))
    s.update(plan := s.schedule(), {"a": Tok(7)})
    a = s.running[0]
    a.spec_token_ids = [5, 6, 7, 8]
    plan = s.schedule()
    # max_tokens 4, one token out: at most 2 drafts (the third token is the one sampled after them)
    (seq,) = plan.seqs
    assert seq.spec_token_ids == [5, 6] and seq.num_new_tokens == 3 and seq.sample
    assert a.spec_token_ids == []  # consumed
    s.update(plan, {"a": [Tok(5), Tok(9)]})  # one accepted, then 9
    assert a.output_token_ids == [7, 5, 9] and a.num_computed_tokens == a.num_tokens - 1


def test_drafts_are_dropped_rather_than_preempting() -> None:
    s = make(num_blocks=2, block_size=4)
    s.add_request(req("a", [1, 2, 3, 4, 5, 6], max_tokens=2))
    s.update(s.schedule(), {"a": Tok(7)})  # 7 tokens: 2 blocks, all of the pool
    s.running[0].spec_token_ids = [8, 9, 10]
    plan = s.schedule()
    assert plan.seqs[0].spec_token_ids == [] and not plan.preempted
    assert plan.seqs[0].num_new_tokens == 1


def test_rejection_frees_the_block_it_emptied() -> None:
    s = make(num_blocks=8, block_size=4)
    s.add_request(req("a", [1, 2, 3], max_tokens=10))
    s.update(s.schedule(), {"a": Tok(4)})  # 4 tokens, 3 computed: one block
    a = s.running[0]
    a.spec_token_ids = [5, 6, 7, 8]  # positions 4..7 need a second block
    plan = s.schedule()
    assert len(plan.seqs[0].block_ids) == 2
    free_during = s.kv.num_free_blocks
    s.update(plan, {"a": [Tok(30)]})  # the first draft is rejected: 5 tokens, needs 2 blocks
    assert len(s.kv.block_ids("a")) == 2 and s.kv.num_free_blocks == free_during
    a.spec_token_ids = [31, 32, 33, 34, 35]
    s.update(plan := s.schedule(), {"a": [Tok(40)]})  # 6 tokens: the third block goes back
    assert len(s.kv.block_ids("a")) == 2 and s.kv.num_free_blocks == free_during
    assert a.output_token_ids == [4, 30, 40]


def test_stop_token_among_accepted_drafts_ends_there() -> None:
    s = make()
    r = req("a", [1, 2, 3], max_tokens=10)
    r.params.stop_token_ids = [6]
    s.add_request(r)
    s.update(s.schedule(), {"a": Tok(4)})
    r.spec_token_ids = [5, 6, 7]
    s.update(s.schedule(), {"a": [Tok(5), Tok(6), Tok(7), Tok(8)]})
    assert r.output_token_ids == [4, 5, 6] and r.status.finished
    assert s.kv.num_free_blocks == s.kv.num_blocks
