"""Prefix-aware routing over real processes (issue 4, first part): two prefill
workers, one decode worker, and two frontends on the same workers, one routing
kv-aware, one round-robin.  Workers stream their prefix-cache events to the
frontends' embedded index with their load reports."""

from __future__ import annotations

import random
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from .procs import ROOT, free_port, start_worker

MODEL = "SmolLM2-135M-Instruct"
PREFIX_BLOCKS = 16  # 256 shared tokens



def start_redis(port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        assert time.monotonic() < deadline, "redis-server did not start"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("routing")
    redis_port = free_port()
    redis = [start_redis(redis_port)]
    workers = [start_worker("prefill", "pa", tmp, "--num-blocks", "256"),
               start_worker("prefill", "pb", tmp, "--num-blocks", "256"),
               start_worker("decode", "d0", tmp, "--num-blocks", "256", "--local-prefill-threshold", "32")]
    frontends = []
    try:
        for w in workers:
            w.wait_ready()
        for name, extra in (("kv-aware", []), ("round-robin", []),
                            ("redis", ["--redis-url", f"redis://127.0.0.1:{redis_port}"])):
            port = free_port()
            routing = "round-robin" if name == "round-robin" else "kv-aware"
            with open(tmp / f"frontend-{name}.log", "wb") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "services.frontend", "--port", str(port), "--grpc-port",
                     str(free_port()), "--decode", workers[2].address, "--prefill",
                     f"{workers[0].address},{workers[1].address}", "--local-prefill-threshold", "32",
                     "--routing", routing, "--log-level", "warning", *extra],
                    cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            frontends.append((proc, f"http://127.0.0.1:{port}"))
        for proc, url in frontends:
            deadline = time.monotonic() + 120
            while True:
                assert proc.poll() is None and time.monotonic() < deadline
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
        yield [url for _, url in frontends], redis, redis_port
    finally:
        for r in redis:
            r.terminate()
            r.wait(timeout=10)
        for proc, _ in frontends:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=30)
        for w in workers:
            w.stop()


def prefill_counters(url: str) -> dict[str, dict[str, float]]:  # worker id -> counters
    return {w["id"]: w["counters"] for w in httpx.get(f"{url}/cluster").json()["workers"]
            if w["role"] == "prefill"}


def run_shared_prefix(url: str, seed: int, n: int) -> None:
    rng = random.Random(seed)
    prefix = [rng.randrange(100, 40000) for _ in range(PREFIX_BLOCKS * 16)]
    for _ in range(n):
        suffix = [rng.randrange(100, 40000) for _ in range(20)]
        r = httpx.post(f"{url}/v1/completions", timeout=120,
                       json={"model": MODEL, "prompt": prefix + suffix, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        time.sleep(0.5)  # the load stream carries the new blocks to the index (0.2 s reports)


Counters = dict[str, dict[str, float]]


def delta(after: Counters, before: Counters, key: str) -> dict[str, float]:
    return {w: after[w][key] - before[w][key] for w in after}


def test_kv_aware_sends_shared_prefixes_to_the_worker_that_has_them(stack) -> None:  # type: ignore[no-untyped-def]
    (kv_url, _, _), _, _ = stack
    n = 6
    before = prefill_counters(kv_url)
    run_shared_prefix(kv_url, seed=1, n=n)
    after = prefill_counters(kv_url)
    computed = delta(after, before, "prompt_tokens_computed")
    hits = delta(after, before, "prefix_cache_hits")
    assert sorted(v > 0 for v in computed.values()) == [False, True]  # one worker took them all
    # Every request after the first found the whole shared prefix cached.
    assert sum(hits.values()) >= (n - 1) * PREFIX_BLOCKS * 16 * 0.9
    decisions = httpx.get(f"{kv_url}/cluster").json()["routing"]["decisions"]
    assert decisions.get("prefix_hit", 0) >= n - 1


def test_round_robin_spreads_and_hits_less(stack) -> None:  # type: ignore[no-untyped-def]
    (_, rr_url, _), _, _ = stack
    n = 6
    before = prefill_counters(rr_url)
    run_shared_prefix(rr_url, seed=2, n=n)
    after = prefill_counters(rr_url)
    computed = delta(after, before, "prompt_tokens_computed")
    hits = delta(after, before, "prefix_cache_hits")
    assert all(v > 0 for v in computed.values())  # both workers computed the prefix
    assert sum(hits.values()) <= (n - 2) * PREFIX_BLOCKS * 16 + n * 16


def test_redis_index_routes_and_survives_redis_going_away(stack) -> None:  # type: ignore[no-untyped-def]
    (_, _, url), redis, redis_port = stack
    decisions = lambda: httpx.get(f"{url}/cluster").json()["routing"]["decisions"]  # noqa: E731
    run_shared_prefix(url, seed=3, n=3)
    assert decisions().get("prefix_hit", 0) >= 2  # the Redis index knew where the prefix was
    redis[0].terminate()
    redis[0].wait(timeout=10)
    run_shared_prefix(url, seed=4, n=2)  # every request still completes (asserted inside)
    assert decisions().get("index_fallback", 0) >= 2
    redis[0] = start_redis(redis_port)
    time.sleep(1.0)  # the next load reports resync each worker's blocks into the fresh Redis
    before = decisions().get("prefix_hit", 0)
    run_shared_prefix(url, seed=4, n=2)  # the prefix seen while Redis was down
    assert decisions().get("prefix_hit", 0) >= before + 2
