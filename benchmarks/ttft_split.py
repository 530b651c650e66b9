"""Where a remote-prefilled request's time to first token goes: reserve (decode
waits for KV blocks), prefill (on the prefill worker, queue included),
transfer (KV blocks over UCX), admit (decode joins the batch), for a
1k-token prompt, next to the same prompt prefilled on the decode worker.

    python -m benchmarks.ttft_split [--prompt-len 1024] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from protos import pb, pb_grpc
from services.cluster_auth import ENV, sync_channel
from services.launcher import free_port

FLAGS = ["--dtype", "float32", "--num-threads", "1", "--num-blocks", "512", "--max-model-len", "4096"]


def spawn(role: str, tmp: Path, port: int, peer_port: int) -> tuple[subprocess.Popen[bytes], Path]:
    ready = tmp / f"{role}.addr"
    peer = ["--decode" if role == "prefill" else "--prefill", f"127.0.0.1:{peer_port}"]
    proc = subprocess.Popen([sys.executable, "-m", f"services.{role}", *FLAGS, "--ready-file", str(ready),
                             "--worker-id", role, "--grpc-port", str(port), *peer],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, ready


def wait(ready: Path, timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{ready} never appeared")
        time.sleep(0.1)
    return ready.read_text().strip()


def one(decode: str, prefill: str, ids: list[int]) -> tuple[float, dict[str, float]]:
    with sync_channel(decode, os.environ.get(ENV)) as ch:  # the workers' cluster token, if any
        req = pb.WorkerGenerateRequest(request_id=f"ttft-{random.random()}", prompt_token_ids=ids,
                                       sampling=pb.SamplingParams(temperature=0, max_tokens=2),
                                       prefill_address=prefill)
        t = time.perf_counter()
        stream = pb_grpc.DecodeStub(ch).Generate(req, timeout=300)
        first = next(iter(stream))
        ttft = time.perf_counter() - t
        for _ in stream:
            pass
    return ttft, dict(first.timings)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    p_port, d_port = free_port(), free_port()
    procs = [spawn("prefill", tmp, p_port, d_port), spawn("decode", tmp, d_port, p_port)]
    try:
        prefill, decode = (wait(r) for _, r in procs)
        rng = random.Random(0)
        prompts = [[rng.randrange(100, 49152) for _ in range(args.prompt_len)]
                   for _ in range(2 * args.rounds + 1)]
        one(decode, prefill, prompts.pop())  # warm-up (connections, first step)
        remote = [one(decode, prefill, prompts.pop()) for _ in range(args.rounds)]
        local = [one(decode, "", prompts.pop())[0] for _ in range(args.rounds)]
    finally:
        for p, _ in procs:
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=30)
    med = statistics.median
    print(f"TTFT for a {args.prompt_len}-token prompt, median of {args.rounds}, float32, "
          f"1 thread per worker, ms")
    print(f"{'remote prefill: end to end':<34}{1000 * med(t for t, _ in remote):>9.1f}")
    for key in ("reserve", "prefill", "transfer", "admit"):
        print(f"{'  ' + key:<34}{1000 * med(d.get(key, 0.0) for _, d in remote):>9.1f}")
    rest = [t - sum(d.get(k, 0.0) for k in ("reserve", "prefill", "transfer", "admit")) for t, d in remote]
    print(f"{'  rpc, scheduling, first chunk':<34}{1000 * med(rest):>9.1f}")
    print(f"{'local prefill on decode':<34}{1000 * med(local):>9.1f}")


if __name__ == "__main__":
    main()
