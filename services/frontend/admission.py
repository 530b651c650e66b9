"""Admission control: bounded queues at the door instead of unbounded ones
inside.  A request waits from admission to its first token; past the limits
on waiting requests, their prompt tokens, or one tenant's concurrent
requests, new ones get 429 (RESOURCE_EXHAUSTED on gRPC) at once, with a
Retry-After hint, and nothing of them reaches a worker.  A request with
several choices (prompts x n) waits as that many requests: each is a worker
stream of its own."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from services.frontend.errors import APIError


@dataclass(frozen=True)
class Limits:
    max_waiting_requests: int = 0  # 0: no limit
    max_waiting_prompt_tokens: int = 0
    max_requests_per_tenant: int = 0  # concurrent, per API key (or `user`)
    retry_after_seconds: float = 1.0


class Admission:
    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.waiting = 0
        self.waiting_tokens = 0
        self.per_tenant: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()  # reason -> count

    def admit(self, prompt_tokens: int, tenant: str | None, requests: int = 1) -> Ticket:
        """prompt_tokens: of all its choices; requests: its choices (prompts x n)."""
        lim = self.limits
        if lim.max_waiting_requests and self.waiting + requests > lim.max_waiting_requests:
            self._reject("waiting_requests", f"{self.waiting} requests are waiting for their first token "
                         f"(limit {lim.max_waiting_requests}; this one counts as {requests})")
        if (lim.max_waiting_prompt_tokens and self.waiting
                and self.waiting_tokens + prompt_tokens > lim.max_waiting_prompt_tokens):
            self._reject("waiting_prompt_tokens", f"{self.waiting_tokens} prompt tokens are waiting "
                         f"(limit {lim.max_waiting_prompt_tokens})")
        if lim.max_requests_per_tenant and tenant and self.per_tenant[tenant] >= lim.max_requests_per_tenant:
            self._reject("tenant_requests", f"this API key or user has {self.per_tenant[tenant]} requests "
                         f"in flight (limit {lim.max_requests_per_tenant})")
        self.waiting += requests
        self.waiting_tokens += prompt_tokens
        if tenant:
            self.per_tenant[tenant] += 1
        return Ticket(self, prompt_tokens, tenant, requests)

    def _reject(self, reason: str, why: str) -> None:
        self.rejected[reason] += 1
        raise APIError(429, f"overloaded: {why}; retry in {self.limits.retry_after_seconds:g} s",
                       None, "overloaded", retry_after=self.limits.retry_after_seconds)


class Ticket:
    """One admitted request's place: `started` at its first token, `release`
    when it ends (both idempotent)."""

    __slots__ = ("_admission", "_tokens", "_tenant", "_requests", "_waiting", "_open")

    def __init__(self, admission: Admission, prompt_tokens: int, tenant: str | None,
                 requests: int = 1) -> None:
        self._admission = admission
        self._tokens = prompt_tokens
        self._tenant = tenant
        self._requests = requests
        self._waiting = self._open = True

    def started(self) -> None:
        if self._waiting:
            self._waiting = False
            self._admission.waiting -= self._requests
            self._admission.waiting_tokens -= self._tokens

    def release(self) -> None:
        self.started()
        if self._open:
            self._open = False
            if self._tenant:
                per = self._admission.per_tenant
                per[self._tenant] -= 1
                if per[self._tenant] <= 0:
                    del per[self._tenant]
