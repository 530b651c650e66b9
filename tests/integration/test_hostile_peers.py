"""A hostile peer against real workers (issue 14, acceptance 2 and 3): calls
without the cluster secret, a rogue prefill address in Generate, a rogue KV
address in Prefill, a UCX write without the transfer's token, and an Abort or
a failed step while a real UCX transfer is pending.  Every attack leaves the
blocks clean: greedy output equals the offline engine's.

Workers: d0 (decode, 40 blocks), p0 (prefill) and slow (prefill that waits 3 s
before sending, so that a transfer is pending for as long as a test needs),
all with one cluster token, each knowing the other role's workers."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine import LLM, SamplingParams
from protos import pb, pb_grpc
from services.cluster_auth import ENV, METADATA_KEY, sync_channel
from services.convert import sampling_to_proto
from tests.kv_peers import CacheSpec, PeerError, PeerProcess

from ..faults import fault_env
from .procs import Listener, Proc, address, free_port, peer_flag, start_worker, stop_all, wait_until

pytestmark = pytest.mark.timeout(300)

TOKEN = "test-cluster-token-0123456789"
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
NUM_BLOCKS = 40
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


def victim(tag: str) -> str:
    """~160 tokens, 11 blocks with its output; the tag keeps it out of the prefix cache."""
    return f"[{tag}] " + "A lighthouse keeper's log: the wind, the tides, the ships that passed. " * 9


def big(tag: str) -> str:
    """~515 tokens, 33 of the 40 blocks with its output: it must take some a victim held."""
    line = "Day after day the keeper wrote the weather, the lamps and the passing ships down. "
    return f"[{tag}] " + line * 30


class Cluster:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.step_fail_file = tmp / "fail-next-step"
        ports = {"d0": free_port(), "p0": free_port(), "slow": free_port()}
        env = {ENV: TOKEN}
        d0_peer = peer_flag("prefill", [address(ports["d0"])])
        self.procs: dict[str, Proc] = {
            "d0": start_worker("decode", "d0", tmp, "--num-blocks", str(NUM_BLOCKS), "--grpc-port",
                               str(ports["d0"]), "--local-prefill-threshold", "8", "--kv-transfer-timeout",
                               "20", *peer_flag("decode", [address(ports["p0"]), address(ports["slow"])]),
                               env={**env, **fault_env(step_fail_file=self.step_fail_file)}),
            "p0": start_worker("prefill", "p0", tmp, "--num-blocks", "128", "--grpc-port", str(ports["p0"]),
                               *d0_peer, env=env),
            "slow": start_worker("prefill", "slow", tmp, "--num-blocks", "128", "--grpc-port",
                                 str(ports["slow"]), *d0_peer, env={**env, **fault_env(send_delay=3)}),
        }

    def __getitem__(self, name: str) -> Proc:
        return self.procs[name]

    def stop(self) -> None:
        stop_all(self.procs.values())


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("hostile"))
    try:
        for p in c.procs.values():
            p.wait_ready()
        yield c
    finally:
        c.stop()
    # Every refused or failed request closed its stream: d0's SIGTERM drain found
    # none in flight (a leaked one held its exit for the whole drain timeout).
    assert "d0 draining: 0 requests in flight" in c["d0"].tail(), c["d0"].tail()


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(dtype="float32", num_blocks=128, num_threads=1, max_model_len=1024)


def decode_stub(address: str, token: str | None = TOKEN) -> pb_grpc.DecodeStub:
    return pb_grpc.DecodeStub(sync_channel(address, token))


def load(address: str, stub_cls: Any = pb_grpc.DecodeStub) -> pb.LoadReport:
    return next(iter(stub_cls(sync_channel(address, TOKEN)).WatchLoad(pb.LoadRequest(interval_seconds=0.1),
                                                                         timeout=10)))

def wait_pending(d0: str) -> None:
    wait_until(lambda: load(d0).kv_transfers_pending == 1, 30, "the victim's transfer never became pending")


def generate(rid: str, ids: list[int], prefill: str = "", *, address: str,
             params: SamplingParams = GREEDY) -> list[pb.WorkerGenerateResponse]:
    req = pb.WorkerGenerateRequest(request_id=rid, prompt_token_ids=ids, sampling=sampling_to_proto(params),
                                   prefill_address=prefill)
    return list(decode_stub(address).Generate(req, timeout=120))


def tokens(chunks: list[pb.WorkerGenerateResponse]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


class Background(threading.Thread):
    """One Generate call in a thread: its chunks, or the RpcError it ended with."""

    def __init__(self, fn: Callable[[], list[pb.WorkerGenerateResponse]]) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.chunks: list[pb.WorkerGenerateResponse] | None = None
        self.error: grpc.RpcError | None = None
        self.start()

    def run(self) -> None:
        try:
            self.chunks = self.fn()
        except grpc.RpcError as e:
            self.error = e

    def result(self, timeout: float = 120) -> Background:
        self.join(timeout)
        assert not self.is_alive(), "the request hangs"
        return self


def all_free(cluster: Cluster) -> None:
    def free(name: str, stub: Any) -> bool:
        r = load(cluster[name].address, stub)
        return r.free_blocks == r.total_blocks

    for name in ("d0", "p0", "slow"):
        stub = pb_grpc.DecodeStub if name == "d0" else pb_grpc.PrefillStub
        wait_until(lambda: free(name, stub), 30, f"{name} did not free every block")  # noqa: B023


# -- the cluster secret -------------------------------------------------------


@pytest.mark.parametrize("token", [None, "wrong-token", TOKEN[:-1]], ids=["none", "wrong", "prefix"])
def test_rpcs_without_the_cluster_secret_are_refused(cluster: Cluster, token: str | None) -> None:
    d0, p0 = cluster["d0"].address, cluster["p0"].address
    calls: list[tuple[str, Callable[[], Any]]] = [
        ("Decode.Info", lambda: decode_stub(d0, token).Info(pb.InfoRequest(), timeout=10)),
        ("Decode.WatchLoad",
         lambda: next(iter(decode_stub(d0, token).WatchLoad(pb.LoadRequest(), timeout=10)))),
        ("Decode.Abort", lambda: decode_stub(d0, token).Abort(pb.AbortRequest(request_id="x"), timeout=10)),
        ("Decode.Generate", lambda: list(decode_stub(d0, token).Generate(
            pb.WorkerGenerateRequest(request_id="x", prompt_token_ids=[1, 2, 3],
                                     sampling=sampling_to_proto(GREEDY)), timeout=10))),
        ("Prefill.Info",
         lambda: pb_grpc.PrefillStub(sync_channel(p0, token)).Info(pb.InfoRequest(), timeout=10)),
        ("Prefill.Prefill", lambda: pb_grpc.PrefillStub(sync_channel(p0, token)).Prefill(
            pb.PrefillRequest(request_id="x", prompt_token_ids=[1, 2, 3]), timeout=10)),
    ]
    for name, call in calls:
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
        assert METADATA_KEY in (err.value.details() or ""), name
    # Health stays open to probes; the right token works.
    with grpc.insecure_channel(d0) as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert decode_stub(d0).Info(pb.InfoRequest(), timeout=10).role == "decode"


# -- addresses a caller names ---------------------------------------------------


def test_rogue_prefill_address_in_generate_is_never_dialled(cluster: Cluster, offline: LLM) -> None:
    rogue = Listener()
    try:
        ids = offline.tokenizer.encode(victim("rogue-prefill"))
        before = load(cluster["d0"].address).counters["unknown_prefill_refusals"]
        with pytest.raises(grpc.RpcError) as err:
            generate("rogue-prefill", ids, rogue.address, address=cluster["d0"].address)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "prefill_address" in (err.value.details() or "")
        assert load(cluster["d0"].address).counters["unknown_prefill_refusals"] == before + 1
        assert not rogue.connected(within=1.0), "the decode worker connected to the rogue address"
        # a known prefill worker still serves, and nothing leaked
        ref = offline.generate(ids, GREEDY)[0].outputs[0].token_ids
        chunks = generate("known-prefill", ids, cluster["p0"].address, address=cluster["d0"].address)
        assert tokens(chunks) == ref
        all_free(cluster)
    finally:
        rogue.close()


def test_rogue_kv_address_in_prefill_is_never_pushed_to(cluster: Cluster, offline: LLM) -> None:
    rogue = Listener()
    try:
        stub = pb_grpc.PrefillStub(sync_channel(cluster["p0"].address, TOKEN))
        info = stub.Info(pb.InfoRequest(), timeout=10)
        ids = offline.tokenizer.encode(victim("rogue-kv"))
        req = pb.PrefillRequest(request_id="exfiltrate", prompt_token_ids=ids,
                                sampling=sampling_to_proto(GREEDY),
                                kv_address=rogue.address, dst_block_ids=list(range(-(-len(ids) // 16))),
                                layout=info.layout, kv_token=b"t" * 16)
        with pytest.raises(grpc.RpcError) as err:
            stub.Prefill(req, timeout=30)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "kv_address" in (err.value.details() or "")
        assert not rogue.connected(within=1.0), "the prefill worker connected to the rogue address"
        all_free(cluster)
    finally:
        rogue.close()


# -- KV writes are invited --------------------------------------------------------


def test_ucx_write_without_the_transfers_token_is_dropped(cluster: Cluster, offline: LLM) -> None:
    """A rogue sender with the decode worker's layout knows the request id of a
    pending transfer (and tries every block) but not its token: refused before a
    receive is posted; the request's output equals an undisturbed run."""
    d0 = cluster["d0"].address
    info = decode_stub(d0).Info(pb.InfoRequest(), timeout=10)
    lay = info.layout
    spec = CacheSpec(dtype=lay.dtype, num_blocks=NUM_BLOCKS, num_layers=lay.num_layers,
                     block_size=lay.block_size, num_kv_heads=lay.num_kv_heads, head_dim=lay.head_dim,
                     model_id=lay.model_id, seed=99)
    rogue = PeerProcess({"kv": spec}, timeout_s=10.0)
    try:
        rogue.wait_ready(timeout=90)
        ids = offline.tokenizer.encode(victim("token"))
        ref = offline.generate(ids, GREEDY)[0].outputs[0].token_ids
        call = Background(lambda: generate("invited", ids, cluster["slow"].address, address=d0))
        wait_pending(d0)
        n = -(-len(ids) // 16)
        for token in (b"", b"\0" * 16, b"guess-guess-guess"):
            with pytest.raises(PeerError) as err:
                rogue.call("send", "kv", info.ucx_address, "invited", list(range(n)), list(range(n)), token,
                           timeout=30)
            assert err.value.type_name == "TransferRejected", err.value
            assert "token is missing or wrong" in err.value.message, err.value  # the transfer was pending
        result = call.result()
        assert result.error is None, result.error
        assert result.chunks is not None and result.chunks[0].remote_prefill
        assert tokens(result.chunks) == ref
        all_free(cluster)
    finally:
        rogue.stop()


# -- no reuse in flight -------------------------------------------------------------


def _late_write_cannot_corrupt(cluster: Cluster, offline: LLM, tag: str, failures_before: float) -> None:
    """A big prompt takes blocks the victim held; the slow sender's late write comes
    after it; a rerun hits the blocks the first run left cached: corrupted KV would show."""
    d0 = cluster["d0"].address
    ids = offline.tokenizer.encode(big(tag))
    ref = offline.generate(ids, GREEDY)[0].outputs[0].token_ids
    assert tokens(generate(f"{tag}-big-1", ids, address=d0)) == ref
    wait_until(lambda: slow_failures(cluster) > failures_before, 30,
               "the slow sender never tried its late write")
    again = generate(f"{tag}-big-2", ids, address=d0)
    assert again[0].cached_tokens >= 16 * 30, "the rerun did not reuse the first run's blocks"
    assert tokens(again) == ref
    all_free(cluster)


def slow_failures(cluster: Cluster) -> float:
    return load(cluster["slow"].address, pb_grpc.PrefillStub).counters["transfer_failures"]


def pending_victim(cluster: Cluster, offline: LLM, rid: str) -> Background:
    """A remote-prefilled request whose KV transfer (from the slow sender) is pending."""
    ids = offline.tokenizer.encode(victim(rid))
    call = Background(lambda: generate(rid, ids, cluster["slow"].address, address=cluster["d0"].address))
    wait_pending(cluster["d0"].address)
    wait_until(lambda: f"fault: KV send of {rid} waits" in cluster["slow"].tail(1 << 20), 30,
               "the slow sender's fault hook never held the send back")
    return call


def test_abort_during_a_transfer_stops_it_before_freeing(cluster: Cluster, offline: LLM) -> None:
    d0 = cluster["d0"].address
    failures = slow_failures(cluster)
    call = pending_victim(cluster, offline, "abort-me")
    assert decode_stub(d0).Abort(pb.AbortRequest(request_id="abort-me"), timeout=10).found
    assert load(d0).kv_transfers_pending == 0  # cancelled before Abort answered
    _late_write_cannot_corrupt(cluster, offline, "abort", failures)
    result = call.result()
    assert result.error is not None and result.error.code() == grpc.StatusCode.CANCELLED, result.error


def test_a_failed_step_keeps_the_blocks_of_a_pending_transfer(cluster: Cluster, offline: LLM) -> None:
    d0 = cluster["d0"].address
    failures = slow_failures(cluster)
    call = pending_victim(cluster, offline, "in-flight")
    running = Background(lambda: generate("runs-the-failing-step", offline.tokenizer.encode("Hello there!"),
                                          address=d0, params=LONG))
    wait_until(lambda: load(d0).running == 1, 30, "the local request never ran")
    cluster.step_fail_file.touch()
    err = running.result().error  # the step it runs in fails
    assert err is not None and err.code() == grpc.StatusCode.INTERNAL, err
    assert "injected step failure" in (err.details() or "")
    assert not cluster.step_fail_file.exists()
    # The victim's blocks stay its own while its transfer may still write them: the big
    # prompt, which needs some of them, waits for them; the transfer lands where it should.
    ids_big = offline.tokenizer.encode(big("step"))
    ref = offline.generate(ids_big, GREEDY)[0].outputs[0].token_ids
    assert tokens(generate("step-big-1", ids_big, address=d0)) == ref
    result = call.result()  # the transfer landed in blocks it still held; then it got the error
    assert result.error is not None and result.error.code() == grpc.StatusCode.INTERNAL, result.error
    again = generate("step-big-2", ids_big, address=d0)
    assert again[0].cached_tokens >= 16 * 30 and tokens(again) == ref
    all_free(cluster)
    assert slow_failures(cluster) == failures
