"""Adaptive draft length and speculation metrics.  Torch-free.

Each request keeps an exponential moving average of the fraction of its draft
tokens that were accepted.  It proposes ceil(k_max * EMA) tokens; below
min_acceptance_rate it stops proposing, except for a one-token probe after
probe_interval decode steps, an interval that doubles with each probe that
fails (up to MAX_PROBE_BACKOFF times) and resets once drafts are accepted
again, so a request whose text turns repetitive later speculates again.  A
verification costs more than a decode step on CPUs and in large batches, and
a draft model costs its own forwards, so this keeps speculation from slowing a
batch down by much when the drafts are poor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

EMA_WEIGHT = 0.5  # weight of the newest verification: two failures in a row pause a request
INITIAL_RATE = 0.5  # a new request proposes half of k_max at first
MAX_PROBE_BACKOFF = 8


@dataclass
class _Acceptance:
    rate: float
    probe_interval: int
    paused_steps: int = 0


class AdaptiveK:
    def __init__(self, k_max: int, enabled: bool, min_rate: float, probe_interval: int) -> None:
        self.k_max = k_max
        self.enabled = enabled
        self.min_rate = min_rate
        self.probe_interval = probe_interval
        self._state: dict[str, _Acceptance] = {}

    def _get(self, request_id: str) -> _Acceptance:
        st = self._state.get(request_id)
        if st is None:
            st = self._state[request_id] = _Acceptance(INITIAL_RATE, self.probe_interval)
        return st

    def num_to_propose(self, request_id: str) -> int:
        """Called once per decode step of a request that may speculate."""
        if not self.enabled:
            return self.k_max
        st = self._get(request_id)
        if st.rate >= self.min_rate:
            return max(1, min(self.k_max, math.ceil(self.k_max * st.rate)))
        st.paused_steps += 1
        if st.paused_steps < st.probe_interval:
            return 0
        st.paused_steps = 0
        st.probe_interval = min(2 * st.probe_interval, MAX_PROBE_BACKOFF * self.probe_interval)
        return 1

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        if not self.enabled or num_drafts == 0:
            return
        st = self._get(request_id)
        st.rate += EMA_WEIGHT * (num_accepted / num_drafts - st.rate)
        if st.rate >= self.min_rate:
            st.probe_interval = self.probe_interval

    def forget(self, request_id: str) -> None:
        self._state.pop(request_id, None)


@dataclass
class SpecDecodeStats:
    """Monotonic counters in vLLM's shape (a worker reports them as metrics)."""

    method: str
    num_drafts: int = 0  # verifications that carried at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k_max]

    def record(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification: accepted drafts + the one sampled after them."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
