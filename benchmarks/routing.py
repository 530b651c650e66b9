"""Prefix-aware routing against round-robin and random, side by side in one run.

For each policy: fresh workers (2 prefill + 1 decode, cold caches) and one
frontend routing with that policy; then one shared-prefix workload: a few
long system prompts, each request one of them plus its own short question,
in a fixed random order at a fixed concurrency.  The prefill workers' KV
cache holds only some of the prompts at once, as in a real fleet where the
prompts outnumber what one worker can keep.  Reports TTFT (mean, p50, p99,
measured by the client on streamed responses) and the prefix-cache hit rate
of the prefill workers (read from the frontend's /metrics).

    python -m benchmarks.routing [--prefixes 4] [--prefix-len 1000] [--requests 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.ttft_split import wait  # a worker's ready file -> its address
from services.launcher import free_port

ROOT = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"
POLICIES = ("kv-aware", "round-robin", "random")


class Stack:
    """2 prefill + 1 decode workers and a frontend, on free loopback ports."""

    def __init__(self, policy: str, prefill_blocks: int, tmp: Path) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        flags = ["--dtype", "float32", "--num-threads", "1", "--block-size", "16", "--max-model-len", "2048"]
        ready = {}
        ports = {name: free_port() for name in ("pa", "pb", "d0")}
        peers = {"prefill": ["--decode", f"127.0.0.1:{ports['d0']}"],  # whom each may contact
                 "decode": ["--prefill", f"127.0.0.1:{ports['pa']},127.0.0.1:{ports['pb']}"]}
        for name, role, blocks in (("pa", "prefill", prefill_blocks), ("pb", "prefill", prefill_blocks),
                                   ("d0", "decode", 512)):
            ready[name] = tmp / f"{policy}-{name}.addr"
            self._spawn([f"services.{role}", "--worker-id", name, *flags, "--num-blocks", str(blocks),
                         "--ready-file", str(ready[name]), "--grpc-port", str(ports[name]), *peers[role]])
        addr = {name: wait(path) for name, path in ready.items()}
        self.url = f"http://127.0.0.1:{free_port()}"
        self._spawn(["services.frontend", "--port", self.url.rsplit(":", 1)[1], "--grpc-port",
                     str(free_port()), "--decode", addr["d0"], "--prefill", f"{addr['pa']},{addr['pb']}",
                     "--routing", policy, "--local-prefill-threshold", "32", "--log-level", "warning"])
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("frontend never became healthy")
            time.sleep(0.2)

    def _spawn(self, argv: list[str]) -> None:
        self.procs.append(subprocess.Popen([sys.executable, "-m", *argv], cwd=ROOT,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def close(self) -> None:
        for p in reversed(self.procs):
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def prefill_counters(url: str) -> dict[str, float]:
    """Summed over the prefill workers: prefix-cache query and hit tokens."""
    out = {"queries": 0.0, "hits": 0.0}
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("role") != "prefill":
                continue
            if s.name == "splitserve_worker_prefix_cache_queries_total":
                out["queries"] += s.value
            elif s.name == "splitserve_worker_prefix_cache_hits_total":
                out["hits"] += s.value
    return out


def workload(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(100, 40000) for _ in range(args.prefix_len)] for _ in range(args.prefixes)]
    return [rng.choice(prefixes) + [rng.randrange(100, 40000) for _ in range(24)]
            for _ in range(args.requests)]


async def run_workload(url: str, prompts: list[list[int]], concurrency: int) -> list[float]:
    ttfts: list[float] = []
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)

    async def client() -> None:
        async with httpx.AsyncClient(timeout=600) as http:
            while not queue.empty():
                prompt = queue.get_nowait()
                start = time.perf_counter()
                first = None
                async with http.stream("POST", f"{url}/v1/completions",
                                       json={"model": MODEL, "prompt": prompt, "max_tokens": 4,
                                             "temperature": 0, "stream": True}) as r:
                    r.raise_for_status()
                    async for line in r.aiter_lines():
                        if first is None and line.startswith("data: {"):
                            first = time.perf_counter() - start
                assert first is not None
                ttfts.append(first)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return ttfts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefixes", type=int, default=4, help="distinct shared system prompts")
    ap.add_argument("--prefix-len", type=int, default=1000, help="tokens per shared prompt")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--prefill-blocks", type=int, default=160,
                    help="KV blocks per prefill worker (160 x 16 tokens: about 2.5 of the shared prompts)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    prompts = workload(args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for policy in args.policies.split(","):
            stack = Stack(policy, args.prefill_blocks, Path(tmp))
            try:
                before = prefill_counters(stack.url)
                ttfts = asyncio.run(run_workload(stack.url, prompts, args.concurrency))
                time.sleep(0.5)  # the last load reports
                after = prefill_counters(stack.url)
            finally:
                stack.close()
            ttfts.sort()
            hits, queries = after["hits"] - before["hits"], after["queries"] - before["queries"]
            rows.append({"policy": policy, "ttft_mean_ms": 1000 * statistics.fmean(ttfts),
                         "ttft_p50_ms": 1000 * ttfts[len(ttfts) // 2],
                         "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
                         "prefix_hit_rate": hits / queries if queries else 0.0})
    print(f"{args.requests} requests, {args.prefixes} shared prompts of {args.prefix_len} tokens + 24, "
          f"concurrency {args.concurrency}, 2 prefill ({args.prefill_blocks} blocks each) + 1 decode")
    print(f"{'policy':<12} {'TTFT mean ms':>13} {'p50 ms':>9} {'p99 ms':>9} {'prefix hit rate':>16}")
    for r in rows:
        print(f"{r['policy']:<12} {r['ttft_mean_ms']:>13.0f} {r['ttft_p50_ms']:>9.0f} "
              f"{r['ttft_p99_ms']:>9.0f} {r['prefix_hit_rate']:>16.1%}")
    print(json.dumps({"benchmark": "routing", "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
