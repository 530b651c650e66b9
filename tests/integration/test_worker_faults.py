"""Faults in the split (docs/ARCHITECTURE.md, invariants 3, 4, 6): a prefill worker killed
with requests in flight (called directly and through the frontend), a transfer
that times out, a request cancelled mid-transfer.  Every request still ends
right; every block comes back."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

import grpc
import pytest

from engine import LLM, SamplingParams
from protos import pb, pb_grpc
from services.convert import sampling_to_proto

from ..faults import fault_env
from . import forkserver
from .procs import Proc, address, free_port, peer_flag, start_worker, stop_all

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [f"Request number {i}: describe the weather in a city you like, in detail. " * 3 for i in range(6)]
# About 200 tokens each: four of them keep a prefill worker busy for a while.
LONG = "Describe the harbour, the boats, the gulls and the people of a quiet town at dawn, in detail. " * 10


@pytest.fixture(scope="module")
def offline():  # type: ignore[no-untyped-def]
    return LLM(dtype="float32", num_blocks=128, num_threads=1, max_model_len=1024)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("faults")
    # Fixed ports: each worker knows the other role's, and the victim restarts on its address.
    ports = {name: free_port() for name in ("victim", "slow", "d0", "d1")}
    decodes = peer_flag("prefill", [address(ports["d0"]), address(ports["d1"])])
    prefills = peer_flag("decode", [address(ports["victim"]), address(ports["slow"])])
    procs = {
        "victim": start_victim(tmp, ports["victim"], decodes),
        "slow": start_worker("prefill", "slow", tmp, "--num-blocks", "128", "--grpc-port", str(ports["slow"]),
                             *decodes, env=fault_env(send_delay=4)),
        "d0": start_worker("decode", "d0", tmp, "--num-blocks", "128", "--local-prefill-threshold", "8",
                           "--kv-transfer-timeout", "2", "--grpc-port", str(ports["d0"]), *prefills),
        # No transfer times out here: its recomputes come from the kills alone.
        "d1": start_worker("decode", "d1", tmp, "--num-blocks", "256", "--local-prefill-threshold", "8",
                           "--kv-transfer-timeout", "120", "--grpc-port", str(ports["d1"]), *prefills),
    }
    try:
        for p in procs.values():
            p.wait_ready()
        yield procs
    finally:
        stop_all(procs.values())


def start_victim(tmp, port: int, decodes: list[str]) -> Proc:  # type: ignore[no-untyped-def]
    return start_worker("prefill", "victim", tmp, "--num-blocks", "128", "--grpc-port", str(port), *decodes)


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
    assert "fault: KV send of slow-1 waits" in cluster["slow"].tail(1 << 20)  # the sender was held back
    after = next(iter(pb_grpc.DecodeStub(grpc.insecure_channel(cluster["d0"].address)).WatchLoad(
        pb.LoadRequest(interval_seconds=0.1)))).counters
    assert after["kv_transfer_recomputes"] == before["kv_transfer_recomputes"] + 1
    assert wait_all_free(cluster["d0"].address, pb_grpc.DecodeStub)
    # The slow sender later tries to send into blocks that are gone: refused, and its hold is freed.
    assert wait_all_free(cluster["slow"].address, pb_grpc.PrefillStub, timeout=15)


def first_report(address: str, stub_cls, cond, timeout: float = 60) -> pb.LoadReport:  # type: ignore[no-untyped-def]
    """The first of `address`'s load reports for which `cond` holds."""
    with grpc.insecure_channel(address) as ch:
        for report in stub_cls(ch).WatchLoad(pb.LoadRequest(interval_seconds=0.05), timeout=timeout):
            if cond(report):
                return report  # type: ignore[no-any-return]
    raise AssertionError(f"{address}: load stream ended")


def test_cancel_while_the_kv_is_awaited_frees_both_sides(cluster, offline) -> None:  # type: ignore[no-untyped-def]
    """Cancelled once the prompt is computed and the (slow) sender holds its
    blocks while d1 awaits them: the sender stalls before its first byte
    (cancels between UCX bytes are test_kvtransfer's)."""
    ids = offline.tokenizer.encode(PROMPTS[1])
    d1 = cluster["d1"].address  # its transfers never time out: the cancel is what ends this one
    with grpc.insecure_channel(d1) as ch:
        req = pb.WorkerGenerateRequest(request_id="cancel-me", prompt_token_ids=ids,
                                       sampling=sampling_to_proto(GREEDY),
                                       prefill_address=cluster["slow"].address)
        call = pb_grpc.DecodeStub(ch).Generate(req, timeout=60)
        first_report(cluster["slow"].address, pb_grpc.PrefillStub,  # computed, blocks held for the send
                     lambda r: r.running == r.waiting == 0 and r.free_blocks < r.total_blocks)
        deadline = time.monotonic() + 30  # the sender is held back by its fault hook
        while "fault: KV send of cancel-me waits" not in cluster["slow"].tail(1 << 20):
            assert time.monotonic() < deadline, cluster["slow"].tail()
            time.sleep(0.05)
        assert first_report(d1, pb_grpc.DecodeStub, lambda r: True).kv_transfers_pending == 1
        call.cancel()
    first_report(d1, pb_grpc.DecodeStub, lambda r: r.running == r.waiting == r.kv_transfers_pending == 0)
    assert wait_all_free(d1, pb_grpc.DecodeStub)
    assert wait_all_free(cluster["slow"].address, pb_grpc.PrefillStub, timeout=15)
    # A later request on the same blocks is not corrupted.
    ids2 = offline.tokenizer.encode(PROMPTS[2])
    ref = offline.generate(ids2, GREEDY)[0].outputs[0].token_ids
    assert run(d1, "", "after-cancel", ids2) == ref


def decode_counters(address: str) -> dict[str, float]:
    return dict(first_report(address, pb_grpc.DecodeStub, lambda r: True).counters)


def run_and_kill(victim: Proc, decode: str, prompts: list[list[int]],
                 call: Callable[[int], list[int]], timeout: float = 120,
                 ) -> tuple[list[list[int] | Exception], pb.LoadReport, dict[str, float]]:
    """The prompts at once through `call`; the victim SIGKILLed as soon as its
    own load report shows prompts being computed (running, tokens still to
    compute).  The victim's report stream is open before the first request
    starts, so no computing window can pass unseen.  Returns each call's
    tokens (or error), the report the kill followed, and how much the decode
    worker's transfer counters rose."""
    before = decode_counters(decode)
    results: dict[int, list[int] | Exception] = {}

    def one(i: int) -> None:
        try:
            results[i] = call(i)
        except Exception as e:  # noqa: BLE001 - recorded and asserted below
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    seen: list[pb.LoadReport] = []
    with grpc.insecure_channel(victim.address) as ch:
        reports = pb_grpc.PrefillStub(ch).WatchLoad(pb.LoadRequest(interval_seconds=0.05), timeout=timeout)
        seen.append(next(reports))  # the stream is live
        for t in threads:
            t.start()
        try:
            for report in reports:
                seen.append(report)
                if report.running >= 1 and report.queued_prompt_tokens > 0:
                    victim.kill()
                    break
            else:
                raise AssertionError("the load stream ended")
        except (grpc.RpcError, AssertionError) as e:
            raise AssertionError(f"{victim.address}: never seen computing ({e}); "
                                 f"last reports {seen[-3:]}") from e
        reports.cancel()
    for t in threads:
        t.join(timeout=180)
    after = decode_counters(decode)
    rose = {k: after.get(k, 0) - before.get(k, 0)
            for k in ("kv_transfer_recomputes", "remote_prefills", "local_prefills")}
    print(f"victim killed with {report.running} running, {report.waiting} waiting, "
          f"{report.queued_prompt_tokens} prompt tokens to compute; decode counters rose {rose}")
    return [results[i] for i in range(len(prompts))], report, rose


def test_prefill_killed_with_requests_in_flight(cluster, offline) -> None:  # type: ignore[no-untyped-def]
    prompts = [offline.tokenizer.encode(f"Request {i}: {LONG}") for i in range(4)]
    refs = [o.outputs[0].token_ids for o in offline.generate(prompts, GREEDY)]
    d1, victim = cluster["d1"].address, cluster["victim"]

    results, _, rose = run_and_kill(victim, d1, prompts,
                                    lambda i: run(d1, victim.address, f"kill-{i}", prompts[i]))
    assert results == refs
    assert rose["kv_transfer_recomputes"] >= 1  # the kill cut prefills short; d1 computed them itself
    assert rose["kv_transfer_recomputes"] + rose["remote_prefills"] == len(prompts)
    assert wait_all_free(d1, pb_grpc.DecodeStub)


def live_victim(cluster) -> Proc:  # type: ignore[no-untyped-def]
    """The victim prefill worker, started again on its port if a test before killed it."""
    victim: Proc = cluster["victim"]
    if victim.popen.poll() is not None:
        port = int(victim.address.rsplit(":", 1)[1])
        decodes = peer_flag("prefill", [cluster["d0"].address, cluster["d1"].address])
        victim = cluster["victim"] = start_victim(victim.ready.parent, port, decodes)
        victim.wait_ready()
    return victim


def test_prefill_killed_under_requests_for_one_prompt(cluster, offline) -> None:  # type: ignore[no-untyped-def]
    """Three requests for one new prompt wait on the victim, none with a prefix
    hit on d1, and all lose their transfer.  d1 recomputes them; the first one
    planned caches the prompt's blocks, which the others must not take on top
    of the blocks they reserved (that once gave wrong tokens in the chaos test)."""
    victim = live_victim(cluster)
    prompt = offline.tokenizer.encode(f"One prompt for all: {LONG}")
    ref = offline.generate(prompt, GREEDY)[0].outputs[0].token_ids
    d1 = cluster["d1"].address
    results, _, rose = run_and_kill(victim, d1, [prompt] * 3,
                                    lambda i: run(d1, victim.address, f"same-{i}", prompt))
    assert results == [ref] * 3
    assert rose["kv_transfer_recomputes"] >= 2  # at least two of them recomputed together
    assert rose["kv_transfer_recomputes"] + rose["remote_prefills"] == 3
    assert wait_all_free(d1, pb_grpc.DecodeStub)


def test_prefill_killed_under_the_frontend(cluster, offline, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The same through the frontend's routing: prompts over its local-prefill
    threshold go to the (only) prefill worker, which dies computing them."""
    victim = live_victim(cluster)
    port, grpc_port = free_port(), free_port()
    log = tmp_path / "frontend.log"
    with open(log, "wb") as out:
        frontend = forkserver.popen(
            "services.frontend",
            ["--port", str(port), "--grpc-port", str(grpc_port),
             "--decode", cluster["d1"].address, "--prefill", victim.address,
             "--local-prefill-threshold", "64", "--log-level", "warning"],
            env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=out.fileno())
    try:
        deadline = time.monotonic() + 120
        while not _healthy(f"http://127.0.0.1:{port}/health"):
            assert frontend.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        prompts = [offline.tokenizer.encode(f"Frontend request {i}: {LONG}") for i in range(4)]
        assert min(len(p) for p in prompts) > 64
        refs = [o.outputs[0].token_ids for o in offline.generate(prompts, GREEDY)]

        def generate(i: int) -> list[int]:
            with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
                req = pb.GenerateRequest(model="SmolLM2-135M-Instruct", token_ids=pb.TokenIds(ids=prompts[i]),
                                         sampling=pb.SamplingParams(temperature=0, max_tokens=8,
                                                                    ignore_eos=True))
                return [t for r in pb_grpc.FrontendStub(ch).Generate(req, timeout=180) for t in r.token_ids]

        results, _, rose = run_and_kill(victim, cluster["d1"].address, prompts, generate)
        assert results == refs
        assert rose["kv_transfer_recomputes"] >= 1  # routed to the prefill worker, which died under them
        # Each prompt counted once on d1: remote, recomputed, or local
        # (one that reached the frontend after it saw the death).
        assert sum(rose.values()) == len(prompts)
        assert wait_all_free(cluster["d1"].address, pb_grpc.DecodeStub)
    finally:
        frontend.send_signal(signal.SIGTERM)
        frontend.wait(timeout=30)


def _healthy(url: str) -> bool:
    import httpx

    try:
        body = httpx.get(url, timeout=1).json()
    except (httpx.TransportError, ValueError):
        return False
    return bool(body.get("healthy_prefill_workers") == 1 and body.get("healthy_decode_workers") == 1)
