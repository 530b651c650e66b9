"""What a worker knows of its peers, re-read on a miss (services/peers.py).
The race behind a flake of test_multihost: a request names a prefill worker the
frontend has just seen registered while the decode worker's read of Redis,
begun before that registration, is still under way.  Redis cannot be made to
answer at a chosen instant, so a stand-in discovery here holds its read open."""

from __future__ import annotations

import asyncio
import time

from services.peers import KnownPeers


class HeldDiscovery:
    """Reads the registrations as they are when a read begins, then waits for `release`."""

    def __init__(self, peers: KnownPeers) -> None:
        self.peers = peers
        self.registered: set[str] = set()
        self.release = asyncio.Event()
        self.began = asyncio.Event()

    async def refresh(self) -> None:
        seen = set(self.registered)
        self.began.set()
        await self.release.wait()
        self.peers.sync("prefill", seen)


def test_a_read_begun_before_a_registration_does_not_answer_for_it() -> None:
    async def main() -> tuple[bool, bool, int]:
        peers = KnownPeers("prefill")
        peers.discovery = discovery = HeldDiscovery(peers)
        early = asyncio.create_task(peers.knows("10.0.0.2:50061"))  # a read begins; nobody registered yet
        await discovery.began.wait()
        discovery.registered.add("10.0.0.2:50061")  # registers now, while that read is under way
        late = asyncio.create_task(peers.knows("10.0.0.2:50061"))  # asked after the registration
        await asyncio.sleep(0)
        discovery.release.set()
        return await early, await late, peers.fresh.reads

    early, late, reads = asyncio.run(main())
    assert (early, late) == (False, True)  # the early question missed it; the late one waited for a new read
    assert reads == 2


def test_strangers_asked_about_in_a_loop_cost_one_read_per_interval() -> None:
    async def main() -> tuple[list[bool], int, float]:
        peers = KnownPeers("prefill", static=["10.0.0.9:50061"])
        peers.discovery = discovery = HeldDiscovery(peers)
        discovery.release.set()
        t = time.monotonic()
        answers = await asyncio.gather(*(peers.knows(f"192.0.2.{i}:1") for i in range(50)))
        known = await peers.knows("10.0.0.9:50061")  # the flag's peers need no read
        return [*answers, known], peers.fresh.reads, time.monotonic() - t

    answers, reads, took = asyncio.run(main())
    assert answers == [False] * 50 + [True]
    assert reads <= 1 + took / 0.5 + 1, (reads, took)  # the first at once, then at most one per 0.5 s
    assert reads <= 3
