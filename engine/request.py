"""A request's state inside one engine: its tokens, progress and status.  Torch-free."""

from __future__ import annotations

import enum
import logging
import random
import time
from collections.abc import Sequence
from typing import Any

from engine.vocab.hashing import BlockHash, hash_blocks
from engine.vocab.logprobs import PositionLogprobs
from engine.vocab.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KV = enum.auto()  # decode worker: blocks reserved, KV in flight
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything from here on is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    def __init__(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                 *, max_tokens: int, eos_token_ids: frozenset[int] = frozenset(),
                 priority: int = 0, arrival_time: float | None = None,
                 extra_keys: bytes = b"", rng: random.Random | None = None,
                 hold_blocks: bool = False, grammar: Any = None, lora: Any = None,
                 num_resumed_tokens: int = 0) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens  # params.max_tokens, or what max_model_len leaves
        self.eos_token_ids = eos_token_ids
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.extra_keys = extra_keys
        # Prefill worker: keep the blocks after finishing, until they are sent.
        self.hold_blocks = hold_blocks
        self.rng = rng if rng is not None else random.Random(params.seed)
        # A migrated request: the prompt's last tokens are output it generated
        # elsewhere; the sampler's penalties count them as output, not prompt.
        self.num_resumed_tokens = num_resumed_tokens
        self.all_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens not recomputed; set when first scheduled
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None  # monotonic; queue time ends here
        self.block_hashes: list[BlockHash] = []
        # Draft tokens proposed for the next step (speculative decoding); the
        # scheduler consumes them, so they never outlive one step.
        self.spec_token_ids: list[int] = []
        # Structured output: an engine.guided.Grammar that every output token advances.
        self.grammar = grammar
        # The engine's LoRAAdapter (engine.lora) this request runs with; None: the base model.
        self.lora = lora
        # params.prompt_logprobs: entry i is prompt token i + 1's, filled as the
        # prefill runs (or handed over whole by a prefill worker); None once it
        # went out with the first output, or when not asked for.
        self.prompt_logprobs: list[PositionLogprobs] | None = (
            [] if params.prompt_logprobs is not None else None)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_generated_from(self) -> int:
        """Position of the first token this request generated (here, or
        elsewhere before a migration: the resumed tokens end its prompt)."""
        return self.num_prompt_tokens - self.num_resumed_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.grammar is not None and not self.grammar.accept(token_id):
            # The sampler only draws allowed tokens; this would be an engine bug.
            log.error("request %s: token %d does not match its grammar", self.request_id, token_id)

    def update_block_hashes(self, block_size: int) -> list[BlockHash]:
        """Extend the chained hashes to every full block of the known tokens."""
        done = len(self.block_hashes)
        if (done + 1) * block_size <= self.num_tokens:
            parent = self.block_hashes[-1] if done else None
            self.block_hashes += hash_blocks(self.all_token_ids, block_size, self.extra_keys,
                                             parent, start=done * block_size)
        return self.block_hashes

    def sort_key(self, by_priority: bool) -> tuple[float, float]:
        return (self.priority if by_priority else 0, self.arrival_time)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens})")
