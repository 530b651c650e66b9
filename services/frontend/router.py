"""Which decode worker runs a request, and which prefill worker (if any) computes its prompt.

The router is pure: it sees snapshots of the healthy workers' load and returns
addresses.  This one routes on load only; a prefix-aware router (block hashes
against the cluster prefix index) implements the same `Router` protocol.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class WorkerLoad:
    """One healthy worker as the router sees it: its last load report plus the
    requests this frontend has sent it and not yet seen finish (`inflight`), which
    covers the gap between two reports."""

    address: str
    worker_id: str = ""
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    queued_prompt_tokens: int = 0
    inflight: int = 0
    inflight_prompt_tokens: int = 0


@dataclass(frozen=True)
class RouteRequest:
    request_id: str
    prompt_token_ids: Sequence[int]
    cache_salt: str = ""
    lora_id: str = ""  # the adapter's digest, a block-hash key; empty: the base model
    prefix_cache: bool = True  # False: the request computes its whole prompt (it asks for prompt logprobs)


@dataclass(frozen=True)
class Route:
    decode: str  # decode worker address
    prefill: str = ""  # prefill worker address; empty: the decode worker prefills locally
    prefill_tokens: int | None = None  # prompt tokens the prefill worker is expected to compute; None: all


class Router(Protocol):
    def route(self, request: RouteRequest, decodes: Sequence[WorkerLoad],
              prefills: Sequence[WorkerLoad]) -> Route | None:
        """None when no decode worker can take the request."""
        ...


class LoadRouter:
    """Decode: fewest requests (reported running + waiting, or this frontend's
    in-flight count when higher), then most free KV blocks; full workers last.
    Prefill: fewest queued prompt tokens.  Prompts under `local_prefill_threshold`
    tokens, or no healthy prefill worker: prefill on the decode worker."""

    reason = "load"  # what decides the prefill worker, for `decisions`

    def __init__(self, local_prefill_threshold: int = 64) -> None:
        self.local_prefill_threshold = local_prefill_threshold
        self.decisions: Counter[str] = Counter()  # reason -> requests routed for it

    def route(self, request: RouteRequest, decodes: Sequence[WorkerLoad],
              prefills: Sequence[WorkerLoad]) -> Route | None:
        decode = self.pick_decode(decodes)
        if decode is None:
            return None
        prefill = None
        if len(request.prompt_token_ids) >= self.local_prefill_threshold:
            prefill = self.pick_prefill(prefills)
        self.decisions[self.reason if prefill else "local_prefill"] += 1
        return Route(decode.address, prefill.address if prefill else "")

    @staticmethod
    def pick_decode(decodes: Sequence[WorkerLoad]) -> WorkerLoad | None:
        def key(w: WorkerLoad) -> tuple[bool, int, int, str]:
            full = w.total_blocks > 0 and w.free_blocks == 0
            return full, max(w.running + w.waiting, w.inflight), -w.free_blocks, w.address

        return min(decodes, key=key, default=None)

    def pick_prefill(self, prefills: Sequence[WorkerLoad]) -> WorkerLoad | None:
        def key(w: WorkerLoad) -> tuple[int, int, str]:
            queued = max(w.queued_prompt_tokens, w.inflight_prompt_tokens)
            return queued, w.running + w.waiting, w.address

        return min(prefills, key=key, default=None)
