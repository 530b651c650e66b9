"""The cluster across hosts (issue 18): Redis and the frontend on one host, a
prefill worker on a second, decode workers on a third and fourth, each host a
network namespace with its own address (tests/integration/netns.py).  Workers
bind and advertise their host's address and are found through Redis; UCX is
held to TCP on the host's veth, so KV crosses the "network" (shared memory
would otherwise short-cut it on one machine).  Nothing uses 127.0.0.1
across hosts.

What must hold: greedy output equals the single-host engine's; KV bytes are
counted on both sides and on the veths; a prefill host whose link is cut in
the middle of a transfer has its prompt recomputed on the decode worker; a
decode host cut mid-stream has its streams migrated; a restarted host rejoins
through discovery; a worker whose KV layout differs never lands a block."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from .netns import Host, Network, unavailable
from .procs import ROOT, Proc, Stream, start_worker, wait_until

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

MODEL = "SmolLM2-135M-Instruct"
THRESHOLD = 32  # prompts this long and longer are prefilled on the prefill host
MAX_TOKENS = 24
GRPC_PORT, UCX_PORT, METRICS_PORT = 50061, 50071, 9100
REDIS_PASSWORD = "multihost-test"  # Redis refuses other hosts without one (protected mode)
CLUSTER_TOKEN = "multihost-cluster-token"  # every worker RPC and registration carries it
# Token ids, so the test's reference and the cluster see the same prompt.
SHORT = [[1, 504, 3458, 282, 4649, 314] + [i] for i in range(3)]
LONG = [[1] + [(997 * i + 31 * j) % 40000 + 100 for j in range(300)] for i in range(3)]


@dataclass
class Cluster:
    net: Network
    tmp: Path
    redis: subprocess.Popen[bytes] | None = None
    frontend: subprocess.Popen[bytes] | None = None
    workers: dict[str, Proc] = field(default_factory=dict)
    homes: dict[str, Host] = field(default_factory=dict)  # worker name -> its host

    @property
    def fe(self) -> Host:
        return self.net.hosts["fe"]

    @property
    def url(self) -> str:
        return f"http://{self.fe.address}:8000"

    @property
    def redis_url(self) -> str:
        return f"redis://:{REDIS_PASSWORD}@{self.fe.address}:6379/0"

    def start_worker(self, name: str, host: Host, *extra: str) -> Proc:
        role = "prefill" if name.startswith("p") else "decode"
        if role == "decode":
            extra = ("--local-prefill-threshold", str(THRESHOLD), "--kv-failure-policy", "recompute", *extra)
        proc = start_worker(role, name, self.tmp, "--host", host.address, "--grpc-port", str(GRPC_PORT),
                            "--ucx-port", str(UCX_PORT), "--metrics-port", str(METRICS_PORT),
                            "--redis-url", self.redis_url, "--num-blocks", "256",
                            "--kv-transfer-timeout", "10", "--drain-timeout", "5", *extra,
                            prefix=host.prefix(), env={"UCX_TLS": "tcp", "UCX_NET_DEVICES": host.inner,
                                                       "SPLITSERVE_CLUSTER_TOKEN": CLUSTER_TOKEN})
        self.workers[name], self.homes[name] = proc, host
        return proc

    def cluster(self) -> dict[str, dict[str, Any]]:
        workers = httpx.get(f"{self.url}/cluster", timeout=5).json()["workers"]
        return {w["id"]: w for w in workers}

    def healthy(self, *names: str) -> bool:
        try:
            view = self.cluster()
        except (httpx.TransportError, ValueError):
            return False
        return all(view.get(n, {}).get("health") == "healthy" for n in names)

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))

    def close(self) -> None:
        procs = [w.popen for w in self.workers.values()] + [p for p in (self.frontend, self.redis) if p]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
        for p in procs:
            p.wait(timeout=30)
        self.net.close()

@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(Network().open(), tmp_path_factory.mktemp("multihost"))
    try:
        for name in ("fe", "pf", "dc0", "dc1"):
            c.net.add(name)
        fe = c.fe
        c.redis = subprocess.Popen([*fe.prefix(), "redis-server", "--bind", fe.address, "--port", "6379",
                                    "--save", "", "--appendonly", "no", "--requirepass", REDIS_PASSWORD],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for name, host in (("p0", "pf"), ("d0", "dc0"), ("d1", "dc1")):
            c.start_worker(name, c.net.hosts[host])
        with open(c.tmp / "frontend.log", "wb") as log:
            c.frontend = subprocess.Popen(
                [*fe.prefix(), sys.executable, "-m", "services.frontend", "--host", fe.address,
                 "--port", "8000", "--grpc-port", "50051", "--redis-url", c.redis_url,
                 "--discovery-interval", "0.5", "--local-prefill-threshold", str(THRESHOLD),
                 "--log-level", "warning"],
                cwd=ROOT, env={**os.environ, "SPLITSERVE_CLUSTER_TOKEN": CLUSTER_TOKEN}, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)
        for w in c.workers.values():
            w.wait_ready()
        wait_until(lambda: c.healthy("p0", "d0", "d1"), 120, "the frontend never discovered every worker")
        yield c
    finally:
        c.close()


class Reference:
    """The single-host offline engine's greedy tokens, computed on first use."""

    def __init__(self) -> None:
        from engine import LLM

        self.llm = LLM(dtype="float32", num_blocks=128, num_threads=1, max_model_len=1024)
        self.done: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def tokens(self, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
        from engine import SamplingParams

        key = (tuple(prompt), max_tokens)
        if key not in self.done:
            [out] = self.llm.generate([prompt],
                                      SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
            self.done[key] = out.outputs[0].token_ids
        return self.done[key]


@pytest.fixture(scope="module")
def reference() -> Reference:
    return Reference()


def stream(cluster: Cluster, prompt: list[int], max_tokens: int = MAX_TOKENS) -> Stream:
    """One greedy stream through the frontend's gRPC API."""
    return Stream(f"{cluster.fe.address}:50051", prompt, max_tokens)


def run_all(cluster: Cluster, prompts: list[list[int]]) -> list[Stream]:
    streams = [stream(cluster, p) for p in prompts]
    for s in streams:
        s.start()
    for s in streams:
        s.join(240)
    return streams


def assert_exact(streams: list[Stream], reference: Reference) -> None:
    for s in streams:
        assert s.error is None, s.error
        assert s.tokens == reference.tokens(s.prompt, s.max_tokens), f"prompt of {len(s.prompt)} tokens"


def counters(cluster: Cluster) -> dict[str, dict[str, float]]:
    return {name: w["counters"] for name, w in cluster.cluster().items()}


def test_workers_advertise_their_hosts_and_greedy_matches_one_host(cluster: Cluster,
                                                                   reference: Reference) -> None:
    view = cluster.cluster()
    for name, proc in cluster.workers.items():
        host = cluster.homes[name].address
        assert view[name]["grpc_address"] == f"{host}:{GRPC_PORT}"
        assert view[name]["ucx_address"].startswith(f"{host}:")
        assert "127.0.0.1" not in str(view[name])
        assert proc.popen.poll() is None
    before = counters(cluster)
    assert_exact(run_all(cluster, SHORT + LONG), reference)
    # The long ones went remote (counted in p0's next load report, after the requests end).
    prefills = before["p0"].get("prefills", 0)
    wait_until(lambda: counters(cluster)["p0"].get("prefills", 0) - prefills >= len(LONG), 10,
               lambda: f"p0 counted {counters(cluster)['p0']}, {before['p0']} before")


def test_kv_crosses_the_veths_and_is_counted_on_both_sides(cluster: Cluster, reference: Reference) -> None:
    before, pf_out = counters(cluster), cluster.homes["p0"].bytes_sent()
    dc_in = {d: cluster.homes[d].bytes_received() for d in ("d0", "d1")}
    streams = run_all(cluster, [[2, *p[1:]] for p in LONG])  # not cached anywhere yet
    assert_exact(streams, reference)
    after = counters(cluster)
    sent = after["p0"]["bytes_sent"] - before["p0"].get("bytes_sent", 0)
    received = sum(after[d]["kv_bytes_received"] - before[d].get("kv_bytes_received", 0)
                   for d in ("d0", "d1"))
    assert sent > 0 and received == sent
    # The bytes really went over the prefill host's link and into the decode hosts'.
    assert cluster.homes["p0"].bytes_sent() - pf_out >= sent
    assert sum(cluster.homes[d].bytes_received() - dc_in[d] for d in ("d0", "d1")) >= sent


def test_prefill_link_cut_mid_transfer_is_recomputed(cluster: Cluster, reference: Reference) -> None:
    pf = cluster.homes["p0"]
    before = counters(cluster)
    recomputes_before = sum(before[d].get("kv_transfer_recomputes", 0) for d in ("d0", "d1"))
    # A 300-token prompt's KV (14 MB in float32) now takes about 3 s, well
    # inside --kv-transfer-timeout (10 s) if nothing cuts it.
    pf.limit_rate(40)
    try:
        prompt = [3, *LONG[0][1:]]
        out = pf.bytes_sent()
        s = stream(cluster, prompt)
        s.start()
        # Mid-transfer: a decode worker waits on KV and bytes are flowing out of the prefill host.
        wait_until(lambda: any(w["kv_transfers_pending"] for n, w in cluster.cluster().items()
                               if n.startswith("d")), 60, "no transfer started")
        wait_until(lambda: pf.bytes_sent() - out > 1 << 20, 60, "no KV bytes left the prefill host")
        pf.link(up=False)
        s.join(120)
    finally:
        pf.link(up=True)
        pf.limit_rate(None)
    assert_exact([s], reference)
    after = counters(cluster)
    assert sum(after[d].get("kv_transfer_recomputes", 0) for d in ("d0", "d1")) > recomputes_before
    wait_until(lambda: cluster.healthy("p0", "d0", "d1"), 60, "the prefill host never came back")


def test_decode_host_cut_mid_stream_is_migrated(cluster: Cluster, reference: Reference) -> None:
    migrated = cluster.metric("splitserve_requests_migrated_total")
    streams = [stream(cluster, p, max_tokens=160) for p in SHORT * 2]
    for s in streams:
        s.start()

    def streaming_on_d0() -> int:
        return all(s.tokens for s in streams) and cluster.cluster()["d0"]["inflight"]

    on_victim = wait_until(streaming_on_d0, 60, "no stream was running on d0")
    victim = cluster.homes["d0"]
    victim.link(up=False)
    try:
        for s in streams:
            s.join(180)
    finally:
        victim.link(up=True)
    assert_exact(streams, reference)
    assert cluster.metric("splitserve_requests_migrated_total") - migrated >= 1
    assert on_victim >= 1
    wait_until(lambda: cluster.healthy("d0", "d1"), 60, "the decode host never came back")


def test_restarted_host_rejoins_through_discovery(cluster: Cluster, reference: Reference) -> None:
    old_pid = cluster.cluster()["p0"]["pid"]
    cluster.workers["p0"].kill(signal.SIGKILL)
    wait_until(lambda: cluster.cluster().get("p0", {}).get("health") != "healthy", 30,
               "the frontend still routes to a dead prefill worker")
    assert_exact(run_all(cluster, LONG[:1]), reference)  # recomputed or prefilled on decode meanwhile
    cluster.start_worker("p0", cluster.homes["p0"]).wait_ready()
    wait_until(lambda: cluster.healthy("p0") and cluster.cluster()["p0"]["pid"] != old_pid, 60,
               "the restarted prefill worker never rejoined")
    prefills = cluster.cluster()["p0"]["counters"].get("prefills", 0)
    assert_exact(run_all(cluster, [[4, *LONG[1][1:]]]), reference)
    wait_until(lambda: cluster.cluster()["p0"]["counters"]["prefills"] > prefills, 10,
               "the restarted prefill worker's report never counted the prefill")


def test_a_worker_with_another_kv_layout_never_lands_a_block(cluster: Cluster, reference: Reference) -> None:
    """A prefill host whose KV blocks are twice as long registers like any other;
    the frontend and the decode workers refuse its registration
    (docs/ARCHITECTURE.md, invariant 7), so with the good prefill host frozen, long prompts are
    prefilled on the decode hosts and still come out exact."""
    odd = cluster.start_worker("p1", cluster.net.add("pf1"), "--block-size", "32")
    p0 = cluster.workers["p0"].popen
    odd.wait_ready()
    refusals = [cluster.tmp / "frontend.log", cluster.workers["d0"].log, cluster.workers["d1"].log]

    def refused_everywhere() -> bool:
        return all(re.search(r"refused the registration at .*:p1'.*layout", f.read_text()) for f in refusals)

    wait_until(refused_everywhere, 30, "the odd worker's registration was not refused")
    p0.send_signal(signal.SIGSTOP)  # the odd worker is now the only other prefill host
    try:
        wait_until(lambda: cluster.cluster()["p0"]["health"] != "healthy", 30, "frozen p0 looked healthy")
        before = counters(cluster)
        streams = run_all(cluster, [[5 + i, *p[1:]] for i, p in enumerate(LONG)])
        assert_exact(streams, reference)
        after = counters(cluster)
        assert "p1" not in after  # never in the pool, never routed to
        assert sum(after[d]["kv_bytes_received"] - before[d].get("kv_bytes_received", 0)
                   for d in ("d0", "d1")) == 0
    finally:
        p0.send_signal(signal.SIGCONT)
        odd.stop()
    wait_until(lambda: cluster.healthy("p0"), 30, "p0 never came back")
