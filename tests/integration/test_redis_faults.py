"""Redis faults through the frontend (issue 13, docs/ARCHITECTURE.md invariant 6: a
missing Redis degrades routing to load only).  A frontend that finds its
workers and their prefixes through Redis keeps serving every request while
Redis is hung (SIGSTOP) or dead (SIGKILL, then a fresh, empty one on the
same port), routes on load meanwhile (counted), and routes on prefixes again
once Redis is back.  A worker that starts while Redis is down registers, and
is found by the frontend and its peers, once Redis is back."""

from __future__ import annotations

import contextlib
import random
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import pytest

from protos import pb, pb_grpc

from .procs import FrontendProc, Proc, start_peers, start_worker, wait_until
from .test_failover import cluster
from .test_prefix_index_redis import RedisServer
from .test_routing import complete, decisions, scrape, tokens, total
from .test_worker_faults import first_report

PREFIX = 96  # tokens: 6 full blocks, over the frontend's local-prefill threshold
# A request's own tokens after the prefix: past the threshold, so the decode worker,
# which holds the prefix too, never prefills a request itself (as it would where
# it held more of the prompt than the prefill worker, with less than the
# threshold left), whatever the index knows of either.
SUFFIX = 40
WORKER_ARGS = ["--num-blocks", "128"]


@dataclass
class Stack:
    tmp: Path
    redis: RedisServer
    workers: dict[str, Proc]
    frontend: FrontendProc
    rng: random.Random = field(default_factory=lambda: random.Random(13))

    def prefix_hits(self) -> float:
        return decisions(scrape(self.frontend.url)).get("prefix_hit", 0)


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("redis-faults")
    redis = RedisServer().start()
    flags = [*WORKER_ARGS, "--redis-url", redis.url]
    try:
        workers = start_peers(tmp, {"pa": flags, "d0": [*flags, "--local-prefill-threshold", "32"]})
    except BaseException:
        redis.stop()
        raise
    frontend = FrontendProc(tmp, "frontend", "--redis-url", redis.url, "--discovery-interval", "0.2",
                            "--local-prefill-threshold", "32")
    stack = Stack(tmp, redis, workers, frontend)  # the tests replace its Redis and add workers
    try:
        wait_until(lambda: health_by_id(frontend.url) == {"pa": "healthy", "d0": "healthy"}, 120,
                   frontend.tail())
        yield stack
    finally:
        frontend.stop()
        for w in stack.workers.values():
            w.stop()
        if stack.redis.proc is not None:
            stack.redis.proc.send_signal(signal.SIGCONT)
        stack.redis.stop()


def health_by_id(url: str) -> dict[str, str]:
    return {w["id"]: w["health"] for w in cluster_list(url)}


def cluster_list(url: str) -> list[dict]:  # type: ignore[type-arg]
    try:
        return httpx.get(f"{url}/cluster", timeout=5).json()["workers"]  # type: ignore[no-any-return]
    except (httpx.TransportError, ValueError):
        return []


class Clients:
    """Two clients sending requests (shared-prefix and short ones) until
    stopped; every failure is kept."""

    def __init__(self, url: str, prefix: list[int]) -> None:
        self.url, self.prefix = url, prefix
        self.done = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(2)]
        for t in self._threads:
            t.start()

    def _run(self, i: int) -> None:
        rng = random.Random(i)
        while not self._stop.is_set():
            prompt = self.prefix + tokens(rng, SUFFIX) if i == 0 else tokens(rng, 12)
            try:
                complete(self.url, prompt)
                self.done += 1
            except (AssertionError, httpx.HTTPError) as e:
                self.failures.append(repr(e)[:300])

    def wait_for(self, more: int, timeout: float = 120) -> None:
        """Until `more` further requests have completed."""
        target = self.done + more
        wait_until(lambda: self.done >= target or bool(self.failures), timeout, "no requests completed")

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(200)


def recovered(stack: Stack, prefix: list[int], timeout: float = 60) -> None:
    """Requests on `prefix` until one is routed to the prefill worker holding
    it: the Redis index is back and holds the workers' blocks again."""
    before = stack.prefix_hits()

    def hit() -> bool:
        complete(stack.frontend.url, prefix + tokens(stack.rng, SUFFIX))
        return stack.prefix_hits() > before

    wait_until(hit, timeout, "routing never used the prefix index again")


def fallbacks(stack: Stack) -> float:
    return total(scrape(stack.frontend.url), "splitserve_index_fallbacks_total")


def test_hung_redis_degrades_to_load_routing_and_recovers(stack: Stack) -> None:
    prefix = tokens(stack.rng, PREFIX)
    recovered(stack, prefix)  # the index works: the prefix's holder is found through Redis
    assert stack.redis.proc is not None
    clients = Clients(stack.frontend.url, prefix)
    try:
        clients.wait_for(2)
        before = fallbacks(stack)
        stack.redis.proc.send_signal(signal.SIGSTOP)
        try:
            clients.wait_for(6)  # served while Redis hangs...
            assert fallbacks(stack) > before  # ...routed on load (the index did not answer)
            # Discovery kept the workers it knew.
            assert health_by_id(stack.frontend.url) == {"pa": "healthy", "d0": "healthy"}
        finally:
            stack.redis.proc.send_signal(signal.SIGCONT)
        recovered(stack, prefix)
        clients.wait_for(2)
    finally:
        clients.stop()
    assert not clients.failures, clients.failures[:5]


def test_killed_redis_restarted_empty_serves_throughout_and_recovers(stack: Stack) -> None:
    prefix = tokens(stack.rng, PREFIX)
    recovered(stack, prefix)
    assert stack.redis.proc is not None
    clients = Clients(stack.frontend.url, prefix)
    try:
        clients.wait_for(2)
        before = fallbacks(stack)
        stack.redis.proc.kill()
        stack.redis.proc.wait(10)
        clients.wait_for(6)  # served while Redis is gone
        assert fallbacks(stack) > before
        stack.redis = RedisServer(stack.redis.port).start()  # a fresh one: no registrations, no index
        # Workers re-register and resync their blocks; the frontend keeps its workers meanwhile.
        recovered(stack, prefix)
        clients.wait_for(4)
    finally:
        clients.stop()
    assert not clients.failures, clients.failures[:5]


def test_worker_started_while_redis_is_down_is_found_once_it_is_back(stack: Stack) -> None:
    assert stack.redis.proc is not None
    stack.redis.proc.kill()
    stack.redis.proc.wait(10)
    # Knows no peer by flag: it learns pa, and pa and the frontend learn it, through Redis only.
    late = start_worker("decode", "d1", stack.tmp, *WORKER_ARGS, "--local-prefill-threshold", "32",
                        "--redis-url", stack.redis.url)
    stack.workers["d1"] = late
    late.wait_ready()
    # It tried (it registers once serving, after its ready file) and keeps trying.
    wait_until(lambda: "cannot register in Redis" in late.tail(20000), 60, late.tail())
    assert "d1" not in {w["id"] for w in cluster_list(stack.frontend.url)}
    stack.redis = RedisServer(stack.redis.port).start()
    everyone = {"pa": "healthy", "d0": "healthy", "d1": "healthy"}
    wait_until(lambda: health_by_id(stack.frontend.url) == everyone, 60, "d1 was never found")
    assert cluster(stack.frontend.url)["d1"]["address"] == late.address
    # d1 found pa and pa found d1: d1 asks pa to prefill, pa sends it the KV (each refuses
    # a peer it does not know; a refusal would show as a recompute, not a remote prefill).
    ids = tokens(stack.rng, PREFIX)
    wait_until(lambda: remote_prefills_after_one(late, stack.workers["pa"].address, ids) >= 1, 60,
               "d1 never got KV from pa")


def remote_prefills_after_one(decode: Proc, prefill: str, ids: list[int]) -> float:
    """One greedy Generate on `decode`, to be prefilled by `prefill`; then
    `decode`'s count of remote prefills (KV that came from a prefill worker)."""
    with grpc.insecure_channel(decode.address) as ch:
        sampling = pb.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        req = pb.WorkerGenerateRequest(request_id=f"late-{random.randrange(1 << 30)}", prompt_token_ids=ids,
                                       sampling=sampling, prefill_address=prefill)
        with contextlib.suppress(grpc.RpcError):  # refused while d1 does not know pa yet
            list(pb_grpc.DecodeStub(ch).Generate(req, timeout=120))
    return first_report(decode.address, pb_grpc.DecodeStub, lambda r: True).counters["remote_prefills"]
