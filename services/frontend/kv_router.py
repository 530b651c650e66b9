"""Prefix-aware routing: send a prompt's prefill to the worker that already
holds its leading blocks, unless that worker's queue costs more than the
recompute would.  The cluster prefix index says who holds what."""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Callable, Sequence

from engine.vocab.hashing import extra_keys, hash_blocks
from services.frontend.router import LoadRouter, Route, RouteRequest, WorkerLoad
from services.index.base import IndexUnavailable, PrefixIndex

log = logging.getLogger("splitserve.frontend.router")


class KVAwareRouter(LoadRouter):
    """Prefill: cost = (prompt blocks the worker lacks) + queue_weight x (its
    queue: prompt tokens still to compute / block size, plus request_cost
    blocks per queued request for what every request costs whatever its
    cache hit: a step, sampling, sending its KV), lowest wins.  Decode:
    LoadRouter's order, with the decode worker's own prefix hit as the
    tie-breaker (a hit there means fewer blocks to send); where that worker
    holds all of the prompt but less than local_prefill_threshold tokens, and
    more of it than any prefill worker, it prefills the rest itself.  If the
    index fails: load only."""

    def __init__(self, index: PrefixIndex, layout: Callable[[], tuple[int, str] | None],
                 local_prefill_threshold: int = 64, queue_weight: float = 1.0,
                 retry_after_s: float = 0.5, request_cost: float = 2.0) -> None:
        super().__init__(local_prefill_threshold)
        self.index = index
        self.layout = layout  # () -> (block_size, cache_model_key) once the workers have said
        self.queue_weight = queue_weight
        self.request_cost = request_cost
        self.index_fallbacks = 0  # routes made without the index because it failed
        # After a failed lookup the index is left alone for a moment: a slow store
        # would otherwise cost its timeout on every request (the lookup runs on
        # the frontend's event loop).
        self.retry_after_s = retry_after_s
        self._index_down_until = 0.0
        self.observe_lookup: Callable[[float, bool], None] | None = None  # (seconds, ok) per lookup

    def route(self, request: RouteRequest, decodes: Sequence[WorkerLoad],
              prefills: Sequence[WorkerLoad]) -> Route | None:
        if not decodes:
            return None
        remote = len(request.prompt_token_ids) >= self.local_prefill_threshold and bool(prefills)
        layout = self.layout()
        if layout is None:  # no worker has said its block size yet
            return self._by_load(decodes, prefills if remote else (), "no_layout")
        block_size, model_key = layout
        hashes = hash_blocks(request.prompt_token_ids, block_size,
                             extra_keys(model_key, request.cache_salt or None, request.lora_id or None))
        try:
            hits = self._lookup(hashes) if hashes else {}
        except IndexUnavailable:
            self.index_fallbacks += 1
            return self._by_load(decodes, prefills if remote else (), "index_fallback")
        decode = min(decodes, key=lambda w: (w.total_blocks > 0 and w.free_blocks == 0,
                                             max(w.running + w.waiting, w.inflight),
                                             -hits.get(w.worker_id, 0), -w.free_blocks, w.address))
        if not remote:
            self.decisions["local_prefill"] += 1
            return Route(decode.address)
        held = hits.get(decode.worker_id, 0)
        best_hit = max(hits.get(w.worker_id, 0) for w in prefills)
        if (request.prefix_cache and held > best_hit
                and len(request.prompt_token_ids) - held * block_size < self.local_prefill_threshold):
            # The decode worker holds all but a short tail of the prompt, and more
            # of it than any prefill worker (a chat's next turn: it decoded the
            # earlier replies): it computes the tail itself, where a prefill worker
            # would recompute what it lacks and send blocks the decode worker has.
            # (Where a prefill worker holds as much, it computes the same tail and
            # the decode worker's compute stays with decoding.)
            self.decisions["decode_prefix_hit"] += 1
            return Route(decode.address)

        def cost(w: WorkerLoad) -> tuple[float, str]:
            queued_tokens = max(w.queued_prompt_tokens, w.inflight_prompt_tokens)
            queued_requests = max(w.running + w.waiting, w.inflight)
            queue = queued_tokens / block_size + queued_requests * self.request_cost
            return len(hashes) - hits.get(w.worker_id, 0) + queue * self.queue_weight, w.address

        prefill = min(prefills, key=cost)
        hit = hits.get(prefill.worker_id, 0)
        # load_over_affinity: a worker holding more of the prefix was too busy.
        reason = "load_over_affinity" if hit < best_hit else "prefix_hit" if hit else "load"
        self.decisions[reason] += 1
        return Route(decode.address, prefill.address,
                     prefill_tokens=len(request.prompt_token_ids) - hit * block_size)

    def _by_load(self, decodes: Sequence[WorkerLoad], prefills: Sequence[WorkerLoad],
                 reason: str) -> Route | None:
        decode = self.pick_decode(decodes)
        assert decode is not None
        prefill = self.pick_prefill(prefills)
        self.decisions[reason if prefill else "local_prefill"] += 1
        return Route(decode.address, prefill.address if prefill else "")

    def _lookup(self, hashes: list[bytes]) -> dict[str, int]:
        if time.monotonic() < self._index_down_until:
            raise IndexUnavailable("failed moments ago; not asked again yet")
        start = time.perf_counter()
        try:
            hits = self.index.longest_prefix(hashes)
        except IndexUnavailable as e:
            if self._index_down_until == 0.0:
                log.warning("prefix index unavailable, routing on load only: %s", e)
            self._index_down_until = time.monotonic() + self.retry_after_s
            self._observe(start, ok=False)
            raise
        if self._index_down_until:
            log.info("prefix index answering again")
            self._index_down_until = 0.0
        self._observe(start, ok=True)
        return hits

    def _observe(self, start: float, ok: bool) -> None:
        if self.observe_lookup is not None:
            self.observe_lookup(time.perf_counter() - start, ok)


class RoundRobinRouter(LoadRouter):
    """For comparison: decode by load, prefill in turn."""

    reason = "round_robin"

    def __init__(self, local_prefill_threshold: int = 64) -> None:
        super().__init__(local_prefill_threshold)
        self._turn = itertools.count()

    def pick_prefill(self, prefills: Sequence[WorkerLoad]) -> WorkerLoad | None:  # type: ignore[override]
        ordered = sorted(prefills, key=lambda w: w.address)
        return ordered[next(self._turn) % len(ordered)] if ordered else None


class RandomRouter(LoadRouter):
    """For comparison: decode by load, prefill at random."""

    reason = "random"

    def __init__(self, local_prefill_threshold: int = 64, seed: int | None = None) -> None:
        super().__init__(local_prefill_threshold)
        self._rng = random.Random(seed)

    def pick_prefill(self, prefills: Sequence[WorkerLoad]) -> WorkerLoad | None:  # type: ignore[override]
        return self._rng.choice(list(prefills)) if prefills else None
