"""The prefix-aware router over the embedded index: milliseconds, no processes."""

from __future__ import annotations

import time

from engine.vocab.cache_events import CacheEvent
from engine.vocab.hashing import extra_keys, hash_blocks
from services.frontend.kv_router import KVAwareRouter, RoundRobinRouter
from services.frontend.router import RouteRequest, WorkerLoad
from services.index.base import IndexUnavailable, PrefixIndex
from services.index.embedded import EmbeddedPrefixIndex

BS, MODEL = 4, "m"
PROMPT = list(range(100, 140))  # 10 blocks
D = [WorkerLoad("d0:1", "d0", free_blocks=100, total_blocks=100)]


def p(name: str, queued: int = 0) -> WorkerLoad:
    return WorkerLoad(f"{name}:1", name, queued_prompt_tokens=queued, free_blocks=10, total_blocks=10)


def index_with(worker: str, num_blocks: int, salt: str | None = None) -> EmbeddedPrefixIndex:
    idx = EmbeddedPrefixIndex()
    hashes = hash_blocks(PROMPT, BS, extra_keys(MODEL, salt))[:num_blocks]
    idx.apply(worker, [CacheEvent("stored", hashes)])
    idx.heartbeat(worker, 60)
    return idx


def route(idx: PrefixIndex, prefills: list[WorkerLoad], salt: str = "") -> str:
    router = KVAwareRouter(idx, lambda: (BS, MODEL), local_prefill_threshold=8)
    r = router.route(RouteRequest("r", PROMPT, salt), D, prefills)
    assert r is not None
    return r.prefill


def test_prefill_goes_where_the_prefix_is() -> None:
    assert route(index_with("p1", 8), [p("p0"), p("p1")]) == "p1:1"


def test_cache_salt_is_part_of_the_hash() -> None:
    idx = index_with("p1", 8)
    assert route(idx, [p("p0"), p("p1")], salt="tenant") == "p0:1"  # no hit: tie -> by address


def test_lora_adapter_is_part_of_the_hash() -> None:
    """Blocks an adapter computed route its requests, and only its requests, there."""
    idx = EmbeddedPrefixIndex()
    idx.apply("p1", [CacheEvent("stored", hash_blocks(PROMPT, BS, extra_keys(MODEL, None, "digest1"))[:8])])
    idx.heartbeat("p1", 60)
    router = KVAwareRouter(idx, lambda: (BS, MODEL), local_prefill_threshold=8)
    for lora_id, want in (("digest1", "p1:1"), ("", "p0:1"), ("digest2", "p0:1")):
        r = router.route(RouteRequest("r", PROMPT, "", lora_id), D, [p("p0"), p("p1")])
        assert r is not None and r.prefill == want, lora_id


def test_load_beats_affinity_when_the_queue_is_long() -> None:
    # p1 saves 8 blocks of recompute but has 200 tokens = 50 blocks queued.
    router = KVAwareRouter(index_with("p1", 8), lambda: (BS, MODEL), local_prefill_threshold=8)
    r = router.route(RouteRequest("r", PROMPT), D, [p("p0"), p("p1", queued=200)])
    assert r is not None and r.prefill == "p0:1"
    assert router.decisions == {"load_over_affinity": 1}


def test_every_lookup_is_observed_with_its_outcome() -> None:
    seen: list[tuple[float, bool]] = []
    router = KVAwareRouter(index_with("p1", 8), lambda: (BS, MODEL), local_prefill_threshold=8)
    router.observe_lookup = lambda seconds, ok: seen.append((seconds, ok))
    router.route(RouteRequest("r", PROMPT), D, [p("p0"), p("p1")])
    assert len(seen) == 1 and seen[0][1] and 0 <= seen[0][0] < 1
    assert router.decisions == {"prefix_hit": 1} and router.index_fallbacks == 0


def test_index_down_falls_back_to_load() -> None:
    class Down(EmbeddedPrefixIndex):
        def longest_prefix(self, block_hashes, worker_ids=None):  # type: ignore[no-untyped-def]
            raise IndexUnavailable("down")

    router = KVAwareRouter(Down(), lambda: (BS, MODEL), local_prefill_threshold=8)
    r = router.route(RouteRequest("r", PROMPT), D, [p("p0", queued=50), p("p1")])
    assert r is not None and r.prefill == "p1:1"
    assert router.decisions == {"index_fallback": 1} and router.index_fallbacks == 1
    short = router.route(RouteRequest("r", PROMPT[:4]), D, [p("p0"), p("p1")])
    assert short is not None and short.prefill == ""  # prefilled locally, but the lookup still failed
    assert router.decisions["local_prefill"] == 1 and router.index_fallbacks == 2


def test_a_failing_index_is_not_asked_again_for_a_moment() -> None:
    class Flaky(EmbeddedPrefixIndex):
        calls = 0
        down = True

        def longest_prefix(self, block_hashes, worker_ids=None):  # type: ignore[no-untyped-def]
            self.calls += 1
            if self.down:
                raise IndexUnavailable("timeout")
            return {"p1": 8}

    idx = Flaky()
    router = KVAwareRouter(idx, lambda: (BS, MODEL), local_prefill_threshold=8, retry_after_s=0.05)
    for _ in range(5):
        router.route(RouteRequest("r", PROMPT), D, [p("p0"), p("p1")])
    assert idx.calls == 1 and router.index_fallbacks == 5  # one timeout paid, not five
    idx.down = False
    time.sleep(0.06)
    r = router.route(RouteRequest("r", PROMPT), D, [p("p0"), p("p1")])
    assert r is not None and r.prefill == "p1:1" and router.decisions["prefix_hit"] == 1


def test_short_prompts_stay_local_and_round_robin_turns() -> None:
    router = KVAwareRouter(index_with("p1", 8), lambda: (BS, MODEL), local_prefill_threshold=100)
    r = router.route(RouteRequest("r", PROMPT), D, [p("p0"), p("p1")])
    assert r is not None and r.prefill == ""
    rr = RoundRobinRouter(8)
    picks = [rr.route(RouteRequest("r", PROMPT), D, [p("p0"), p("p1")]) for _ in range(4)]
    assert [x.prefill for x in picks if x] == ["p0:1", "p1:1", "p0:1", "p1:1"]
    assert rr.decisions == {"round_robin": 4}


def test_a_flood_on_one_hot_prefix_spills_over_once_the_queue_costs_more() -> None:
    # p1 holds all 10 blocks; each queued request there costs 8 tokens (2 blocks)
    # of suffix plus request_cost 2: 4 blocks.  Recomputing on p0 costs 10.
    router = KVAwareRouter(index_with("p1", 10), lambda: (BS, MODEL), local_prefill_threshold=8)

    def pick(queued: int) -> str:
        hot = WorkerLoad("p1:1", "p1", inflight=queued, inflight_prompt_tokens=8 * queued)
        r = router.route(RouteRequest("r", PROMPT), D, [p("p0"), hot])
        assert r is not None
        return r.prefill

    assert [pick(k) for k in range(4)] == ["p1:1", "p1:1", "p1:1", "p0:1"]  # 0, 4, 8 < 10 < 12
    r = router.route(RouteRequest("r", PROMPT), D, [p("p0"), p("p1")])
    assert r is not None and r.prefill_tokens == 0  # all of it cached there: nothing to compute


def test_a_prompt_the_decode_worker_nearly_holds_is_prefilled_there() -> None:
    """A chat's next turn: the decode worker decoded the earlier replies, which
    no prefill worker holds.  Past its own cached prefix less than the threshold
    is left, and it holds more than any prefill worker, so it computes that
    itself: no prefill worker recomputing what it holds, no blocks sent.  A
    longer tail still goes to a prefill worker."""
    for held, want, reason in ((9, "", "decode_prefix_hit"), (10, "", "decode_prefix_hit"),
                               (8, "p0:1", "load")):  # 4, 0 and 8 tokens left; threshold 8
        router = KVAwareRouter(index_with("d0", held), lambda: (BS, MODEL), local_prefill_threshold=8)
        r = router.route(RouteRequest("r", PROMPT), D, [p("p0"), p("p1")])
        assert r is not None and r.decode == "d0:1" and r.prefill == want, held
        assert router.decisions == {reason: 1}, held
    # A request that computes its whole prompt (prompt logprobs) takes no cached prefix anywhere.
    router = KVAwareRouter(index_with("d0", 10), lambda: (BS, MODEL), local_prefill_threshold=8)
    r = router.route(RouteRequest("r", PROMPT, prefix_cache=False), D, [p("p0")])
    assert r is not None and r.prefill == "p0:1"
    # A prefill worker holding as much computes the same tail: the decode worker keeps to decoding.
    idx = index_with("d0", 9)
    idx.apply("p1", [CacheEvent("stored", hash_blocks(PROMPT, BS, extra_keys(MODEL, None))[:9])])
    idx.heartbeat("p1", 60)
    router = KVAwareRouter(idx, lambda: (BS, MODEL), local_prefill_threshold=8)
    r = router.route(RouteRequest("r", PROMPT), D, [p("p0"), p("p1")])
    assert r is not None and r.prefill == "p1:1" and router.decisions == {"prefix_hit": 1}
    # The hit that counts is the chosen decode worker's: another's does not keep it local.
    router = KVAwareRouter(index_with("d1", 10), lambda: (BS, MODEL), local_prefill_threshold=8)
    busy = WorkerLoad("d1:1", "d1", running=5, free_blocks=100, total_blocks=100)
    r = router.route(RouteRequest("r", PROMPT), [*D, busy], [p("p0")])
    assert r is not None and r.decode == "d0:1" and r.prefill == "p0:1"
