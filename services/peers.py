"""The peers a worker may contact: those named in its own flags, plus (with
Redis) the verified registrations of its model and layout.  Never an address a
caller hands it (docs/ARCHITECTURE.md, trust model): a decode worker dials only known
prefill workers; a prefill worker pushes KV only to the UCX listener of a known
decode worker, learned from that worker's own Info over the cluster channel."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

import grpc

from protos import pb, pb_grpc
from services.cluster_auth import aio_channel

log = logging.getLogger("splitserve.peers")

_INFO_TIMEOUT_S = 2.0
_RERESOLVE_EVERY_S = 0.5  # a miss re-reads Redis / re-asks the known workers at most this often


class KnownPeers:
    """gRPC addresses of one role's workers: static ones (flags) and discovered ones."""

    def __init__(self, role: str, static: Iterable[str] = ()) -> None:
        self.role = role
        self.static = frozenset(static)
        self.discovered: frozenset[str] = frozenset()
        self.discovery: Any = None  # services.discovery.Discovery, when there is Redis
        self._last_refresh = 0.0

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
        # A caller naming strangers in a loop costs one Redis read per interval, no more.
        if self.discovery is not None and time.monotonic() - self._last_refresh >= _RERESOLVE_EVERY_S:
            self._last_refresh = time.monotonic()
            await self.discovery.refresh()
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
        self._last_resolve = 0.0
        self._lock = asyncio.Lock()

    async def knows(self, kv_address: str) -> bool:
        if kv_address in self._ucx.values():
            return True
        async with self._lock:
            if time.monotonic() - self._last_resolve >= _RERESOLVE_EVERY_S:
                await self._resolve()
        return kv_address in self._ucx.values()

    async def _resolve(self) -> None:
        if self.decodes.discovery is not None:
            await self.decodes.discovery.refresh()
        addresses = sorted(self.decodes.all)
        answers = await asyncio.gather(*(self._info(a) for a in addresses))
        self._ucx = {a: ucx for a, ucx in zip(addresses, answers, strict=True) if ucx}
        self._last_resolve = time.monotonic()

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
