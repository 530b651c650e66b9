"""Prefix-aware routing: send a prompt's prefill to the worker that already
holds its leading blocks, unless that worker's queue costs more than the
recompute would.  The cluster prefix index says who holds what."""

from __future__ import annotations

import itertools
import logging
import random
from collections import Counter
from collections.abc import Callable, Sequence

from engine.hashing import extra_keys, hash_blocks
from services.frontend.router import LoadRouter, Route, RouteRequest, WorkerLoad
from services.index.base import IndexUnavailable, PrefixIndex

log = logging.getLogger("splitserve.frontend.router")


class KVAwareRouter(LoadRouter):
    """Prefill: cost = (prompt blocks the worker lacks) + (its queued prompt
    tokens / block size) x queue_weight, lowest wins.  Decode: LoadRouter's
    order, with the decode worker's own prefix hit as the tie-breaker (a hit
    there means fewer blocks to send).  If the index fails: load only."""

    def __init__(self, index: PrefixIndex, layout: Callable[[], tuple[int, str] | None],
                 local_prefill_threshold: int = 64, queue_weight: float = 1.0) -> None:
        super().__init__(local_prefill_threshold)
        self.index = index
        self.layout = layout  # () -> (block_size, model_id) once the workers have said
        self.queue_weight = queue_weight
        self.decisions: Counter[str] = Counter()  # reason -> count

    def route(self, request: RouteRequest, decodes: Sequence[WorkerLoad],
              prefills: Sequence[WorkerLoad]) -> Route | None:
        layout = self.layout()
        if not decodes:
            return None
        if layout is None:
            self.decisions["no_layout"] += 1
            return super().route(request, decodes, prefills)
        block_size, model_id = layout
        hashes = hash_blocks(request.prompt_token_ids, block_size,
                             extra_keys(model_id, request.cache_salt or None))
        try:
            hits = self.index.longest_prefix(hashes) if hashes else {}
        except IndexUnavailable as e:
            self.decisions["index_fallback"] += 1
            log.warning("prefix index unavailable, routing on load only: %s", e)
            return super().route(request, decodes, prefills)
        decode = min(decodes, key=lambda w: (w.total_blocks > 0 and w.free_blocks == 0,
                                             max(w.running + w.waiting, w.inflight),
                                             -hits.get(w.worker_id, 0), -w.free_blocks, w.address))
        prefill = None
        if len(request.prompt_token_ids) >= self.local_prefill_threshold and prefills:
            def cost(w: WorkerLoad) -> tuple[float, str]:
                queued = max(w.queued_prompt_tokens, w.inflight_prompt_tokens)
                return (len(hashes) - hits.get(w.worker_id, 0)
                        + queued / block_size * self.queue_weight, w.address)
            prefill = min(prefills, key=cost)
            self.decisions["prefix_hit" if hits.get(prefill.worker_id, 0) else "load"] += 1
        else:
            self.decisions["local_prefill"] += 1
        return Route(decode.address, prefill.address if prefill else "")


class RoundRobinRouter(LoadRouter):
    """For comparison: decode by load, prefill in turn."""

    def __init__(self, local_prefill_threshold: int = 64) -> None:
        super().__init__(local_prefill_threshold)
        self._turn = itertools.count()

    def pick_prefill(self, prefills: Sequence[WorkerLoad]) -> WorkerLoad | None:  # type: ignore[override]
        ordered = sorted(prefills, key=lambda w: w.address)
        return ordered[next(self._turn) % len(ordered)] if ordered else None


class RandomRouter(LoadRouter):
    """For comparison: decode by load, prefill at random."""

    def __init__(self, local_prefill_threshold: int = 64, seed: int | None = None) -> None:
        super().__init__(local_prefill_threshold)
        self._rng = random.Random(seed)

    def pick_prefill(self, prefills: Sequence[WorkerLoad]) -> WorkerLoad | None:  # type: ignore[override]
        return self._rng.choice(list(prefills)) if prefills else None
