"""The peers a worker may contact: those named in its own flags, plus (with
Redis) the verified registrations of its model and layout.  Never an address a
caller hands it (docs/ARCHITECTURE.md, trust model): a decode worker dials only known
prefill workers; a prefill worker pushes KV only to the UCX listener of a known
decode worker, learned from that worker's own Info over the cluster channel."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc

from protos import pb, pb_grpc
from services.cluster_auth import aio_channel

log = logging.getLogger("splitserve.peers")

_INFO_TIMEOUT_S = 2.0
_RERESOLVE_EVERY_S = 0.5  # a miss re-reads Redis / re-asks the known workers at most this often


class FreshRead:
    """Re-reads what a worker knows of its peers when a question misses: one
    read at a time, at most one begun per interval, and a question is answered
    only by a read begun after it was asked.  (A read already under way when a
    peer registered cannot know it: a request the frontend sent to that peer
    the moment it saw it waits for the next read instead of being refused.)
    Strangers asked about in a loop cost one read per interval, no more."""

    def __init__(self, read: Callable[[], Awaitable[None]], interval: float = _RERESOLVE_EVERY_S) -> None:
        self._read = read
        self._interval = interval
        self._lock = asyncio.Lock()
        self._begun = float("-inf")
        self.reads = 0

    async def after(self, asked: float) -> None:
        """Returns once a read begun at or after `asked` (time.monotonic()) has finished."""
        async with self._lock:  # waiting here: behind the read under way, and whatever it answers
            if self._begun >= asked:
                return
            await asyncio.sleep(max(0.0, self._begun + self._interval - time.monotonic()))
            self._begun = time.monotonic()
            self.reads += 1
            await self._read()


class KnownPeers:
    """gRPC addresses of one role's workers: static ones (flags) and discovered ones."""

    def __init__(self, role: str, static: Iterable[str] = ()) -> None:
        self.role = role
        self.static = frozenset(static)
        self.discovered: frozenset[str] = frozenset()
        self.discovery: Any = None  # services.discovery.Discovery, when there is Redis
        self.fresh = FreshRead(lambda: self.discovery.refresh())

    @property
    def all(self) -> frozenset[str]:
        return self.static | self.discovered

    def sync(self, role: str, addresses: set[str]) -> None:
        """Discovery's callback: the registrations of `role` that checked out."""
        if role == self.role:
            self.discovered = frozenset(addresses)

    @property
    def configured(self) -> bool:
        return bool(self.static) or self.discovery is not None

    async def knows(self, address: str) -> bool:
        """Known now, or after one fresh read of Redis (a worker that just registered)."""
        if address in self.all:
            return True
        if self.discovery is not None:
            await self.fresh.after(time.monotonic())
        return address in self.all


class KnownDecodeListeners:
    """Prefill side: which UCX addresses belong to known decode workers.  Each
    known decode worker is asked for its Info (cluster token attached); the
    answer is kept until a miss makes it ask again (a restarted worker listens
    on a new UCX port)."""

    def __init__(self, decodes: KnownPeers, token: str | None, model_id: str) -> None:
        self.decodes = decodes
        self.token = token
        self.model_id = model_id
        self._ucx: dict[str, str] = {}  # decode gRPC address -> its UCX address
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.fresh = FreshRead(self._resolve)

    async def knows(self, kv_address: str) -> bool:
        if kv_address in self._ucx.values():
            return True
        await self.fresh.after(time.monotonic())
        return kv_address in self._ucx.values()

    async def _resolve(self) -> None:
        if self.decodes.discovery is not None:
            await self.decodes.discovery.refresh()
        addresses = sorted(self.decodes.all)
        answers = await asyncio.gather(*(self._info(a) for a in addresses))
        self._ucx = {a: ucx for a, ucx in zip(addresses, answers, strict=True) if ucx}

    async def _info(self, address: str) -> str:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = aio_channel(address, self.token)
        try:
            info: pb.WorkerInfo = await pb_grpc.DecodeStub(ch).Info(pb.InfoRequest(), timeout=_INFO_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            log.warning("known decode worker %s did not answer Info: %s", address, e.code().name)
            return ""
        if info.role != "decode" or info.model_id != self.model_id:
            log.warning("known decode worker %s says it is a %s of %s; not pushing KV there",
                        address, info.role or "?", info.model_id or "?")
            return ""
        return info.ucx_address

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
