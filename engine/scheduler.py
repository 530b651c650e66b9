"""Continuous batching with chunked prefill, priorities and preemption.

Two verbs: schedule() plans one step, update() takes the step's sampled
tokens.  No I/O, no torch.  Each step serves the running requests first (one
token each for decodes, the next chunk for partially prefilled prompts), then
admits waiting requests into what is left of the token budget, so a long prompt
delays running decodes by at most one chunk.

Speculative decoding: a decoding request that carries draft tokens
(`Request.spec_token_ids`, set by the engine's proposer) is scheduled for its
last token plus the drafts, all verified in one forward.  update() appends the
accepted tokens and rolls the rest back: num_computed_tokens rewinds and blocks
left holding only rejected tokens are freed.  Drafts never cause a preemption:
when the pool is short, the request is verified without them.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.block_pool import Block
from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus


class SampledLike(Protocol):
    token_id: int


@dataclass
class ScheduledSeq:
    request: Request
    start: int  # tokens already in the cache before this step
    num_new_tokens: int  # query tokens this step
    block_ids: list[int]
    sample: bool  # the chunk reaches the last known token: sample the next one
    # Draft tokens verified after the last known token (their positions follow it).
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def is_decode(self) -> bool:
        return self.num_new_tokens == 1 and self.start > 0

    @property
    def rows_as_decodes(self) -> bool:
        """Attend each query token as a one-token row, the way decode steps do:
        drafts under verification, and output tokens computed again (relayed
        by a migration, or after a preemption).  Their KV then holds the bits
        decoding wrote, so a resumed seeded stream goes on exactly."""
        return bool(self.spec_token_ids) or (self.start > 0 and self.start >= self.request.num_generated_from)

    @property
    def attends_as_decode(self) -> bool:
        """Its rows take the decode path: one output token (not a prompt's
        token, which always takes the prefill path), or rows_as_decodes."""
        one_output = self.num_new_tokens == 1 and self.start >= self.request.num_generated_from
        return self.rows_as_decodes or one_output


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


def chunk_end(req: Request, start: int, budget: int) -> int:
    """Tokens to compute from `start` this step: up to the budget, and a chunk
    of the prompt never runs into output tokens computed again (those are
    computed as decode rows: ScheduledSeq.rows_as_decodes)."""
    end = min(req.num_tokens, start + budget)
    if start < req.num_generated_from:
        end = min(end, req.num_generated_from)
    return end - start


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.by_priority = config.policy == "priority"
        self.running: list[Request] = []
        # heap of (sort key, seq no, request); aborted entries are skipped lazily
        self._waiting: list[tuple[tuple[float, float], int, Request]] = []
        self._seq = 0
        self.requests: dict[str, Request] = {}
        # Prefill worker: finished requests whose blocks stay until their KV is sent.
        self.held: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- intake -------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        self._check_fits(req)
        self.requests[req.request_id] = req
        self._push_waiting(req)

    def _check_fits(self, req: Request) -> None:
        """Refuse up front what could never run, so nothing deadlocks later."""
        if req.request_id in self.requests or req.request_id in self.held:
            raise ValueError(f"request_id: {req.request_id!r} is already in the engine")
        if req.num_prompt_tokens + req.max_tokens > self.config.max_model_len:
            raise ValueError(
                f"max_tokens: prompt ({req.num_prompt_tokens} tokens) + max_tokens "
                f"({req.max_tokens}) exceeds max_model_len ({self.config.max_model_len})")
        need = self.kv.blocks_needed(req.num_prompt_tokens + req.max_tokens)
        if need > self.kv.num_blocks:
            raise ValueError(f"prompt: needs {need} KV blocks, the cache has {self.kv.num_blocks}")

    # -- remote prefill (decode worker side) ----------------------------------

    def reserve_remote(self, req: Request) -> list[int] | None:
        """Reserve blocks for the whole prompt before any KV is sent
        (invariants 2 and 3).  Local prefix hits are kept; the rest are
        allocated but not cached until the KV has landed.  Returns the block
        table, or None when the pool can't supply it now (nothing changes)."""
        self._check_fits(req)
        hits, num_hit_tokens = self.kv.get_computed_blocks(req)
        if self.kv.allocate_slots(req, req.num_tokens - num_hit_tokens, hits, cache=False) is None:
            return None
        req.num_computed_tokens = num_hit_tokens
        req.num_cached_tokens = num_hit_tokens
        req.first_scheduled_time = time.monotonic()
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.requests[req.request_id] = req
        return self.kv.block_ids(req.request_id)

    def remote_kv_landed(self, request_id: str, first_token: SampledLike) -> Request:
        """Every prompt block is in place: register them, take the prefill
        worker's first token and join the running batch."""
        req = self.requests[request_id]
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KV, req
        req.num_computed_tokens = req.num_tokens
        self.kv.cache_full_blocks(req, req.num_tokens)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        if not req.params.greedy:
            req.rng.random()  # the prefill worker drew token 1's u from the same seeded RNG
        req.append_output(first_token.token_id)
        status = self._check_stop(req, first_token.token_id)
        if status is not None:
            self.finish(req, status)
        return req

    def remote_kv_failed(self, request_id: str) -> Request:
        """Recompute policy: prefill here instead.  The reserved blocks stay
        with the request; whatever landed in them is overwritten."""
        req = self.requests[request_id]
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KV, req
        req.status = RequestStatus.WAITING
        self._push_waiting(req)
        return req

    def _push_waiting(self, req: Request) -> None:
        self._seq += 1
        heapq.heappush(self._waiting, (req.sort_key(self.by_priority), self._seq, req))

    def _peek_waiting(self) -> Request | None:
        while self._waiting and self._waiting[0][2].status.finished:
            heapq.heappop(self._waiting)
        return self._waiting[0][2] if self._waiting else None

    @property
    def num_waiting(self) -> int:
        return sum(1 for *_, r in self._waiting if not r.status.finished)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- planning -----------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self.running.sort(key=lambda r: r.sort_key(self.by_priority))
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            drafts = self._take_drafts(req, budget)
            num_new = chunk_end(req, req.num_computed_tokens, budget) + len(drafts)
            while self.kv.allocate_slots(req, num_new) is None:
                if drafts:  # speculation never preempts anyone
                    num_new -= len(drafts)
                    drafts = []
                    continue
                # Victim: lowest priority, then latest arrival (the list's tail).
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.seqs.append(self._plan(req, num_new, drafts))
                budget -= num_new
                i += 1
                continue
            break  # req itself was preempted: nothing after it can run either

        if not out.preempted:
            self._admit(out, budget)
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self._peek_waiting()
            if req is None:
                return
            hits: list[Block] = []
            num_hit_tokens = 0
            # A request back from a failed transfer holds the table it reserved (its
            # own hits first): prefix hits come before any other block, never after.
            if req.num_computed_tokens == 0 and not self.kv.holds_blocks(req.request_id):
                hits, num_hit_tokens = self.kv.get_computed_blocks(req)
            num_new = chunk_end(req, req.num_computed_tokens + num_hit_tokens, budget)
            if self.kv.allocate_slots(req, num_new, hits) is None:
                return  # head of line waits for blocks
            heapq.heappop(self._waiting)
            req.num_computed_tokens += num_hit_tokens
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit_tokens
                req.first_scheduled_time = time.monotonic()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.seqs.append(self._plan(req, num_new))
            budget -= num_new

    def _take_drafts(self, req: Request, budget: int) -> list[int]:
        """The request's drafts that fit this step: only for a decode, within
        the token budget, and never past max_tokens or max_model_len (so the
        blocks _check_fits promised always suffice)."""
        drafts, req.spec_token_ids = req.spec_token_ids, []
        if not drafts or req.num_tokens - req.num_computed_tokens != 1:
            return []
        room = min(budget - 1, req.max_tokens - req.num_output_tokens - 1,
                   self.config.max_model_len - req.num_tokens - 1)
        return drafts[:max(room, 0)]

    def _plan(self, req: Request, num_new: int, drafts: list[int] | None = None) -> ScheduledSeq:
        start = req.num_computed_tokens
        drafts = drafts or []
        return ScheduledSeq(req, start, num_new, self.kv.block_ids(req.request_id),
                            sample=start + num_new - len(drafts) == req.num_tokens,
                            spec_token_ids=drafts)

    def _preempt(self, req: Request) -> None:
        """Preempt by recompute: free the blocks, start over later (the prefix
        cache usually keeps most of them)."""
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self._push_waiting(req)

    # -- results ------------------------------------------------------------

    def update(self, out: SchedulerOutput,
               sampled: Mapping[str, SampledLike | Sequence[SampledLike]]) -> list[Request]:
        """Advance every scheduled request; append its sampled token (or, when
        it verified drafts, the accepted drafts and the token after them) and
        finish those that hit a stop condition.  Returns the requests with new
        tokens."""
        changed = []
        for seq in out.seqs:
            req = seq.request
            if req.status.finished:  # aborted while the step ran
                continue
            got = sampled.get(req.request_id) if seq.sample else None
            if got is None:
                req.num_computed_tokens = seq.start + seq.num_new_tokens
                continue
            toks = list(got) if isinstance(got, Sequence) else [got]
            self._append_tokens(seq, toks)
            changed.append(req)
        return changed

    def _append_tokens(self, seq: ScheduledSeq, toks: list[SampledLike]) -> None:
        """toks: the accepted drafts, then one sampled token.  The KV of the
        accepted drafts is valid (it was computed from the right tokens); the
        rejected drafts' KV is rolled back."""
        req = seq.request
        status = None
        for tok in toks:
            req.append_output(tok.token_id)
            status = self._check_stop(req, tok.token_id)
            if status is not None:
                break
        num_rejected = len(seq.spec_token_ids) - (len(toks) - 1)
        req.num_computed_tokens = min(seq.start + seq.num_new_tokens - num_rejected, req.num_tokens - 1)
        if status is not None:
            self.finish(req, status)
        elif seq.spec_token_ids:
            self.kv.trim(req, req.num_tokens)

    def _check_stop(self, req: Request, token_id: int) -> RequestStatus | None:
        p = req.params
        if req.num_output_tokens >= p.min_tokens:
            if token_id in req.eos_token_ids and not p.ignore_eos:
                req.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if p.stop_token_ids and token_id in p.stop_token_ids:
                req.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if req.grammar is not None and req.grammar.terminated:  # complete, even with ignore_eos
            req.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End a request in any way; frees its blocks exactly once (or holds
        them for release() when the request asked to)."""
        if req.status.finished:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        req.status = status
        self.requests.pop(req.request_id, None)
        if req.hold_blocks and status != RequestStatus.FINISHED_ABORTED:
            self.held[req.request_id] = req
        else:
            self.kv.free(req)

    def release(self, request_id: str) -> None:
        """Free a held request's blocks (its KV has been sent, or never will be)."""
        req = self.held.pop(request_id, None)
        if req is not None:
            self.kv.free(req)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, RequestStatus.FINISHED_ABORTED)
        self.release(request_id)
        return req
