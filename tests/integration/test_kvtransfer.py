"""Real UCX between real processes: blocks arrive bit-exact where they should,
and no ending of a transfer (mismatch, timeout, cancel, a killed sender) lets
a byte land in the receiver's blocks afterwards (invariant 3) or stops it serving.

Three spawned processes, shared by the tests: a decode-side receiver (`rx`),
a prefill-side sender (`tx`) and a sender that test (e) kills (`victim`).
Every wait is bounded; the fixture stops them all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtransfer.sender import SendFault
from tests.kv_peers import CacheSpec, PeerError, PeerProcess

from .procs import ROOT, wait_until

pytestmark = pytest.mark.timeout(120)

NUM_BLOCKS = 128
F32 = CacheSpec(dtype="float32", num_blocks=NUM_BLOCKS, seed=1)
BF16 = CacheSpec(dtype="bfloat16", num_blocks=NUM_BLOCKS, seed=2)
BLOCK_BYTES = F32.layout().block_bytes  # 4 layers x 2 x 16 x 2 heads x 64 x 4 bytes = 64 KiB
# 4 MiB blocks take milliseconds each, so a cancel lands while blocks are on the wire
# Takes connections that arrive on 127.0.0.1 only (as a worker started with --host 127.0.0.1).
LOCAL = dataclasses.replace(F32, seed=4)
BIG = CacheSpec(dtype="float32", num_blocks=8, num_layers=32, num_kv_heads=8, head_dim=128, seed=3)
_ids = itertools.count()


def tid(prefix: str) -> str:
    return f"{prefix}-{next(_ids)}"


class Peers:
    def __init__(self) -> None:
        self.rx = PeerProcess({"f32": F32, "bf16": BF16, "big": BIG, "local": LOCAL},
                              options={"local": {"listen_host": "127.0.0.1"}})
        self.tx = PeerProcess(
            {"f32": CacheSpec(dtype="float32", num_blocks=NUM_BLOCKS, seed=11),
             "bf16": CacheSpec(dtype="bfloat16", num_blocks=NUM_BLOCKS, seed=12),
             "f32_impatient": CacheSpec(dtype="float32", num_blocks=NUM_BLOCKS, seed=13),
             "big": dataclasses.replace(BIG, seed=14),
             # same as bf16 but for two fields, both of which the error must name
             "odd": CacheSpec(dtype="bfloat16", num_blocks=NUM_BLOCKS, num_layers=2, model_id="other-model")},
            options={"f32_impatient": {"timeout_s": 1.0}}, timeout_s=20.0)
        self.victim = PeerProcess({"f32": CacheSpec(dtype="float32", num_blocks=NUM_BLOCKS, seed=21)})
        self.all = [self.rx, self.tx, self.victim]
        try:
            for p in self.all:
                p.wait_ready(timeout=90)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for p in self.all:
            p.request_stop()
        for p in self.all:
            p.stop(timeout=10)


@pytest.fixture(scope="module")
def peers() -> Iterator[Peers]:
    p = Peers()
    try:
        yield p
    finally:
        p.stop()


def sample_ids(seed: str, n: int = 64) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    return rng.sample(range(NUM_BLOCKS), n), rng.sample(range(NUM_BLOCKS), n)

def assert_only(after: list[str], before: list[str], expected: dict[int, str]) -> None:
    """Blocks in `expected` hold those digests; every other block is as before."""
    for b in range(NUM_BLOCKS):
        assert after[b] == expected.get(b, before[b]), f"block {b}"


def moved(src_digests: list[str], src: list[int], dst: list[int]) -> dict[int, str]:
    """What destination blocks hold once src[i] was copied into dst[i]."""
    return {d: src_digests[s] for s, d in zip(src, dst, strict=True)}


def public_ipv4() -> str | None:
    """One of this host's global-scope IPv4 addresses, if it has any."""
    out = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True,
                         text=True, check=False).stdout.split()
    return out[out.index("inet") + 1].split("/")[0] if "inet" in out else None


def raised(peer: PeerProcess, cmd: str, *args: object, timeout: float = 15.0) -> PeerError:
    with pytest.raises(PeerError) as info:
        peer.call(cmd, *args, timeout=timeout)
    return info.value


@pytest.mark.parametrize("name", ["f32", "bf16"])
def test_blocks_arrive_bit_exact_in_exactly_their_destinations(peers: Peers, name: str) -> None:
    rx, tx = peers.rx, peers.tx
    src_digests = tx.call("digests", name)
    for round_ in range(2):  # the second transfer reuses the pooled connection
        before = rx.call("digests", name)
        src, dst = sample_ids(f"{name}{round_}")
        t = tid(name)
        tok = rx.call("expect", name, t, dst)
        nbytes, _ = tx.call("send", name, rx.addresses[name], t, src, dst, tok)
        block_bytes = BLOCK_BYTES // (2 if name == "bf16" else 1)
        assert nbytes == 64 * block_bytes
        assert rx.call("wait", t, 10.0) == nbytes
        assert_only(rx.call("digests", name), before, moved(src_digests, src, dst))
    stats = rx.call("stats", name)["received"]
    assert stats["ok"] >= 2 and stats["failed"] == 0 and stats["bytes"] >= 2 * nbytes


def test_concurrent_transfers_to_one_receiver(peers: Peers) -> None:
    """Each transfer in flight gets a connection of its own (so that cancelling one
    closes nothing else); all four land."""
    rx, tx = peers.rx, peers.tx
    before, src_digests = rx.call("digests", "f32"), tx.call("digests", "f32")
    src, dst = sample_ids("concurrent")
    parts = [(tid("concurrent"), src[i::4], dst[i::4]) for i in range(4)]
    tokens = {t: rx.call("expect", "f32", t, d) for t, _, d in parts}
    sends = [tx.submit("send", "f32", rx.addresses["f32"], t, s, d, tokens[t]) for t, s, d in parts]
    for req, (t, s, _) in zip(sends, parts, strict=True):
        assert tx.result(req, timeout=15.0)[0] == len(s) * BLOCK_BYTES
        assert rx.call("wait", t, 10.0) == len(s) * BLOCK_BYTES
    assert_only(rx.call("digests", "f32"), before, moved(src_digests, src, dst))


def test_layout_mismatch_is_clear_on_both_sides_and_receiver_keeps_serving(peers: Peers) -> None:
    rx, tx = peers.rx, peers.tx
    src, dst = sample_ids("mismatch", 8)
    t = tid("mismatch")
    before = rx.call("digests", "bf16")
    tok = rx.call("expect", "bf16", t, dst)
    err = raised(tx, "send", "odd", rx.addresses["bf16"], t, src, dst, tok)
    assert err.type_name == "LayoutMismatch"
    assert "model_id: local 'other-model' vs remote 'test-model'" in err.message
    assert "num_layers: local 2 vs remote 4" in err.message
    wait_until(lambda: rx.call("stats", "bf16")["received"]["layout_mismatches"] == 1, 10,
               "the mismatched layout was never counted")
    assert tx.call("stats", "odd")["sent"]["layout_mismatches"] == 1
    assert rx.call("digests", "bf16") == before
    # the same announced transfer then arrives from a compatible sender
    nbytes, _ = tx.call("send", "bf16", rx.addresses["bf16"], t, src, dst, tok)
    assert rx.call("wait", t, 10.0) == nbytes


def test_stalled_sender_times_out_and_nothing_lands_afterwards(peers: Peers) -> None:
    rx, tx = peers.rx, peers.tx
    src, dst = sample_ids("stall")
    t = tid("stall")
    before, src_digests = rx.call("digests", "f32"), tx.call("digests", "f32_impatient")
    tx.call("fault", "f32_impatient", SendFault(stall_after_blocks=8, stall_s=30.0))
    try:
        tok = rx.call("expect", "f32", t, dst)
        start = time.monotonic()
        err = raised(tx, "send", "f32_impatient", rx.addresses["f32"], t, src, dst, tok)
        assert err.type_name == "TransferTimeout", err
        assert time.monotonic() - start < 4.0
        # the sender hung up, so the receiver's future fails at once, and cancel is a no-op
        assert raised(rx, "wait", t, 5.0).type_name == "TransferFailed"
        assert rx.call("cancel", "f32", t) < 1.0
    finally:
        tx.call("fault", "f32_impatient", None)
    landed = moved(src_digests, src[:8], dst[:8])
    assert_only(rx.call("digests", "f32"), before, landed)
    time.sleep(0.3)
    assert_only(rx.call("digests", "f32"), before, landed)


def test_hung_sender_times_out_and_nothing_lands_after_cancel(peers: Peers) -> None:
    """The sender's event loop freezes for 2 s after 8 blocks (a hung process; UCX's
    own thread runs on).  The receiver cancels meanwhile; the sender wakes up past its
    1 s limit, tries to go on and raises TransferTimeout; nothing of it lands."""
    rx, tx = peers.rx, peers.tx
    src, dst = sample_ids("hung")
    t = tid("hung")
    before, src_digests = rx.call("digests", "f32"), tx.call("digests", "f32_impatient")
    tok = rx.call("expect", "f32", t, dst)
    tx.call("fault", "f32_impatient", SendFault(stall_after_blocks=8, stall_s=2.0, freeze_loop=True))
    try:
        send = tx.submit("send", "f32_impatient", rx.addresses["f32"], t, src, dst, tok)
        landed = moved(src_digests, src[:8], dst[:8])
        wait_until(lambda: all(rx.call("digests", "f32")[d] == h for d, h in landed.items()), 10,
                   "the blocks never landed")
        assert rx.call("cancel", "f32", t) < 1.0  # returns while the sender is still frozen
        snapshot = rx.call("digests", "f32")
        assert raised(rx, "wait", t, 5.0).type_name == "TransferCancelled"
        with pytest.raises(PeerError) as info:
            tx.result(send, timeout=15.0)
        assert info.value.type_name == "TransferTimeout", info.value
    finally:
        tx.call("fault", "f32_impatient", None)
    assert rx.call("digests", "f32") == snapshot
    assert_only(snapshot, before, landed)
    # the receiver serves a new transfer into the same (freed and reused) blocks
    t2 = tid("hung-after")
    tx_digests = tx.call("digests", "f32")
    tok2 = rx.call("expect", "f32", t2, dst)
    tx.call("send", "f32", rx.addresses["f32"], t2, src, dst, tok2)
    assert rx.call("wait", t2, 10.0) == 64 * BLOCK_BYTES
    assert_only(rx.call("digests", "f32"), before, moved(tx_digests, src, dst))


def test_receiver_timeout_and_wrong_destinations(peers: Peers) -> None:
    rx, tx = peers.rx, peers.tx
    src, dst = sample_ids("rx-timeout", 4)
    t = tid("rx-timeout")
    tok = rx.call("expect", "f32", t, dst, 0.3)
    assert raised(rx, "wait", t, 5.0).type_name == "TransferTimeout"
    assert rx.call("stats", "f32")["received"]["timed_out"] >= 1
    t = tid("wrong-dst")
    tok = rx.call("expect", "f32", t, dst)
    err = raised(tx, "send", "f32", rx.addresses["f32"], t, src, dst[::-1], tok)
    assert err.type_name == "TransferRejected" and "reserved" in err.message, err
    nbytes, _ = tx.call("send", "f32", rx.addresses["f32"], t, src, dst, tok)  # the link is still usable
    assert rx.call("wait", t, 10.0) == nbytes


@pytest.mark.parametrize("token", [b"", b"\0" * 16, "other"], ids=["none", "zeros", "another's"])
def test_a_sender_without_the_transfers_token_writes_nothing(peers: Peers, token: bytes | str) -> None:
    """A sender that knows the transfer id and the exact destination blocks but not
    the token the receiver issued (none, a guess, another transfer's) is refused
    before a receive is posted; the invited transfer then still lands."""
    rx, tx = peers.rx, peers.tx
    src, dst = sample_ids(f"token-{token!r}")
    t, other = tid("token"), tid("token-other")
    before, src_digests = rx.call("digests", "f32"), tx.call("digests", "f32")
    tok = rx.call("expect", "f32", t, dst)
    other_tok = rx.call("expect", "f32", other, [b for b in range(NUM_BLOCKS) if b not in dst][:4])
    rogue = other_tok if token == "other" else token
    bad_before = rx.call("stats", "f32")["received"]["bad_tokens"]
    err = raised(tx, "send", "f32", rx.addresses["f32"], t, src, dst, rogue)
    assert err.type_name == "TransferRejected" and "token is missing or wrong" in err.message, err
    assert rx.call("stats", "f32")["received"]["bad_tokens"] == bad_before + 1
    assert rx.call("digests", "f32") == before  # not one byte landed
    nbytes, _ = tx.call("send", "f32", rx.addresses["f32"], t, src, dst, tok)
    assert rx.call("wait", t, 10.0) == nbytes
    assert_only(rx.call("digests", "f32"), before, moved(src_digests, src, dst))
    # one-time: the same token cannot write these blocks again
    err = raised(tx, "send", "f32", rx.addresses["f32"], t, src, dst, tok)
    assert err.type_name == "TransferRejected" and "not expected" in err.message, err
    rx.call("cancel", "f32", other)


def test_cancel_before_the_data_refuses_the_sender(peers: Peers) -> None:
    rx, tx = peers.rx, peers.tx
    src, dst = sample_ids("early")
    t = tid("early")
    before = rx.call("digests", "f32")
    tok = rx.call("expect", "f32", t, dst)
    assert rx.call("cancel", "f32", t) < 1.0
    assert raised(rx, "wait", t, 5.0).type_name == "TransferCancelled"
    err = raised(tx, "send", "f32", rx.addresses["f32"], t, src, dst, tok)
    assert err.type_name == "TransferRejected" and "not expected" in err.message
    assert rx.call("digests", "f32") == before
    assert rx.call("stats", "f32")["received"]["cancelled"] >= 1


@pytest.mark.parametrize("stall_after", [4, None])
def test_cancel_while_blocks_arrive(peers: Peers, stall_after: int | None) -> None:
    """With a stall: cancel after 4 blocks landed.  Without: cancel races the whole
    transfer; either way nothing changes once cancel() has returned."""
    rx, tx = peers.rx, peers.tx
    src, dst = sample_ids(f"racing{stall_after}")
    t = tid("racing")
    before, src_digests = rx.call("digests", "f32"), tx.call("digests", "f32")
    tok = rx.call("expect", "f32", t, dst)
    if stall_after is not None:
        tx.call("fault", "f32", SendFault(stall_after_blocks=stall_after, stall_s=1.0))
    try:
        send = tx.submit("send", "f32", rx.addresses["f32"], t, src, dst, tok)
        if stall_after is not None:
            last = stall_after - 1
            wait_until(lambda: rx.call("digests", "f32")[dst[last]] == src_digests[src[last]], 10,
                       "the last block before the stall never landed")
        assert rx.call("cancel", "f32", t) < 1.0
        snapshot = rx.call("digests", "f32")
        try:
            tx.result(send, timeout=15.0)  # without a stall the transfer may have won the race
            assert stall_after is None
        except PeerError as e:
            assert e.type_name in ("TransferFailed", "TransferRejected"), e
            if stall_after is not None:  # it woke up after the cancel and found the connection gone
                assert e.type_name == "TransferFailed" and "mid-transfer" in e.message, e
    finally:
        tx.call("fault", "f32", None)
    time.sleep(0.2)
    assert rx.call("digests", "f32") == snapshot
    for b in range(NUM_BLOCKS):
        if b not in dst:
            assert snapshot[b] == before[b], f"block {b} is not a destination"


def test_cancel_at_random_points_while_large_blocks_are_in_flight(peers: Peers) -> None:
    rx, tx = peers.rx, peers.tx
    rng = random.Random(7)
    blocks = list(range(BIG.num_blocks))
    for _ in range(4):
        t = tid("big")
        tok = rx.call("expect", "big", t, blocks[::-1])
        send = tx.submit("send", "big", rx.addresses["big"], t, blocks, blocks[::-1], tok)
        time.sleep(rng.uniform(0.0, 0.05))
        assert rx.call("cancel", "big", t) < 1.0
        snapshot = rx.call("digests", "big")
        try:
            tx.result(send, timeout=15.0)
        except PeerError as e:
            assert e.type_name in ("TransferFailed", "TransferRejected"), e
        time.sleep(0.1)
        assert rx.call("digests", "big") == snapshot


def test_sender_killed_mid_transfer(peers: Peers) -> None:
    rx, tx, victim = peers.rx, peers.tx, peers.victim
    src, dst = sample_ids("killed")
    t = tid("killed")
    before, src_digests = rx.call("digests", "f32"), victim.call("digests", "f32")
    tok = rx.call("expect", "f32", t, dst)
    victim.call("fault", "f32", SendFault(stall_after_blocks=8, stall_s=60.0))
    victim.submit("send", "f32", rx.addresses["f32"], t, src, dst, tok)
    wait_until(lambda: rx.call("digests", "f32")[dst[7]] == src_digests[src[7]], 10, "block 7 never landed")
    victim.kill()
    start = time.monotonic()
    err = raised(rx, "wait", t, 10.0)
    assert err.type_name == "TransferFailed" and time.monotonic() - start < 5.0, err
    assert rx.call("cancel", "f32", t) < 1.0
    landed = moved(src_digests, src[:8], dst[:8])
    assert_only(rx.call("digests", "f32"), before, landed)
    # a live sender's transfer into the same blocks is served
    t2 = tid("after-kill")
    tok2 = rx.call("expect", "f32", t2, dst)
    tx_digests = peers.tx.call("digests", "f32")
    tx.call("send", "f32", rx.addresses["f32"], t2, src, dst, tok2)
    assert rx.call("wait", t2, 10.0) == 64 * BLOCK_BYTES
    assert_only(rx.call("digests", "f32"), before, moved(tx_digests, src, dst))


def wakeups(pid: int) -> int:
    """Times the process's threads have gone to sleep and been woken, so far."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            for line in (task / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split()[1])
    return total


def test_an_idle_transport_lets_its_process_sleep(peers: Peers) -> None:
    """ucxx's progress thread waited 1 ms in epoll and woke ~900 times a second with
    nothing to do, a few percent of a core in every idle worker (and a core taken
    from the engine's kernels at each wake-up under load).  The receiver holds four
    transports, has received transfers and is idle now: all its threads together
    (the event loop, UCX's, torch's) wake a few dozen times a second."""
    rx, tx = peers.rx, peers.tx
    src, dst = sample_ids("idle", 8)
    t = tid("idle")
    tok = rx.call("expect", "f32", t, dst)
    nbytes, _ = tx.call("send", "f32", rx.addresses["f32"], t, src, dst, tok)
    assert rx.call("wait", t, 10.0) == nbytes  # the transfer, and with it UCX's threads, have run
    pid = rx.process.pid
    assert pid is not None
    before, start = wakeups(pid), time.monotonic()
    time.sleep(2.0)  # the measurement is a rate over a window
    rate = (wakeups(pid) - before) / (time.monotonic() - start)
    assert rate < 300, f"the idle receiver's threads woke {rate:.0f} times a second"


def test_a_connection_off_the_listen_host_is_closed_unread(peers: Peers) -> None:
    """UCX listens on every interface (ucxx takes a port, no address), so a transport
    given a listen host closes each connection that arrived on another local address
    before reading from it: dialled at this host's public address (not its listen
    host) the transfer fails and no block changes; at 127.0.0.1 the same one lands."""
    rx, tx = peers.rx, peers.tx
    address = rx.addresses["local"]
    assert address.startswith("127.0.0.1:")
    public = public_ipv4()
    if public is None:
        pytest.skip("this host has no address but loopback to dial from outside it")
    off_host = f"{public}:{address.rsplit(':', 1)[1]}"
    src, dst = sample_ids("listen-host")
    before, src_digests = rx.call("digests", "local"), tx.call("digests", "f32")
    t = tid("listen-host")
    tok = rx.call("expect", "local", t, dst)
    err = raised(tx, "send", "f32", off_host, t, src, dst, tok, timeout=30.0)
    assert err.type_name in ("TransferFailed", "TransferTimeout"), err
    assert rx.call("stats", "local")["received"]["off_host_connections"] == 1
    assert rx.call("digests", "local") == before  # not a byte landed
    nbytes, _ = tx.call("send", "f32", address, t, src, dst, tok)
    assert rx.call("wait", t, 10.0) == nbytes
    assert_only(rx.call("digests", "local"), before, moved(src_digests, src, dst))
    assert rx.call("stats", "local")["received"]["off_host_connections"] == 1


# Starts a transport the way a worker does, recording which thread imports readline (if
# anything does).  (os.environ cannot show the setenv itself: it does not see C's.)
ENV_PROBE = r"""
import asyncio, sys, threading
from kvtransfer.transport import KVTransport
from tests.kv_peers import CacheSpec, make_cache
imports = []
sys.addaudithook(lambda event, args: event == "import" and args[0] == "readline" and imports.append(
    threading.current_thread() is threading.main_thread()))

async def main():
    spec = CacheSpec(num_blocks=8)
    t = KVTransport(make_cache(spec), spec.layout())
    await t.start()
    await asyncio.sleep(1.0)  # the progress thread's start-up runs meanwhile
    print("readline imported on the main thread:", imports)
    await t.close()

asyncio.run(main())
from kvtransfer.ucx_env import shutdown_ucx
shutdown_ucx()
"""


def test_ucx_threads_leave_the_environment_alone() -> None:
    """ucxx's progress thread imports cuda.core, and with it readline, whose set-up
    writes LINES and COLUMNS into the environment: from that thread, beside a
    getenv on the main thread, a worker died of SIGSEGV in getenv at start.
    The transport imports it first, on its own thread."""
    out = subprocess.run([sys.executable, "-c", ENV_PROBE], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in out.stdout.splitlines() if ": " in line)
    # one True per import event: on the main thread each time
    assert "False" not in lines["readline imported on the main thread"], out.stdout
