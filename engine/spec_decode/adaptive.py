"""Adaptive draft length and speculation metrics.  Torch-free.

Each request keeps an exponential moving average of the fraction of its draft
tokens that were accepted.  It proposes ceil(k_max * EMA) tokens;
below min_acceptance_rate it stops proposing, except for a one-token probe
every probe_interval decode steps, so a request whose text turns repetitive
later starts speculating again.  A verification costs more than a decode step
on CPUs and in large batches, so this keeps speculation from slowing a batch
down by much when the drafts are poor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

EMA_WEIGHT = 0.3  # weight of the newest verification
INITIAL_RATE = 0.6  # optimistic: a new request proposes most of k_max at first


@dataclass
class _Acceptance:
    rate: float = INITIAL_RATE
    paused_steps: int = 0


class AdaptiveK:
    def __init__(self, k_max: int, enabled: bool, min_rate: float, probe_interval: int) -> None:
        self.k_max = k_max
        self.enabled = enabled
        self.min_rate = min_rate
        self.probe_interval = probe_interval
        self._state: dict[str, _Acceptance] = {}

    def num_to_propose(self, request_id: str) -> int:
        """Called once per decode step of a request that may speculate."""
        if not self.enabled:
            return self.k_max
        st = self._state.setdefault(request_id, _Acceptance())
        if st.rate >= self.min_rate:
            return max(1, min(self.k_max, math.ceil(self.k_max * st.rate)))
        st.paused_steps += 1
        if st.paused_steps >= self.probe_interval:
            st.paused_steps = 0
            return 1
        return 0

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        if not self.enabled or num_drafts == 0:
            return
        st = self._state.setdefault(request_id, _Acceptance())
        st.rate += EMA_WEIGHT * (num_accepted / num_drafts - st.rate)

    def rate(self, request_id: str) -> float:
        return self._state.get(request_id, _Acceptance()).rate

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
