"""Faults in the split (DESIGN.md invariants 3, 4, 6): a prefill worker killed
with requests in flight, a transfer that times out, a request cancelled
mid-transfer.  Every request still ends right; every block comes back."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from engine import LLM, SamplingParams
from protos import pb, pb_grpc
from services.convert import sampling_to_proto

from .procs import address, free_port, peer_flag, start_worker

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [f"Request number {i}: describe the weather in a city you like, in detail. " * 3 for i in range(6)]


@pytest.fixture(scope="module")
def offline():  # type: ignore[no-untyped-def]
    return LLM(dtype="float32", num_blocks=128, num_threads=1, max_model_len=1024)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("faults")
    ports = {name: free_port() for name in ("victim", "slow", "d0")}
    d0 = peer_flag("prefill", [address(ports["d0"])])
    prefills = peer_flag("decode", [address(ports["victim"]), address(ports["slow"])])
    procs = {
        "victim": start_worker("prefill", "victim", tmp, "--num-blocks", "128", "--grpc-port",
                               str(ports["victim"]), *d0),
        "slow": start_worker("prefill", "slow", tmp, "--num-blocks", "128", "--fault-send-delay", "4",
                             "--grpc-port", str(ports["slow"]), *d0),
        "d0": start_worker("decode", "d0", tmp, "--num-blocks", "128", "--local-prefill-threshold", "8",
                           "--kv-transfer-timeout", "2", "--grpc-port", str(ports["d0"]), *prefills),
    }
    try:
        for p in procs.values():
            p.wait_ready()
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def free_blocks(address: str, stub_cls) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    with grpc.insecure_channel(address) as ch:
        r = next(iter(stub_cls(ch).WatchLoad(pb.LoadRequest(interval_seconds=0.1))))
        return r.free_blocks, r.total_blocks


def wait_all_free(address: str, stub_cls, timeout: float = 10) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        free, total = free_blocks(address, stub_cls)
        if free == total:
            return True
        time.sleep(0.1)
    return False


def run(decode: str, prefill: str, rid: str, ids: list[int]) -> list[int]:
    with grpc.insecure_channel(decode) as ch:
        req = pb.WorkerGenerateRequest(request_id=rid, prompt_token_ids=ids,
                                       sampling=sampling_to_proto(GREEDY), prefill_address=prefill)
        return [t for c in pb_grpc.DecodeStub(ch).Generate(req, timeout=120) for t in c.token_ids]


def test_transfer_timeout_recomputes(cluster, offline) -> None:  # type: ignore[no-untyped-def]
    ids = offline.tokenizer.encode(PROMPTS[0])
    ref = offline.generate(ids, GREEDY)[0].outputs[0].token_ids
    before = next(iter(pb_grpc.DecodeStub(grpc.insecure_channel(cluster["d0"].address)).WatchLoad(
        pb.LoadRequest(interval_seconds=0.1)))).counters
    assert run(cluster["d0"].address, cluster["slow"].address, "slow-1", ids) == ref
    after = next(iter(pb_grpc.DecodeStub(grpc.insecure_channel(cluster["d0"].address)).WatchLoad(
        pb.LoadRequest(interval_seconds=0.1)))).counters
    assert after["kv_transfer_recomputes"] == before["kv_transfer_recomputes"] + 1
    assert wait_all_free(cluster["d0"].address, pb_grpc.DecodeStub)
    # The slow sender later tries to send into blocks that are gone: refused, and its hold is freed.
    assert wait_all_free(cluster["slow"].address, pb_grpc.PrefillStub, timeout=15)


def test_cancel_mid_transfer_frees_both_sides(cluster, offline) -> None:  # type: ignore[no-untyped-def]
    ids = offline.tokenizer.encode(PROMPTS[1])
    with grpc.insecure_channel(cluster["d0"].address) as ch:
        req = pb.WorkerGenerateRequest(request_id="cancel-me", prompt_token_ids=ids,
                                       sampling=sampling_to_proto(GREEDY),
                                       prefill_address=cluster["slow"].address)
        call = pb_grpc.DecodeStub(ch).Generate(req, timeout=60)
        time.sleep(1.5)  # the prefill is done and the slow sender is holding its blocks
        call.cancel()
    assert wait_all_free(cluster["d0"].address, pb_grpc.DecodeStub)
    assert wait_all_free(cluster["slow"].address, pb_grpc.PrefillStub, timeout=15)
    # A later request on the same blocks is not corrupted.
    ids2 = offline.tokenizer.encode(PROMPTS[2])
    ref = offline.generate(ids2, GREEDY)[0].outputs[0].token_ids
    assert run(cluster["d0"].address, "", "after-cancel", ids2) == ref


def test_prefill_killed_with_requests_in_flight(cluster, offline) -> None:  # type: ignore[no-untyped-def]
    prompts = [offline.tokenizer.encode(p) for p in PROMPTS[2:6]]
    refs = [o.outputs[0].token_ids for o in offline.generate(prompts, GREEDY)]
    results: dict[int, list[int] | Exception] = {}

    def one(i: int) -> None:
        try:
            results[i] = run(cluster["d0"].address, cluster["victim"].address, f"kill-{i}", prompts[i])
        except Exception as e:  # noqa: BLE001 - recorded and asserted below
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    time.sleep(0.3)
    cluster["victim"].kill()
    for t in threads:
        t.join(timeout=120)
    assert [results[i] for i in range(len(prompts))] == refs
    assert wait_all_free(cluster["d0"].address, pb_grpc.DecodeStub)
