"""KV transfer throughput: blocks of the default model's layout sent over UCX
between two processes on this host, next to a plain in-process torch copy of
the same bytes, in one run.

    python -m benchmarks.kv_transfer              # 256 blocks x 360 KiB (SmolLM2-135M, bf16)
    python -m benchmarks.kv_transfer --blocks 1024 --max-inflight-mib 16

A block is [30 layers, K/V, 16 tokens, 3 kv heads, 64] bf16 = 360 KiB.  The UCX
time is one `KVTransport.send()` on a warm connection: header, READY, every
block, DONE, measured in the sending process.  It runs from a checkout: the
peer processes are the test suite's (tests/kv_peers.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from kvtransfer.transport import DEFAULT_MAX_INFLIGHT_BYTES
from tests.kv_peers import CacheSpec, PeerProcess


def default_model_spec(num_blocks: int, seed: int) -> CacheSpec:
    return CacheSpec(dtype="bfloat16", num_blocks=num_blocks, num_layers=30, block_size=16,
                     num_kv_heads=3, head_dim=64, model_id="SmolLM2-135M-Instruct", seed=seed)


def bench_ucx(num_blocks: int, rounds: int, max_inflight_bytes: int) -> list[float]:
    """Seconds per send() of all blocks, one entry per round."""
    rx = PeerProcess({"kv": default_model_spec(num_blocks, seed=1)})
    tx = PeerProcess({"kv": default_model_spec(num_blocks, seed=2)}, max_inflight_bytes=max_inflight_bytes)
    try:
        peer = rx.wait_ready(120)["kv"]
        tx.wait_ready(120)
        blocks = list(range(num_blocks))
        dst = blocks[::-1]  # not the identity, as in serving
        seconds = []
        for r in range(rounds + 1):  # round 0 connects and handshakes: not timed
            tid = f"bench-{r}"
            token = rx.call("expect", "kv", tid, dst)
            nbytes, dt = tx.call("send", "kv", peer, tid, blocks, dst, token, timeout=300)
            assert rx.call("wait", tid, 60.0) == nbytes
            if r:
                seconds.append(dt)
        src_digests, dst_digests = tx.call("digests", "kv"), rx.call("digests", "kv", timeout=60)
        if any(dst_digests[d] != src_digests[s] for s, d in zip(blocks, dst, strict=True)):
            raise AssertionError("received blocks differ from the sent ones")
        return seconds
    finally:
        for p in (rx, tx):
            p.request_stop()
        for p in (rx, tx):
            p.stop()


def bench_memcpy(num_blocks: int, rounds: int) -> list[float]:
    shape = (num_blocks, 30, 2, 16, 3, 64)
    src = torch.randn(shape).to(torch.bfloat16)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of dst's pages is not part of a copy
    seconds = []
    for _ in range(rounds):
        t = time.perf_counter()
        dst.copy_(src)
        seconds.append(time.perf_counter() - t)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-inflight-mib", type=float, default=DEFAULT_MAX_INFLIGHT_BYTES / 2**20)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = parser.parse_args(argv)

    nbytes = args.blocks * default_model_spec(1, 0).layout().block_bytes
    ucx = bench_ucx(args.blocks, args.rounds, int(args.max_inflight_mib * 2**20))
    memcpy = bench_memcpy(args.blocks, args.rounds)
    result = {
        "blocks": args.blocks, "bytes": nbytes, "max_inflight_bytes": int(args.max_inflight_mib * 2**20),
        "torch_threads": torch.get_num_threads(),
        "ucx_seconds_median": statistics.median(ucx),
        "ucx_gb_s_median": nbytes / statistics.median(ucx) / 1e9,
        "ucx_gb_s_best": nbytes / min(ucx) / 1e9,
        "memcpy_seconds_median": statistics.median(memcpy),
        "memcpy_gb_s_median": nbytes / statistics.median(memcpy) / 1e9,
        "memcpy_gb_s_best": nbytes / min(memcpy) / 1e9,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"KV transfer: {args.blocks} blocks x {nbytes // args.blocks // 1024} KiB = "
          f"{nbytes / 2**20:.1f} MiB (bf16, default model layout), {args.rounds} rounds")
    print(f"  UCX, 2 processes, loopback: {result['ucx_seconds_median'] * 1e3:8.1f} ms  "
          f"{result['ucx_gb_s_median']:6.2f} GB/s median  ({result['ucx_gb_s_best']:.2f} best; "
          f"{args.max_inflight_mib:g} MiB in flight)")
    print(f"  torch dst.copy_(src):       {result['memcpy_seconds_median'] * 1e3:8.1f} ms  "
          f"{result['memcpy_gb_s_median']:6.2f} GB/s median  ({result['memcpy_gb_s_best']:.2f} best; "
          f"{result['torch_threads']} torch threads)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
