"""Mid-stream failover and graceful drain (issue 7, acceptance 4 and 5): a
decode worker SIGKILLed while 8 streams run on it, and a rolling restart of
both decode workers under steady load.  The frontend resumes cut streams on
the other decode worker with the prompt plus the tokens already sent; every
client gets a complete stream.  Issue 13: a decode worker SIGSTOPped (silent,
not dead) mid-stream is left by the frontend's watchdog and frees its blocks
once it runs again; one SIGKILLed while its requests wait on a remote prefill
is retried elsewhere, and the prefill worker lets go of the transfer."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from protos import pb
from tests.faults import fault_env

from .procs import (
    ROOT,
    FrontendProc,
    Proc,
    Stream,
    address,
    free_port,
    peer_flag,
    start_all,
    start_worker,
    wait_until,
)

MAX_TOKENS = 40
PROMPTS = [f"Story {i}: a lighthouse keeper finds a message in a bottle. Tell what it says and what "
           f"happens next." for i in range(8)]
LONG_PROMPT = "The keeper's logbook, day after day, recorded the wind, the tides and the ships. " * 6


@pytest.fixture(scope="module")
def stack(tmp_path_factory):  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("failover")
    ports = {"d0": free_port(), "d1": free_port(), "p0": free_port()}
    workers = {name: start_named(name, tmp, ports) for name in ports}
    frontend = None
    try:
        for w in workers.values():
            w.wait_ready()
        addresses = f"{workers['d0'].address},{workers['d1'].address}"
        port, grpc_port = free_port(), free_port()
        with open(tmp / "frontend.log", "wb") as log:
            frontend = subprocess.Popen(
                [sys.executable, "-m", "services.frontend", "--port", str(port),
                 "--grpc-port", str(grpc_port), "--decode", addresses, "--prefill", workers["p0"].address,
                 "--log-level", "warning"],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: health(url).get("healthy_decode_workers") == 2
                   and health(url).get("healthy_prefill_workers") == 1, 120,
                   "the frontend never saw the workers")
        yield url, f"127.0.0.1:{grpc_port}", workers, ports, tmp, frontend
    finally:
        if frontend is not None and frontend.poll() is None:
            frontend.send_signal(signal.SIGTERM)
            frontend.wait(timeout=30)
        for w in workers.values():
            if w.popen.poll() is None:
                w.popen.send_signal(signal.SIGCONT)
            w.stop()


def start_named(name: str, tmp, ports: dict[str, int]) -> Proc:  # type: ignore[no-untyped-def]
    """d*: decode workers, p*: prefill workers (prompts of 64 tokens and more go there);
    each knows the other role's workers among `ports`."""
    role = "decode" if name.startswith("d") else "prefill"
    peers = [address(p) for n, p in ports.items() if n[0] != name[0]]
    return start_worker(role, name, tmp, "--num-blocks", "256", "--grpc-port", str(ports[name]),
                        "--drain-timeout", "20", *peer_flag(role, peers),
                        env=fault_env(step_slow_file=slow_steps_file(tmp)))


def slow_steps_file(tmp: Path) -> Path:
    """While this file exists every worker here waits the seconds it holds before
    each step (tests/faults.py): a test that must land a kill before a given
    token slows the stream instead of racing it."""
    return tmp / "slow-steps"


def ensure_decode_workers(stack) -> None:  # type: ignore[no-untyped-def]
    """Both decode workers running and seen healthy (a test before may have left one dead)."""
    url, _, workers, ports, tmp, _ = stack
    for name in ("d0", "d1"):
        if workers[name].popen.poll() is not None:
            workers[name] = start_named(name, tmp, ports)
            workers[name].wait_ready()
    wait_until(lambda: health(url).get("healthy_decode_workers") == 2, 30, "both workers never came up")


def cluster(url: str) -> dict[str, dict[str, Any]]:
    return {w["id"]: w for w in httpx.get(f"{url}/cluster", timeout=5).json()["workers"]}


def frontend_counter(url: str, name: str) -> float:
    metrics = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(name))


def health(url: str) -> dict[str, Any]:
    try:
        return httpx.get(f"{url}/health", timeout=2).json()  # type: ignore[no-any-return]
    except (httpx.TransportError, ValueError):
        return {}


def worker_health(url: str) -> dict[str, str]:
    return {w["id"]: w["health"] for w in httpx.get(f"{url}/cluster", timeout=5).json()["workers"]}

def run_streams(grpc_address: str) -> list[Stream]:
    return start_all(Stream(grpc_address, p, MAX_TOKENS) for p in PROMPTS)


def test_decode_worker_killed_mid_stream(stack) -> None:  # type: ignore[no-untyped-def]
    url, grpc_address, workers, _, _, _ = stack
    reference = run_streams(grpc_address)
    for s in reference:
        s.join(120)
    assert all(s.error is None and len(s.tokens) == MAX_TOKENS for s in reference), \
        [(s.error, len(s.tokens)) for s in reference]

    # Freeze d1 so that its load reports stop and all 8 streams go to d0.
    workers["d1"].popen.send_signal(signal.SIGSTOP)
    wait_until(lambda: worker_health(url)["d1"] == "unhealthy", 10, "a frozen worker still looked healthy")
    streams = run_streams(grpc_address)
    wait_until(lambda: all(s.tokens for s in streams), 60, "the streams never started")
    assert all(len(s.tokens) < MAX_TOKENS for s in streams)
    workers["d1"].popen.send_signal(signal.SIGCONT)
    wait_until(lambda: worker_health(url)["d1"] == "healthy", 10, "d1 never came back")
    killed_at = time.monotonic()
    workers["d0"].kill(signal.SIGKILL)
    killed_after = [len(s.tokens) for s in streams]
    for s in streams:
        s.join(120)

    assert any(n < MAX_TOKENS for n in killed_after)  # the kill really cut streams short
    gaps = [min(t for t in s.arrivals if t > killed_at) - killed_at for s in streams
            if any(t > killed_at for t in s.arrivals)]
    print(f"failover: {len(gaps)} streams resumed; first token after the kill within "
          f"{1000 * min(gaps):.0f}-{1000 * max(gaps):.0f} ms")
    for ref, s in zip(reference, streams, strict=True):
        assert s.error is None, s.error
        assert s.finish_reason == "length"
        assert s.tokens == ref.tokens  # nothing lost, nothing repeated, same greedy continuation
    metrics = httpx.get(f"{url}/metrics", timeout=5).text
    migrated = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line.startswith("splitserve_requests_migrated_total"))
    assert migrated == sum(n < MAX_TOKENS for n in killed_after)


def test_rolling_restart_under_load_loses_nothing(stack) -> None:  # type: ignore[no-untyped-def]
    url, grpc_address, workers, ports, tmp, _ = stack
    ensure_decode_workers(stack)  # the previous test may have left one dead

    stop = threading.Event()
    done: list[Stream] = []

    def client(i: int) -> None:
        while not stop.is_set():
            s = Stream(grpc_address, PROMPTS[i] if i else LONG_PROMPT, MAX_TOKENS)  # client 0's go through p0
            s.run()
            done.append(s)

    clients = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(3)]
    for c in clients:
        c.start()
    exits = {}
    for name in ("p0", "d0", "d1"):  # one by one: drain (SIGTERM), wait for a clean exit, start again
        mark = len(done)
        wait_until(lambda: len(done) >= mark + 2, 60, "no load")  # noqa: B023 - waited on at once
        workers[name].popen.send_signal(signal.SIGTERM)
        exits[name] = workers[name].popen.wait(timeout=60)
        workers[name] = start_named(name, tmp, ports)
        workers[name].wait_ready()
        wait_until(lambda: health(url).get("healthy_decode_workers") == 2
                   and health(url).get("healthy_prefill_workers") == 1, 30, f"{name} never came back")
    mark = len(done)
    wait_until(lambda: len(done) >= mark + 2, 60, "no load after the restarts")
    stop.set()
    for c in clients:
        c.join(120)
    assert exits == {"p0": 0, "d0": 0, "d1": 0}
    assert done and all(s.error is None and len(s.tokens) == MAX_TOKENS for s in done), \
        [(s.error, len(s.tokens)) for s in done if s.error or len(s.tokens) != MAX_TOKENS]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


KV_CACHE_LINE = re.compile(r"KV blocks of \d+ tokens \(([\d.]+) MiB")


def kv_cache_mib(worker: Proc) -> float:
    """The size of a worker's KV cache, as its start-up log states it (one decimal)."""
    m = KV_CACHE_LINE.search(worker.log.read_text(errors="replace"))
    assert m, f"no KV cache size in {worker.log}"
    return float(m.group(1))


def rss_outside(pid: int, mib: float) -> int:
    """The resident memory of every mapping but a worker's KV caches: the
    anonymous ones flagged out of core dumps (VmFlags "dd";
    engine/layers/huge_pages.py, kv_cache_zeros), `mib` MiB or more in all
    (a draft model's cache beside the model's may share its mapping).  The OS
    fills them page by page as blocks are first used, so that their RSS grows
    until every block has held a token once, and never past their size."""
    total, caches = 0, 0.0
    path, size, rss = "", 0.0, 0
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            fields = line.split()
            if not fields[0].endswith(":"):  # a mapping's header: range, perms, offset, dev, inode, path
                path = " ".join(fields[5:])
            elif fields[0] == "Size:":
                size = int(fields[1]) / 1024
            elif fields[0] == "Rss:":
                rss = int(fields[1]) * 1024
            elif fields[0] == "VmFlags:":  # a mapping's last line
                if not path and "dd" in fields[1:]:
                    caches += size
                else:
                    total += rss
    assert caches > mib - 0.06, f"{pid}'s smaps: {caches:.1f} MiB of anonymous mappings out of core dumps, " \
                                f"not its {mib} MiB KV cache"
    return total


def test_soak_memory_stays_flat_and_nothing_fails(stack) -> None:  # type: ignore[no-untyped-def]
    """Issue 7 acceptance 6, CI-sized (SPLITSERVE_SOAK_SECONDS, default 12; the
    issue's full run is 300): a steady moderate load; after a warm-up quarter,
    every process's RSS stays within 10% and no request fails.  A worker's KV
    cache is left out of its RSS (rss_outside): its pages fill as the blocks
    are first used, which at 256 blocks took longer than a 3 s warm-up (the
    decode workers' RSS grew 9-10% in the 9 s after it, 0% after a 12 s one)."""
    url, grpc_address, workers, ports, tmp, frontend = stack
    ensure_decode_workers(stack)
    seconds = float(os.environ.get("SPLITSERVE_SOAK_SECONDS", "12"))
    pids = {"frontend": frontend.pid, **{n: w.popen.pid for n, w in workers.items()}}
    kv_mib = {n: kv_cache_mib(w) for n, w in workers.items()}

    def rss(name: str) -> int:
        return rss_outside(pids[name], kv_mib[name]) if name in kv_mib else rss_bytes(pids[name])

    stop = threading.Event()
    done: list[Stream] = []

    def client(i: int) -> None:
        while not stop.is_set():
            s = Stream(grpc_address, PROMPTS[i % len(PROMPTS)] + f" (variation {len(done)})", MAX_TOKENS)
            s.run()
            done.append(s)
            time.sleep(0.05)

    clients = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(2)]
    for c in clients:
        c.start()
    start = time.monotonic()
    time.sleep(seconds / 4)  # warm-up: caches fill, allocators settle
    baseline = {name: rss(name) for name in pids}
    peak = dict(baseline)
    while time.monotonic() - start < seconds:
        time.sleep(1.0)
        for name in pids:
            peak[name] = max(peak[name], rss(name))
    stop.set()
    for c in clients:
        c.join(120)
    growth = {name: peak[name] / baseline[name] - 1 for name in pids}
    print("soak:", len(done), "requests;", {n: f"{g:+.1%}" for n, g in growth.items()})
    assert len(done) >= seconds / 10  # a steady load really ran
    assert all(s.error is None and len(s.tokens) == MAX_TOKENS for s in done)
    assert all(g < 0.10 for g in growth.values()), growth


def carrier(url: str, stream: Stream) -> str:
    """The decode worker `stream` runs on (the only one running a request, by
    its own and the frontend's count), once its tokens flow."""
    carrying: list[str] = []

    def running() -> bool:
        carrying[:] = [n for n, w in cluster(url).items()
                       if w["role"] == "decode" and w["inflight"] and w["running"]]
        return bool(stream.tokens) and len(carrying) == 1

    wait_until(running, 60, "the stream never ran")
    return carrying[0]


NEAR_TIES = (8, 31, 42)  # the seeded stream's tokens drawn within float rounding of a CDF boundary


def test_seeded_sampled_stream_killed_mid_stream_continues_exactly(stack) -> None:  # type: ignore[no-untyped-def]
    """Seeded sampling with penalties, its decode worker SIGKILLed mid-stream:
    the resumed stream (the new worker's RNG moved on one draw per relayed
    token, penalties counting them as output) is the undisturbed one.

    Exactly, not up to rounding: the new worker computes the relayed tokens as
    decode rows, the bits the first worker's decode steps wrote.  The kill
    lands before this seed's near-ties (tokens 8, 31 and 42: a draw there
    within float rounding of a CDF boundary, where a resume that prefilled the
    relayed tokens like a prompt picked the neighbour)."""
    url, grpc_address, workers, _, tmp, _ = stack
    ensure_decode_workers(stack)
    max_tokens = NEAR_TIES[-1] + 6
    sampling = pb.SamplingParams(temperature=0.9, seed=4242, max_tokens=max_tokens, ignore_eos=True,
                                 repetition_penalty=1.2, frequency_penalty=0.4)
    reference = Stream(grpc_address, PROMPTS[4], sampling=sampling).complete()
    assert Stream(grpc_address, PROMPTS[4], sampling=sampling).complete() == reference  # seeded: repeatable
    migrated = frontend_counter(url, "splitserve_requests_migrated_total")

    # Steps of 50 ms from here: the kill below lands within a few tokens of the
    # third (a fast machine ran the whole stream in the time carrier() took).
    slow = slow_steps_file(tmp)
    slow.write_text("0.05")
    try:
        stream = Stream(grpc_address, PROMPTS[4], sampling=sampling)
        stream.start()
        victim = carrier(url, stream)
        wait_until(lambda: len(stream.tokens) >= 3, 60, "the stream stopped")
        workers[victim].kill(signal.SIGKILL)
        cut_at = len(stream.tokens)
        assert "fault: each step waits" in workers[victim].tail(100_000)  # the stream was slowed
        assert 3 <= cut_at < NEAR_TIES[1]  # mid-stream, before two near-ties at least
        result = stream.result()
    finally:
        slow.unlink()
    assert result == reference
    assert frontend_counter(url, "splitserve_requests_migrated_total") == migrated + 1
    print(f"seeded stream cut after {cut_at} of {max_tokens} tokens on {victim}; resumed exactly")


def test_silent_decode_worker_mid_stream_is_left_and_frees_its_blocks(stack) -> None:  # type: ignore[no-untyped-def]
    """SIGSTOP (alive, silent: no tokens, no load reports) on the decode worker
    a stream runs on: the frontend's watchdog gives up on it and resumes the
    stream on the other worker; once it runs again it has aborted the request
    and every block is back."""
    url, grpc_address, workers, _, _, _ = stack
    ensure_decode_workers(stack)
    max_tokens = 200  # long enough to be cut: the watchdog waits seconds before it gives up
    reference = Stream(grpc_address, PROMPTS[5], max_tokens)
    reference.run()
    assert reference.error is None and len(reference.tokens) == max_tokens
    migrated = frontend_counter(url, "splitserve_requests_migrated_total")

    stream = Stream(grpc_address, PROMPTS[5], max_tokens)
    stream.start()
    victim = carrier(url, stream)
    workers[victim].popen.send_signal(signal.SIGSTOP)
    try:
        cut_at = len(stream.tokens)
        stream.join(120)
        assert cut_at < max_tokens
        assert stream.error is None and stream.tokens == reference.tokens  # nothing lost or repeated
        assert frontend_counter(url, "splitserve_requests_migrated_total") == migrated + 1
        with open(f"/proc/{workers[victim].popen.pid}/status") as f:  # left while alive, not dead
            assert "State:\tT (stopped)" in f.read()
    finally:
        workers[victim].popen.send_signal(signal.SIGCONT)
    wait_until(lambda: (w := cluster(url)[victim])["health"] == "healthy" and w["running"] == 0
               and w["free_blocks"] == w["total_blocks"], 30, f"{victim} kept the request or its blocks")


def test_decode_worker_killed_while_its_requests_wait_on_a_remote_prefill(stack) -> None:  # type: ignore[no-untyped-def]
    """Long prompts go through p0; the decode worker holding them is SIGKILLed
    while none has its first token yet.  The frontend retries each on the other
    decode worker (same tokens as undisturbed), and p0 ends with every block
    free and no transfer pending."""
    url, grpc_address, workers, _, _, _ = stack
    ensure_decode_workers(stack)
    wait_until(lambda: health(url).get("healthy_prefill_workers") == 1, 30, "p0 is not up")
    # New prompts (no worker has them cached), ~400 tokens each: seconds of prefill.
    prompts = [f"Log {i}: " + LONG_PROMPT * 4 for i in range(4)]
    retried = frontend_counter(url, "splitserve_worker_retries_total")
    migrated = frontend_counter(url, "splitserve_requests_migrated_total")
    streams = [Stream(grpc_address, p, MAX_TOKENS) for p in prompts]
    for s in streams:
        s.start()
    # All four routed, none has its first token: each decode worker waits on p0.
    wait_until(lambda: cluster(url)["p0"]["inflight"] == 4
               and sum(w["inflight"] for n, w in cluster(url).items() if n != "p0") == 4,
               60, "the prompts never reached the prefill worker together")
    snapshot = cluster(url)
    victim = max(("d0", "d1"), key=lambda n: snapshot[n]["inflight"])
    workers[victim].kill(signal.SIGKILL)
    in_prefill = snapshot[victim]["inflight"]
    for s in streams:
        s.join(180)
    assert [s.error for s in streams] == [None] * 4
    # Undisturbed, now (greedy: the same tokens).
    references = [Stream(grpc_address, p, MAX_TOKENS) for p in prompts]
    for s in references:
        s.run()
    assert [s.tokens for s in streams] == [s.tokens for s in references]
    assert all(len(s.tokens) == MAX_TOKENS for s in streams)
    retries = frontend_counter(url, "splitserve_worker_retries_total") - retried
    # Each of the victim's requests was retried (no token yet) or, if its first
    # token came back in the instant before the kill, resumed.
    assert retries >= 1
    assert retries + frontend_counter(url, "splitserve_requests_migrated_total") - migrated == in_prefill
    wait_until(lambda: (p0 := cluster(url)["p0"])["free_blocks"] == p0["total_blocks"]
               and p0["kv_transfers_pending"] == 0 and p0["running"] == 0, 60,
               "p0 kept blocks for the dead decode worker")
    print(f"decode {victim} killed with {in_prefill} requests waiting on p0")


def test_a_frontend_killed_and_restarted_while_another_serves(stack, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Two frontends on one cluster: the second is SIGKILLed with a stream in
    flight and started again on its ports; clients of the first are served
    throughout (none fails), and no worker keeps the orphaned stream."""
    url, grpc_address, workers, _, _, _ = stack
    ensure_decode_workers(stack)
    wait_until(lambda: health(url).get("healthy_prefill_workers") == 1, 30, "p0 is not up")
    decodes = f"{workers['d0'].address},{workers['d1'].address}"
    flags = ("--decode", decodes, "--prefill", workers["p0"].address, "--log-level", "warning")
    second = FrontendProc(tmp_path, "second", *flags)
    stop = threading.Event()
    done: list[Stream] = []

    def client(i: int) -> None:
        while not stop.is_set():
            s = Stream(grpc_address, f"{PROMPTS[i]} (again {len(done)})", 8)
            s.run()
            done.append(s)

    clients = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(2)]
    try:
        wait_until(lambda: health(second.url).get("healthy_decode_workers") == 2, 120, second.tail())
        for c in clients:
            c.start()
        orphan = Stream(second.grpc_address, PROMPTS[6], 400)
        orphan.start()
        wait_until(lambda: bool(orphan.tokens), 60, "the second frontend's stream never started")
        second.popen.kill()
        second.popen.wait(30)
        assert len(orphan.tokens) < 400  # killed mid-stream
        mark = len(done)
        wait_until(lambda: len(done) >= mark + 4, 120, "the first frontend stopped serving")
        second = FrontendProc(tmp_path, "second-again", *flags, ports=(second.port, second.grpc_port))
        wait_until(lambda: health(second.url).get("healthy_decode_workers") == 2, 120, second.tail())
        assert len(Stream(second.grpc_address, PROMPTS[7], 8).complete()) == 8
        mark = len(done)
        wait_until(lambda: len(done) >= mark + 2, 120, "no load after the restart")
    finally:
        stop.set()
        for c in clients:
            c.join(200)
        second.stop()
    orphan.join(30)
    assert orphan.error is not None  # its frontend died under it
    assert done and all(s.error is None and len(s.tokens) == 8 for s in done), \
        [(s.error, len(s.tokens)) for s in done if s.error or len(s.tokens) != 8]
    wait_until(lambda: all(w["running"] == 0 and w["free_blocks"] == w["total_blocks"]
                           for w in cluster(url).values()), 60, "a worker kept the orphaned stream")
