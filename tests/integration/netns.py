"""Hosts for multi-host tests: network namespaces joined by veth pairs on one
bridge, each with its own address on a private test subnet.

The bridge lives in the test's own namespace and carries the subnet's first
address, so the test (the client) reaches each host through it; the subnet's
route exists only while the bridge does, so nothing addressed to a host can
leave the machine.  Processes run inside a host with `ip netns exec`, bind
that host's address, and reach others only through their veths: a link cut
(`ip link set down`) or a rate limit (`tc ... tbf`) acts on everything the host
sends and receives.  Everything made here is removed on close, after a failure
too; a machine where namespaces cannot be made skips with the reason."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path


def _ip(*args: str, ns: str | None = None) -> None:
    argv = ["ip", *(("netns", "exec", ns, "ip") if ns else ()), *args]
    subprocess.run(argv, check=True, capture_output=True, timeout=10)


def unavailable() -> str | None:
    """Why hosts cannot be made here, or None."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"ssprobe{os.getpid() % 100000}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as e:
        return f"cannot make a network namespace: {getattr(e, 'stderr', b'') or e}"
    _ip("netns", "del", probe)
    return None


@dataclass
class Host:
    """One namespace: its name, address, and the veth ends (`inner` inside it,
    `outer` on the bridge)."""

    ns: str
    address: str
    inner: str
    outer: str

    def prefix(self) -> list[str]:
        """Put before an argv to run it on this host."""
        return ["ip", "netns", "exec", self.ns]

    def link(self, up: bool) -> None:
        """Cut or restore the host's only link (the bridge side, so the host sees carrier loss)."""
        _ip("link", "set", self.outer, "up" if up else "down")

    def limit_rate(self, mbit: int | None) -> None:
        """Limit what the host sends (None: no limit)."""
        if mbit is None:
            subprocess.run([*self.prefix(), "tc", "qdisc", "del", "dev", self.inner, "root"],
                           capture_output=True, timeout=10)
            return
        subprocess.run([*self.prefix(), "tc", "qdisc", "replace", "dev", self.inner, "root", "tbf",
                        "rate", f"{mbit}mbit", "burst", "64kb", "latency", "2s"],
                       check=True, capture_output=True, timeout=10)

    def bytes_received(self) -> int:
        """Bytes the bridge delivered to this host."""
        return int(Path(f"/sys/class/net/{self.outer}/statistics/tx_bytes").read_text())

    def bytes_sent(self) -> int:
        return int(Path(f"/sys/class/net/{self.outer}/statistics/rx_bytes").read_text())


@dataclass
class Network:
    """A bridge and the hosts on it.  Names carry the pid, so concurrent runs
    (and a previous run's leftovers) never collide."""

    tag: str = field(default_factory=lambda: f"ss{os.getpid() % 100000}")
    subnet: str = field(default_factory=lambda: f"10.199.{os.getpid() % 200 + 20}")
    hosts: dict[str, Host] = field(default_factory=dict)

    @property
    def bridge(self) -> str:
        return f"{self.tag}br"

    @property
    def gateway(self) -> str:
        """The test's own address on the bridge."""
        return f"{self.subnet}.1"

    def open(self) -> Network:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        return self

    def add(self, name: str) -> Host:
        """A new host on the bridge, with the next address."""
        n = len(self.hosts) + 2
        host = Host(ns=f"{self.tag}-{name}", address=f"{self.subnet}.{n}",
                    inner=f"{self.tag}{name}i", outer=f"{self.tag}{name}o")
        _ip("netns", "add", host.ns)
        self.hosts[name] = host  # removed on close from here on
        _ip("link", "add", host.outer, "type", "veth", "peer", "name", host.inner)
        _ip("link", "set", host.inner, "netns", host.ns)
        _ip("link", "set", host.outer, "master", self.bridge)
        _ip("link", "set", host.outer, "up")
        _ip("addr", "add", f"{host.address}/24", "dev", host.inner, ns=host.ns)
        _ip("link", "set", host.inner, "up", ns=host.ns)
        _ip("link", "set", "lo", "up", ns=host.ns)
        return host

    def close(self) -> None:
        """Remove every namespace (its veth goes with it) and the bridge."""
        for host in self.hosts.values():
            subprocess.run(["ip", "netns", "del", host.ns], capture_output=True, timeout=10)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=10)
        self.hosts.clear()
