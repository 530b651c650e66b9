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

--chat-turns T measures multi-turn chats instead, kv-aware routing only: each
of --prefixes conversations starts from its own prompt; each turn adds 16
tokens of question to the conversation so far and gets a --reply-len reply
(streamed over the frontend's gRPC, which returns token ids), so turn k + 1's
prompt is turn k's plus its reply and the new question.  Run twice on fresh
workers: with --local-prefill-threshold 32, where the decode worker, which
decoded the replies, prefills a turn's short tail itself, and with 0, where
every turn goes to a prefill worker (which recomputes the replies it never
saw).  Reports TTFT over the turns after the first.

    python -m benchmarks.routing --chat-turns 4 [--prefixes 4] [--prefix-len 1000]
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.ttft_split import wait  # a worker's ready file -> its address
from protos import pb, pb_grpc
from services.launcher import free_port

ROOT = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"
POLICIES = ("kv-aware", "round-robin", "random")


class Stack:
    """2 prefill + 1 decode workers and a frontend, on free loopback ports."""

    def __init__(self, policy: str, prefill_blocks: int, tmp: Path, threshold: int = 32) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        try:
            self._start(policy, prefill_blocks, tmp, threshold)
        except BaseException:
            self.close()  # what did start stops: a failed start leaves no worker behind
            raise

    def _start(self, policy: str, prefill_blocks: int, tmp: Path, threshold: int) -> None:
        flags = ["--dtype", "float32", "--num-threads", "1", "--block-size", "16", "--max-model-len", "2048"]
        ready = {}
        ports = {name: free_port() for name in ("pa", "pb", "d0")}
        peers = {"prefill": ["--decode", f"127.0.0.1:{ports['d0']}"],  # whom each may contact
                 "decode": ["--prefill", f"127.0.0.1:{ports['pa']},127.0.0.1:{ports['pb']}"]}
        for name, role, blocks in (("pa", "prefill", prefill_blocks), ("pb", "prefill", prefill_blocks),
                                   ("d0", "decode", 512)):
            ready[name] = tmp / f"{policy}-t{threshold}-{name}.addr"  # one file per stack
            self._spawn([f"services.{role}", "--worker-id", name, *flags, "--num-blocks", str(blocks),
                         "--ready-file", str(ready[name]), "--grpc-port", str(ports[name]), *peers[role]])
        addr = {name: wait(path) for name, path in ready.items()}
        self.url = f"http://127.0.0.1:{free_port()}"
        self.grpc = f"127.0.0.1:{free_port()}"
        self._spawn(["services.frontend", "--port", self.url.rsplit(":", 1)[1],
                     "--grpc-port", self.grpc.rsplit(":", 1)[1], "--decode", addr["d0"],
                     "--prefill", f"{addr['pa']},{addr['pb']}", "--routing", policy,
                     "--local-prefill-threshold", str(threshold), "--log-level", "warning"])
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


# A chat turn's new tokens: with what the decode worker holds in partial blocks
# (< 16), the tail stays under the threshold (32).
QUESTION = 16


def chat_turn(grpc_address: str, prompt: list[int], reply_len: int) -> tuple[float, list[int]]:
    """One streamed turn over the frontend's gRPC -> (TTFT seconds, the reply's token ids)."""
    req = pb.GenerateRequest(model=MODEL, token_ids=pb.TokenIds(ids=prompt),
                             sampling=pb.SamplingParams(temperature=0, max_tokens=reply_len, ignore_eos=True))
    start = time.perf_counter()
    first = None
    reply: list[int] = []
    with grpc.insecure_channel(grpc_address) as ch:
        for r in pb_grpc.FrontendStub(ch).Generate(req, timeout=600):
            if first is None and r.token_ids:
                first = time.perf_counter() - start
            reply.extend(r.token_ids)
    assert first is not None and len(reply) == reply_len
    return first, reply


def run_chats(grpc_address: str, args: argparse.Namespace) -> list[float]:
    """Every conversation at once, each turn after the one before; the TTFTs of turns 2.."""
    rng = random.Random(args.seed)
    starts = [[rng.randrange(100, 40000) for _ in range(args.prefix_len)] for _ in range(args.prefixes)]
    questions = [[[rng.randrange(100, 40000) for _ in range(QUESTION)] for _ in range(args.chat_turns)]
                 for _ in range(args.prefixes)]

    def conversation(c: int) -> list[float]:
        history, ttfts = starts[c], []
        for turn in range(args.chat_turns):
            prompt = history + questions[c][turn]
            ttft, reply = chat_turn(grpc_address, prompt, args.reply_len)
            if turn:
                ttfts.append(ttft)
            history = prompt + reply
        return ttfts

    with ThreadPoolExecutor(args.prefixes) as pool:
        return [t for ts in pool.map(conversation, range(args.prefixes)) for t in ts]


TTFT_MEAN, TTFT_P50 = ("TTFT mean ms", "ttft_mean_ms", 13, ".0f"), ("p50 ms", "ttft_p50_ms", 9, ".0f")


def ttft_summary(ttfts: list[float]) -> dict[str, float]:
    """TTFTs in seconds -> their mean, p50, p99 and max in ms."""
    t = sorted(ttfts)
    return {"ttft_mean_ms": 1000 * statistics.fmean(t), "ttft_p50_ms": 1000 * t[len(t) // 2],
            "ttft_p99_ms": 1000 * t[min(len(t) - 1, round(0.99 * (len(t) - 1)))], "ttft_max_ms": 1000 * t[-1]}


def report(name: str, title: str, rows: list[dict[str, Any]], label: tuple[str, int],
           columns: list[tuple[str, str, int, str]]) -> None:
    """The rows as a table (label: key, width; columns: heading, key, width, format), then as JSON."""
    print(title)
    print(f"{label[0]:<{label[1]}} " + " ".join(f"{head:>{width}}" for head, _, width, _ in columns))
    for r in rows:
        cells = (f"{r[key]:>{width}{fmt}}" for _, key, width, fmt in columns)
        print(f"{r[label[0]]:<{label[1]}} " + " ".join(cells))
    print(json.dumps({"benchmark": name, "rows": rows}))


def main_chat(args: argparse.Namespace) -> int:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for threshold, label in ((32, "kv-aware, decode worker prefills a short tail"),
                                 (0, "kv-aware, every turn to a prefill worker")):
            stack = Stack("kv-aware", args.prefill_blocks, Path(tmp), threshold)
            try:
                ttfts = run_chats(stack.grpc, args)
            finally:
                stack.close()
            rows.append({"routing": label, "threshold": threshold, **ttft_summary(ttfts)})
    report("routing-chat",
           f"{args.prefixes} chats of {args.chat_turns} turns: a {args.prefix_len}-token start, then "
           f"{QUESTION} tokens of question and a {args.reply_len}-token reply a turn; 2 prefill "
           f"({args.prefill_blocks} blocks each) + 1 decode; TTFT of turns 2..",
           rows, ("routing", 48), [TTFT_MEAN, TTFT_P50, ("max ms", "ttft_max_ms", 9, ".0f")])
    return 0


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
    ap.add_argument("--reply-len", type=int, default=32, help="--chat-turns: tokens a reply")
    ap.add_argument("--chat-turns", type=int, default=0,
                    help="> 0: multi-turn chats instead (see above), kv-aware routing with and without "
                         "the decode worker prefilling a short tail")
    args = ap.parse_args()
    if args.chat_turns > 0:
        return main_chat(args)
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
            hits, queries = after["hits"] - before["hits"], after["queries"] - before["queries"]
            rows.append({"policy": policy, **ttft_summary(ttfts),
                         "prefix_hit_rate": hits / queries if queries else 0.0})
    report("routing",
           f"{args.requests} requests, {args.prefixes} shared prompts of {args.prefix_len} tokens + 24, "
           f"concurrency {args.concurrency}, 2 prefill ({args.prefill_blocks} blocks each) + 1 decode",
           rows, ("policy", 12), [TTFT_MEAN, TTFT_P50, ("p99 ms", "ttft_p99_ms", 9, ".0f"),
                                  ("prefix hit rate", "prefix_hit_rate", 16, ".1%")])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
