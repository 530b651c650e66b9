"""The workers this frontend routes to: one gRPC channel each, Info, and a
WatchLoad stream that keeps their load current and says whether they are up."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, Literal

import grpc

from engine.vocab.cache_events import CacheEvent
from engine.vocab.hashing import cache_model_key
from protos import pb, pb_grpc
from services.aio_tasks import cancel_and_wait
from services.cluster_auth import aio_channel
from services.frontend.router import WorkerLoad
from services.frontend.worker_session import DecodeStreams
from services.index.base import IndexUnavailable, PrefixIndex
from services.index.embedded import EmbeddedPrefixIndex

Role = Literal["decode", "prefill"]
log = logging.getLogger("splitserve.frontend.workers")

# Reconnect backoff capped at 250 ms (gRPC's default grows to 120 s), so that a
# worker starting or restarting is seen within a quarter second of listening.
_CHANNEL_OPTIONS = [("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
                    ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", 250),
                    ("grpc.max_receive_message_length", 64 << 20),
                    ("grpc.max_send_message_length", 64 << 20)]
_INFO_TIMEOUT_S = 2.0
_RETIRE_WAIT_S = 60.0  # a removed worker's channel stays open this long for requests still on it
_MAX_BACKOFF_S = 2.0


class Worker:
    """One worker: its channel, what it said about itself, its last load report."""

    def __init__(self, address: str, role: Role, interval: float, model_id: str | None = None,
                 index: PrefixIndex | None = None, cluster_token: str | None = None) -> None:
        self.address = address
        self.index = index  # fed with this worker's prefix-cache events
        self.cached: set[bytes] = set()  # this worker's cached blocks, to resync an index that missed events
        self._index_synced = True
        self.role = role
        self.interval = interval
        self.model_id = model_id  # what this frontend tokenizes for
        self.channel = aio_channel(address, cluster_token, options=_CHANNEL_OPTIONS)
        self.stub: Any = (pb_grpc.DecodeStub(self.channel) if role == "decode"
                          else pb_grpc.PrefillStub(self.channel))
        self.streams = DecodeStreams(self.stub)  # a decode worker's requests, on one Session call
        self.info: pb.WorkerInfo | None = None
        self.load: pb.LoadReport | None = None
        self.last_report = 0.0
        self.stream_up = False
        self.inflight = 0  # requests this frontend sent and has not seen finish
        self.inflight_prompt_tokens = 0  # prefill: prompt tokens sent whose first token hasn't come back
        self.routed = 0  # requests this frontend routed here
        self.info_ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def worker_id(self) -> str:
        return self.info.worker_id if self.info and self.info.worker_id else self.address

    @property
    def alive(self) -> bool:
        """Its load stream is up and current (a live stream gone quiet for many
        intervals means a hung worker)."""
        fresh = time.monotonic() - self.last_report < max(2.0, 10 * self.interval)
        return self.stream_up and self.info is not None and fresh

    @property
    def healthy(self) -> bool:
        """Alive and taking new requests (not draining)."""
        return self.alive and not (self.load is not None and self.load.draining)

    @property
    def model_key(self) -> str | None:
        """What this worker computes with: its weights' digest (in model_id),
        dtype and KV dtype (None until it has said).  Workers whose keys differ
        (a rolling update halfway) never pair for a KV transfer, and a stream
        that migrates moves only to a worker with its key."""
        lay = self.info.layout if self.info is not None else None
        if lay is None or lay.block_size <= 0:
            return None
        return cache_model_key(lay.model_id, lay.dtype, lay.kv_cache_dtype, lay.prefill_dtype)

    def mark_down(self) -> None:
        """A call failed in a way that says the worker is gone; the watch loop
        marks it up again on its next report."""
        self.stream_up = False

    def snapshot(self) -> WorkerLoad:
        r = self.load or pb.LoadReport()
        return WorkerLoad(address=self.address, worker_id=self.worker_id, running=r.running,
                          waiting=r.waiting, free_blocks=r.free_blocks, total_blocks=r.total_blocks,
                          queued_prompt_tokens=r.queued_prompt_tokens, inflight=self.inflight,
                          inflight_prompt_tokens=self.inflight_prompt_tokens)

    def describe(self) -> dict[str, Any]:
        """One entry of GET /cluster."""
        info, load = self.info or pb.WorkerInfo(), self.load or pb.LoadReport()
        return {"id": self.worker_id, "role": info.role or self.role, "pid": info.pid or None,
                "grpc_address": info.grpc_address or self.address, "address": self.address,
                "ucx_address": info.ucx_address or None, "metrics_url": info.metrics_url or None,
                "health": "healthy" if self.healthy else "draining" if self.alive else "unhealthy",
                "running": load.running, "waiting": load.waiting, "free_blocks": load.free_blocks,
                "total_blocks": load.total_blocks, "queued_prompt_tokens": load.queued_prompt_tokens,
                "kv_transfers_pending": load.kv_transfers_pending,
                "inflight": self.inflight, "routed": self.routed, "max_model_len": info.max_model_len or None,
                "model_id": info.model_id or None, "counters": dict(load.counters)}

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name=f"watch {self.role} {self.address}")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self.streams.close()
        await self.channel.close(grace=None)

    async def _watch(self) -> None:
        """Info, then WatchLoad until it breaks; again, with backoff, forever."""
        backoff = 0.1
        while True:
            try:
                # wait_for_ready: the call goes out the moment the channel connects
                self.info = await self.stub.Info(pb.InfoRequest(), timeout=_INFO_TIMEOUT_S,
                                                 wait_for_ready=True)
                self._check_info()
                self.info_ready.set()
                stream = self.stub.WatchLoad(pb.LoadRequest(interval_seconds=self.interval))
                async for report in stream:
                    self.load, self.last_report = report, time.monotonic()
                    await self._feed_index(report)
                    if not self.stream_up:
                        log.info("%s worker %s (%s) is up", self.role, self.worker_id, self.address)
                    self.stream_up = True
                    backoff = 0.1
                raise ConnectionError("load stream ended")
            except asyncio.CancelledError:
                raise
            except (grpc.aio.AioRpcError, ConnectionError) as e:
                await self._forget_in_index()
                if self.stream_up:
                    log.warning("%s worker %s (%s) is down: %s", self.role, self.worker_id, self.address,
                                e.details() if isinstance(e, grpc.aio.AioRpcError) else e)
                self.stream_up = False
            except Exception:
                log.exception("watching %s worker %s", self.role, self.address)
                self.stream_up = False
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, _MAX_BACKOFF_S)

    async def _feed_index(self, report: pb.LoadReport) -> None:
        if self.index is None:
            return
        events = [CacheEvent(e.kind, list(e.block_hashes), e.parent or None) for e in report.cache_events]
        for e in events:
            if e.kind == "cleared":
                self.cached.clear()
            elif e.kind == "stored":
                self.cached.update(e.block_hashes)
            else:
                self.cached.difference_update(e.block_hashes)
        if not self._index_synced:  # the index missed events: replace what it has for us
            events = [CacheEvent("cleared"), CacheEvent("stored", list(self.cached))]
        index, worker_id = self.index, self.worker_id

        def feed() -> None:
            if events:
                index.apply(worker_id, events)
            index.heartbeat(worker_id, max(2.0, 10 * self.interval))  # entries expire soon after reports stop

        try:
            await self._index_call(feed)
        except IndexUnavailable as e:
            if self._index_synced:
                log.warning("prefix index unavailable (routing on load until it is back): %s", e)
            self._index_synced = False
        else:
            if not self._index_synced:
                log.info("prefix index back; resynced %d blocks of %s", len(self.cached), worker_id)
            self._index_synced = True

    async def _forget_in_index(self) -> None:
        if self.index is not None:
            self.cached.clear()
            with contextlib.suppress(IndexUnavailable):
                await self._index_call(lambda: self.index.remove_worker(self.worker_id))  # type: ignore[union-attr]

    async def _index_call(self, fn: Callable[[], None]) -> None:
        """The embedded index is a few dict operations; a remote one may block
        for its timeout, so it runs off the event loop (in order per worker)."""
        if isinstance(self.index, EmbeddedPrefixIndex):
            fn()
        else:
            await asyncio.to_thread(fn)

    def _check_info(self) -> None:
        assert self.info is not None
        if self.info.role and self.info.role != self.role:
            log.warning("worker %s was given as %s but says it is %s", self.address, self.role,
                        self.info.role)
        if self.model_id and self.info.model_id and self.info.model_id != self.model_id:
            log.warning("worker %s serves %s but this frontend tokenizes for %s", self.address,
                        self.info.model_id, self.model_id)


class WorkerPool:
    def __init__(self, decode: Iterable[str], prefill: Iterable[str], interval: float = 0.2,
                 model_id: str | None = None, index: PrefixIndex | None = None,
                 cluster_token: str | None = None) -> None:
        self.index = index
        self.interval = interval
        self.model_id = model_id
        self.cluster_token = cluster_token
        self.decodes = {a: self._worker(a, "decode") for a in decode}
        self.prefills = {a: self._worker(a, "prefill") for a in prefill}
        self._retiring: set[asyncio.Task[None]] = set()

    def _worker(self, address: str, role: Role) -> Worker:
        return Worker(address, role, self.interval, self.model_id, self.index, self.cluster_token)

    def kv_layout(self) -> dict[str, object] | None:
        """The full KV layout the serving workers reported (registrations must match it):
        every field of the message, which mirrors kvtransfer's KVLayout (one definition;
        tests/unit/test_kv_wire.py holds them equal)."""
        for w in self.all:
            if w.info is not None and w.info.layout.block_size > 0:
                lay = w.info.layout
                return {f.name: getattr(lay, f.name) for f in lay.DESCRIPTOR.fields}
        return None

    def layout(self) -> tuple[int, str] | None:
        """(block size, the model's key in block hashes) as the workers reported them."""
        for w in self.all:
            if w.info is not None and w.model_key is not None:
                return w.info.layout.block_size, w.model_key
        return None

    @property
    def all(self) -> list[Worker]:
        return [*self.decodes.values(), *self.prefills.values()]

    async def start(self, wait_seconds: float) -> bool:
        """Start watching every worker; wait (bounded) until each has answered Info.
        False: some did not in time (they keep being retried in the background)."""
        for w in self.all:
            w.start()
        waits = [w.info_ready.wait() for w in self.all]
        try:
            await asyncio.wait_for(asyncio.gather(*waits), timeout=wait_seconds)
            return True
        except asyncio.TimeoutError:
            missing = [w.address for w in self.all if w.info is None]
            log.warning("workers did not answer Info within %.1f s: %s", wait_seconds, ", ".join(missing))
            return False

    async def close(self) -> None:
        for t in self._retiring:
            t.cancel()
        await asyncio.gather(*self._retiring, return_exceptions=True)
        await asyncio.gather(*(w.close() for w in self.all))

    def sync(self, role: Role, addresses: set[str]) -> None:
        """Discovery: make `role`'s workers exactly `addresses`.  New ones start
        being watched; gone ones leave routing now and close once idle."""
        workers = self.decodes if role == "decode" else self.prefills
        for address in sorted(addresses - workers.keys()):
            log.info("discovered %s worker at %s", role, address)
            w = workers[address] = self._worker(address, role)
            w.start()
        for address in sorted(workers.keys() - addresses):
            log.info("%s worker at %s deregistered", role, address)
            task = asyncio.create_task(self._retire(workers.pop(address)), name=f"retire {address}")
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    async def _retire(self, w: Worker) -> None:
        deadline = time.monotonic() + _RETIRE_WAIT_S
        while w.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await w.close()
        if all(other.worker_id != w.worker_id for other in self.all):  # not back at a new address
            await w._forget_in_index()

    def healthy(self, role: Role, exclude: Iterable[str] = (), model_key: str | None = None) -> list[Worker]:
        """model_key: only workers computing with it (Worker.model_key); None: any."""
        skip = set(exclude)
        workers = self.decodes if role == "decode" else self.prefills
        return [w for a, w in workers.items()
                if a not in skip and w.healthy and (model_key is None or w.model_key == model_key)]

    def max_model_len(self) -> int | None:
        """The smallest max_model_len any worker reported (they should agree)."""
        lens = [w.info.max_model_len for w in self.all if w.info and w.info.max_model_len > 0]
        return min(lens) if lens else None
