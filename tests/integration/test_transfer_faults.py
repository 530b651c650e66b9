"""Faults inside a KV transfer (issue 13, docs/ARCHITECTURE.md invariants 3, 4, 6): the
prefill worker's sender stalls after some blocks have moved (tests/faults.py,
which writes a signal file when it stalls and counts the blocks each decode
worker received), and then:

- the request is cancelled while the sender is hung (its event loop frozen):
  bytes had landed, every block comes back on both sides, and a later request
  that reuses the blocks gets the right tokens although the sender, released,
  tries to go on writing into them;
- the sender's own transfer timeout ends the transfer mid-way: the decode
  worker recomputes the prompt and answers right;
- the decode worker receiving it is SIGKILLed (through the frontend): the
  frontend retries on the other decode worker, the prefill worker lets go.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from engine import LLM, SamplingParams
from protos import pb, pb_grpc
from services.convert import sampling_to_proto

from ..faults import kv_transfer_fault_env
from .procs import FrontendProc, Proc, Stream, start_peers, wait_for_file, wait_until
from .test_failover import frontend_counter, health
from .test_worker_faults import first_report

STALL_AFTER = 2  # blocks moved before the sender stalls
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = "The harbour master counted the boats, the nets, the gulls and the crates on the quay at dawn. " * 5
LATER = "A later request: the baker, the smith and the weaver each told their story of the long winter. " * 6


@dataclass
class Stalls:
    """One worker's fault signals (see tests/faults.py, kv_transfer_fault_env)."""

    dir: Path
    proc: Proc
    count: int = 0  # stalls seen so far

    def next(self, timeout: float = 120) -> int:
        """Wait for this worker's next stall; the blocks it had sent."""
        self.count += 1
        return int(wait_for_file(self.dir / f"stalled-{self.count}", timeout, self.proc))

    def release(self) -> None:
        (self.dir / f"release-{self.count}").touch()

    def resumed(self, timeout: float = 60) -> None:
        """Wait until the released sender went on."""
        wait_for_file(self.dir / f"resumed-{self.count}", timeout, self.proc)

    def received(self) -> int:
        path = self.dir / "received"
        return int(path.read_text()) if path.exists() else 0


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(dtype="float32", num_blocks=128, num_threads=1, max_model_len=1024)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[tuple[dict[str, Proc], dict[str, Stalls]]]:  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("transfer-faults")
    stall = {"stall_after_blocks": STALL_AFTER, "stall_count": 100}
    faults = {
        "phang": dict(stall, freeze=True),  # hung: frozen event loop until released
        "ptimeout": stall,  # stalls until its own transfer timeout stops it
        "pstall": stall,  # stalls until released or stopped
        "d0": {"count_received": True},
        "d1": {"count_received": True},
    }
    decode = ["--local-prefill-threshold", "8", "--kv-transfer-timeout", "120"]
    procs = start_peers(tmp, {
        "phang": ["--num-blocks", "64"],
        "ptimeout": ["--num-blocks", "64", "--kv-transfer-timeout", "4"],
        "pstall": ["--num-blocks", "64"],
        # Few blocks: a later request must reuse those of a cancelled transfer.
        "d0": ["--num-blocks", "16", *decode],
        "d1": ["--num-blocks", "64", *decode],
    }, env={name: kv_transfer_fault_env(tmp / name, **f) for name, f in faults.items()})
    try:
        yield procs, {name: Stalls(tmp / name, procs[name]) for name in faults}
    finally:
        for name, p in procs.items():
            if name in faults and faults[name].get("freeze"):
                for k in range(1, 101):  # a frozen sender would not see SIGTERM
                    (tmp / name / f"release-{k}").touch()
            p.stop()


def generate(decode: str, prefill: str, rid: str, ids: list[int], params: SamplingParams = GREEDY):  # type: ignore[no-untyped-def]
    """A streaming Generate on a decode worker (the call, to read or cancel)."""
    ch = grpc.insecure_channel(decode)
    req = pb.WorkerGenerateRequest(request_id=rid, prompt_token_ids=ids, sampling=sampling_to_proto(params),
                                   prefill_address=prefill)
    return ch, pb_grpc.DecodeStub(ch).Generate(req, timeout=180)


def settled(address: str, stub_cls) -> pb.LoadReport:  # type: ignore[no-untyped-def]
    return first_report(address, stub_cls, lambda r: r.running == r.waiting == r.kv_transfers_pending == 0
                        and r.free_blocks == r.total_blocks, timeout=60)


def test_cancel_mid_transfer_then_a_late_write_lands_nowhere(cluster, offline) -> None:  # type: ignore[no-untyped-def]
    procs, stalls = cluster
    d0, hang = procs["d0"], stalls["phang"]
    ids = offline.tokenizer.encode(PROMPT)
    transfer_blocks = -(-len(ids) // 16)
    assert transfer_blocks > STALL_AFTER
    received = stalls["d0"].received()

    ch, call = generate(d0.address, procs["phang"].address, "cancel-mid", ids)
    try:
        assert hang.next() == STALL_AFTER
        # Bytes landed: the decode worker received the blocks sent before the stall.
        wait_until(lambda: stalls["d0"].received() >= received + STALL_AFTER, 30, "no block landed")
        assert first_report(d0.address, pb_grpc.DecodeStub, lambda r: True).kv_transfers_pending == 1
        call.cancel()
    finally:
        ch.close()
    report = settled(d0.address, pb_grpc.DecodeStub)  # the sender is still hung: d0 let go regardless

    # A later request on d0 needs more blocks than were never used: it reuses the cancelled ones.
    later_ids = offline.tokenizer.encode(LATER)
    later_params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    assert -(-(len(later_ids) + 96) // 16) > report.total_blocks - transfer_blocks
    reference = offline.generate([later_ids], later_params)[0].outputs[0].token_ids
    tokens: list[int] = []
    ch, call = generate(d0.address, "", "later", later_ids, later_params)
    reader = threading.Thread(target=lambda: tokens.extend(t for c in call for t in c.token_ids), daemon=True)
    reader.start()
    try:
        wait_until(lambda: bool(tokens), 120, "the later request never started")
        hang.release()
        hang.resumed()  # the sender goes on sending into d0's blocks...
        assert len(tokens) < later_params.max_tokens  # ...while the later request holds them
        settled(procs["phang"].address, pb_grpc.PrefillStub)  # and gives up: its send is over
        reader.join(180)
    finally:
        ch.close()
    assert tokens == reference
    settled(d0.address, pb_grpc.DecodeStub)


def test_sender_timeout_mid_transfer_recomputes(cluster, offline) -> None:  # type: ignore[no-untyped-def]
    """ptimeout's sender stalls after moving blocks; its own 4 s transfer limit
    (not any gRPC deadline: d1's is 120 s) stops it; d1 recomputes."""
    procs, stalls = cluster
    d1 = procs["d1"]
    ids = offline.tokenizer.encode(f"Timeout: {PROMPT}")
    reference = offline.generate([ids], GREEDY)[0].outputs[0].token_ids
    before = first_report(d1.address, pb_grpc.DecodeStub, lambda r: True).counters
    received = stalls["d1"].received()
    result: list[int] = []
    ch, call = generate(d1.address, procs["ptimeout"].address, "timeout-mid", ids)
    reader = threading.Thread(target=lambda: result.extend(t for c in call for t in c.token_ids), daemon=True)
    reader.start()
    try:
        assert stalls["ptimeout"].next() == STALL_AFTER
        wait_until(lambda: stalls["d1"].received() >= received + STALL_AFTER, 30, "no block landed")
        reader.join(180)
    finally:
        ch.close()
    assert result == reference
    after = first_report(d1.address, pb_grpc.DecodeStub, lambda r: True).counters
    assert after["kv_transfer_recomputes"] == before["kv_transfer_recomputes"] + 1
    assert "did not finish within 4.0s" in d1.log.read_text()  # the sender's limit, in the transfer
    settled(d1.address, pb_grpc.DecodeStub)
    settled(procs["ptimeout"].address, pb_grpc.PrefillStub)


def test_decode_killed_mid_transfer_under_the_frontend(cluster, offline, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Through the frontend (prefill: pstall): the decode worker receiving the
    KV is SIGKILLed mid-transfer; the frontend retries on the other one (no
    token was out), which gets the same tokens; pstall frees everything."""
    procs, stalls = cluster
    pstall = stalls["pstall"]
    frontend = FrontendProc(tmp_path, "frontend", "--decode", f"{procs['d0'].address},{procs['d1'].address}",
                            "--prefill", procs["pstall"].address, "--local-prefill-threshold", "32")
    try:
        wait_until(lambda: health(frontend.url).get("healthy_decode_workers") == 2
                   and health(frontend.url).get("healthy_prefill_workers") == 1, 120, frontend.tail())
        ids = offline.tokenizer.encode(f"Killed: {PROMPT}")
        reference = offline.generate([ids], GREEDY)[0].outputs[0].token_ids
        received = {n: stalls[n].received() for n in ("d0", "d1")}
        retries = frontend_counter(frontend.url, "splitserve_worker_retries_total")
        stream = Stream(f"127.0.0.1:{frontend.grpc_port}", ids, GREEDY.max_tokens or 0)
        stream.start()
        assert pstall.next() == STALL_AFTER
        wait_until(lambda: any(stalls[n].received() >= received[n] + STALL_AFTER for n in received), 30,
                   "no block landed")
        victim = next(n for n in received if stalls[n].received() >= received[n] + STALL_AFTER)
        survivor = "d1" if victim == "d0" else "d0"
        procs[victim].kill()
        assert not stream.tokens  # it died before the first token
        # The retry goes through pstall again: its transfer stalls too, and is let go.
        assert pstall.next() == STALL_AFTER
        pstall.release()
        assert stream.result() == reference
        assert frontend_counter(frontend.url, "splitserve_worker_retries_total") == retries + 1
        settled(procs["pstall"].address, pb_grpc.PrefillStub)
        settled(procs[survivor].address, pb_grpc.DecodeStub)
    finally:
        frontend.stop()
