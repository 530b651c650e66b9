"""Receive side (decode worker): announced transfers land straight in their blocks.

Invariant 3 rests on one rule: a transfer is finished (its future resolved,
`cancel()` returned) only after every receive it posted has completed in UCX,
and a completed UCX request never touches its buffer again.  Stopping a
transfer early closes its connection, which makes UCX complete the posted
receives with an error whatever the sender is doing: sending, dead or hung.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtransfer import wire
from kvtransfer.channel import Channel, block_buffer
from kvtransfer.errors import TransferCancelled, TransferError, TransferFailed, TransferTimeout
from kvtransfer.layout import KVLayout, LayoutMismatch, check_compatible
from kvtransfer.listen_host import ListenHost, endpoint_addresses
from kvtransfer.stats import DirectionStats, Outcome, TransferRecord

log = logging.getLogger(__name__)

# Receives posted at once per transfer.  ucxx keeps a pool of 100 Python futures per
# process, refilled as requests complete; posting more at once drains it (it warns and
# refills inline).  32 is well above what the sender keeps in flight (4 MiB: 11 blocks of 360 KiB).
RECV_LANES = 32


@dataclass(eq=False)
class _Incoming:
    transfer_id: str
    block_ids: tuple[int, ...]
    token: bytes
    future: asyncio.Future[int]
    created: float
    channel: Channel | None = None  # set when the header arrived and the receives were posted
    started: float | None = None
    outcome: Outcome | None = None  # the first decided outcome wins
    error: TransferError | None = None
    finished: asyncio.Event = field(default_factory=asyncio.Event)  # no byte can land any more
    timer: asyncio.TimerHandle | None = None


class Receiver:
    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, stats: DirectionStats,
                 record: Callable[[TransferRecord], None], handshake_timeout_s: float,
                 listen_host: ListenHost | None = None) -> None:
        self._kv_cache = kv_cache
        self._listen_host = listen_host
        self._layout = layout
        self._stats = stats
        self._record = record
        self._handshake_timeout_s = handshake_timeout_s
        self._transfers: dict[str, _Incoming] = {}
        self._channels: set[Channel] = set()
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def num_pending(self) -> int:
        return len(self._transfers)

    def expect(self, transfer_id: str, block_ids: Sequence[int], timeout_s: float | None = None, *,
               token: bytes) -> asyncio.Future[int]:
        ids = tuple(int(b) for b in block_ids)
        num_blocks = self._kv_cache.shape[0]
        if not transfer_id:
            raise ValueError("transfer_id must be a non-empty string")
        if not wire.MIN_TOKEN_BYTES <= len(token) <= wire.MAX_TOKEN_BYTES:
            raise ValueError(f"token must be {wire.MIN_TOKEN_BYTES} to {wire.MAX_TOKEN_BYTES} bytes "
                             "(wire.new_transfer_token() makes one)")
        if transfer_id in self._transfers:
            raise ValueError(f"transfer {transfer_id!r} is already expected")
        if any(not 0 <= b < num_blocks for b in ids):
            raise ValueError(f"block ids must be in [0, {num_blocks}), got {list(ids)}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"block ids must be distinct, got {list(ids)}")
        loop = asyncio.get_running_loop()
        inc = _Incoming(transfer_id, ids, bytes(token), loop.create_future(), time.monotonic())
        if timeout_s is not None:
            error = TransferTimeout(f"transfer {transfer_id!r}: blocks did not arrive within {timeout_s}s")
            inc.timer = loop.call_later(timeout_s, lambda: self._spawn(self._stop(inc, "timed_out", error)))
        self._transfers[transfer_id] = inc
        return inc.future

    async def cancel(self, transfer_id: str) -> None:
        inc = self._transfers.get(transfer_id)
        if inc is not None:
            await self._stop(inc, "cancelled",
                             TransferCancelled(f"transfer {transfer_id!r} cancelled by the receiver"))

    def serve(self, endpoint: Any) -> None:
        """Listener callback: one new connection from a sender."""
        chan = Channel(endpoint)
        if self._listen_host is not None and not self._listen_host.any:
            local, remote = endpoint_addresses(getattr(endpoint, "ucp_endpoint", 0))
            if not self._listen_host.admits(local):
                self._stats.off_host_connections += 1
                log.warning("kvtransfer: refused a connection from %s to %s: this worker listens "
                            "on %s only", remote or "an unknown address", local or "an unknown address",
                            self._listen_host.host)
                chan.abort()  # before any receive is posted: not a byte is read
                return
        self._channels.add(chan)
        self._spawn(self._serve(chan))

    async def close(self) -> None:
        error = TransferFailed("the decode worker's KV transport closed")
        await asyncio.gather(*(self._stop(inc, "failed", error) for inc in list(self._transfers.values())))
        for chan in list(self._channels):
            chan.abort()
        if self._tasks:
            await asyncio.wait(list(self._tasks))

    async def _stop(self, inc: _Incoming, outcome: Outcome, error: TransferError) -> None:
        """Decide `outcome` unless already decided; return once no byte of `inc` can land."""
        if inc.outcome is None:
            inc.outcome, inc.error = outcome, error
            if inc.channel is None:
                self._finish(inc)  # nothing posted; a header arriving later is refused
            else:
                inc.channel.abort()  # UCX completes every posted receive; _receive() finishes
        await inc.finished.wait()

    def _finish(self, inc: _Incoming) -> None:
        assert inc.outcome is not None
        if inc.timer is not None:
            inc.timer.cancel()
        if self._transfers.get(inc.transfer_id) is inc:
            del self._transfers[inc.transfer_id]
        inc.finished.set()
        nbytes = len(inc.block_ids) * self._layout.block_bytes if inc.outcome == "ok" else 0
        seconds = time.monotonic() - (inc.started if inc.started is not None else inc.created)
        self._record(TransferRecord("recv", inc.transfer_id, inc.outcome, nbytes, seconds))
        if inc.future.done():  # the caller cancelled the future itself
            return
        if inc.outcome == "ok":
            inc.future.set_result(nbytes)
        else:
            assert inc.error is not None
            inc.future.set_exception(inc.error)
            if inc.outcome == "cancelled":
                inc.future.exception()  # whoever cancelled knows; not an unretrieved error

    async def _serve(self, chan: Channel) -> None:
        try:
            if not await self._handshake(chan):
                return
            while not chan.closed:
                msg = await chan.recv_msg()
                if not isinstance(msg, wire.TransferHeader):
                    raise wire.WireError(f"expected a transfer header, got {type(msg).__name__}")
                await self._receive(chan, msg)
        except Exception as e:  # the sender hung up, died, or broke the protocol
            if chan.closed:
                log.debug("kvtransfer: connection closed: %r", e)
            else:
                log.warning("kvtransfer: dropping a sender's connection: %r", e)
        finally:
            chan.abort()
            self._channels.discard(chan)

    async def _handshake(self, chan: Channel) -> bool:
        hello = await chan.recv_msg_within(self._handshake_timeout_s)
        if not isinstance(hello, wire.Hello):
            raise wire.WireError(f"expected HELLO, got {type(hello).__name__}")
        try:
            check_compatible(self._layout, hello.layout)
        except LayoutMismatch as e:
            self._stats.layout_mismatches += 1
            log.error("kvtransfer: refused a prefill worker's connection: %s", e)
            await chan.send_msg(wire.HelloAck(self._layout, error=str(e)))
            with contextlib.suppress(Exception):  # let the sender read the refusal and hang up first
                await chan.recv_msg_within(self._handshake_timeout_s)
            return False
        await chan.send_msg(wire.HelloAck(self._layout))
        return True

    async def _receive(self, chan: Channel, header: wire.TransferHeader) -> None:
        inc = self._transfers.get(header.transfer_id)
        reason = _refusal(inc, header)
        if inc is None or reason:
            # Nothing is posted: a refused sender cannot write a byte, and the invited
            # transfer (if any) is untouched and may still arrive.
            self._stats.bad_tokens += inc is not None and reason == _BAD_TOKEN
            self._record(TransferRecord("recv", header.transfer_id, "rejected", 0, 0.0))
            await chan.send_msg(wire.Reject(header.seq, reason))
            return
        inc.channel, inc.started = chan, time.monotonic()
        num_lanes = min(RECV_LANES, len(inc.block_ids))
        lanes = [asyncio.ensure_future(self._lane(chan, inc, header.seq, k)) for k in range(num_lanes)]
        for lane in lanes:  # one failed block fails the transfer: stop waiting for the others
            lane.add_done_callback(lambda f: _abort_if_failed(f, chan))
        try:
            await asyncio.sleep(0)  # let the lanes post before the sender is told to go
            await chan.send_msg(wire.Ready(header.seq))
        except Exception:
            chan.abort()
        results = await asyncio.gather(*lanes, return_exceptions=True)
        # Every receive has completed in UCX: nothing can land in these blocks any more.
        failures = [r for r in results if isinstance(r, BaseException)]
        if inc.outcome is None:
            if failures:
                cause = next((f for f in failures if not isinstance(f, _LaneStopped)), failures[0])
                inc.outcome = "failed"
                inc.error = TransferFailed(f"transfer {inc.transfer_id!r}: blocks stopped arriving "
                                           f"(the sender disconnected or failed): {cause!r}")
            else:
                inc.outcome = "ok"
        self._finish(inc)
        if inc.outcome == "ok":
            await chan.send_msg(wire.Done(header.seq, len(inc.block_ids) * self._layout.block_bytes))
        else:
            chan.abort()

    async def _lane(self, chan: Channel, inc: _Incoming, seq: int, k: int) -> None:
        """Receive blocks k, k + RECV_LANES, ... one after another, each straight into its
        KV block.  A block that arrives before its receive is posted waits in UCX (rendezvous:
        only a small request is queued; the data moves when the receive is posted)."""
        for i in range(k, len(inc.block_ids), RECV_LANES):
            if inc.outcome is not None or chan.closed:
                raise _LaneStopped()  # never post into blocks of a stopped transfer
            await chan.recv_block(block_buffer(self._kv_cache, inc.block_ids[i]), seq, i)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


class _LaneStopped(Exception):
    """A lane saw its transfer stopped (by another lane's failure or by _stop) and posted no more."""


_BAD_TOKEN = "the transfer's token is missing or wrong"


def _refusal(inc: _Incoming | None, header: wire.TransferHeader) -> str:
    if inc is None:
        return (f"transfer {header.transfer_id!r} is not expected here "
                "(never announced, already finished, timed out or cancelled)")
    if not hmac.compare_digest(inc.token, header.token):  # first: nothing else is revealed
        return _BAD_TOKEN
    if inc.channel is not None:
        return f"transfer {header.transfer_id!r} is already being received"
    if header.block_ids != inc.block_ids:
        return (f"transfer {header.transfer_id!r}: sender targets blocks {_short(header.block_ids)}, "
                f"receiver reserved {_short(inc.block_ids)}")
    return ""


def _abort_if_failed(f: asyncio.Future[Any], chan: Channel) -> None:
    if f.cancelled() or f.exception() is not None:
        chan.abort()


def _short(ids: tuple[int, ...]) -> str:
    return f"{list(ids[:8])}{'...' if len(ids) > 8 else ''} ({len(ids)} blocks)"

