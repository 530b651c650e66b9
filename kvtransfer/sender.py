"""Send side (prefill worker): blocks go out straight from KV memory.

When `send()` returns or raises, UCX has finished with every source block, so
the caller may free them (invariant 3 on the sending side).  A timeout or a
caller's cancellation therefore closes the connection, which completes the
posted sends, and then waits for them; it never abandons a running request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvtransfer import wire
from kvtransfer.channel import Channel, block_buffer
from kvtransfer.errors import TransferError, TransferFailed, TransferRejected, TransferTimeout
from kvtransfer.layout import KVLayout, LayoutMismatch, check_compatible
from kvtransfer.stats import DirectionStats, Outcome, TransferRecord

log = logging.getLogger(__name__)

MAX_IDLE_PER_PEER = 8  # pooled connections kept per decode worker; more are closed after use
# After a timeout the closed connection completes the posted sends within
# milliseconds; this only bounds a UCX that would not.
ABORT_GRACE_S = 10.0


@dataclass
class SendFault:
    """Test-only: stall the sender after `stall_after_blocks` blocks have been sent."""

    stall_after_blocks: int
    stall_s: float
    # True: time.sleep, like a hung process (the event loop freezes, UCX's thread runs on);
    # False: asyncio.sleep, like a slow producer (a timeout still interrupts it).
    freeze_loop: bool = False
    # The stall itself, instead of sleeping stall_s (e.g. until a test releases it):
    # called with this fault and an event set once the send is stopped from outside.
    wait: Callable[[SendFault, asyncio.Event], Awaitable[None]] | None = None


@dataclass(eq=False)
class _Attempt:
    """One send() call; its timeout, its caller's cancellation and close() stop it from outside."""

    channel: Channel | None = None
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    error: TransferError | None = None  # why it was stopped; raised instead of what surfaced

    def stop(self, error: TransferError) -> None:
        if self.error is None:
            self.error = error
        self.stopped.set()
        if self.channel is not None:
            self.channel.abort()  # completes the posted sends; the attempt then fails fast


class Sender:
    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, stats: DirectionStats,
                 record: Callable[[TransferRecord], None], max_inflight_bytes: int,
                 timeout_s: float) -> None:
        self._kv_cache = kv_cache
        self._layout = layout
        self._stats = stats
        self._record = record
        self._window = max(1, max_inflight_bytes // layout.block_bytes)  # blocks in flight
        self._timeout_s = timeout_s
        self._idle: dict[str, list[Channel]] = {}  # peer address -> handshaken, unused connections
        self._attempts: set[_Attempt] = set()
        self.fault: SendFault | None = None

    async def send(self, peer: str, transfer_id: str, src_block_ids: Sequence[int],
                   dst_block_ids: Sequence[int], token: bytes = b"") -> int:
        src, dst = [int(b) for b in src_block_ids], tuple(int(b) for b in dst_block_ids)
        num_blocks = self._kv_cache.shape[0]
        if len(src) != len(dst):
            raise ValueError(f"{len(src)} source blocks but {len(dst)} destination blocks")
        if any(not 0 <= b < num_blocks for b in src):
            raise ValueError(f"source block ids must be in [0, {num_blocks}), got {src}")
        if len(set(dst)) != len(dst):
            raise ValueError(f"destination block ids must be distinct, got {list(dst)}")
        _split_address(peer)
        start = time.monotonic()
        attempt = _Attempt()
        self._attempts.add(attempt)
        task = asyncio.ensure_future(self._run(attempt, peer, transfer_id, bytes(token), src, dst, start))
        timeout = TransferTimeout(f"transfer {transfer_id!r} to {peer} did not finish within "
                                  f"{self._timeout_s}s")
        try:
            done, _ = await asyncio.wait({task}, timeout=self._timeout_s)
            if not done:
                attempt.stop(timeout)
            await _settle(task)
        except asyncio.CancelledError:  # the caller gave up: stop UCX reading our blocks first
            attempt.stop(TransferFailed(f"send of transfer {transfer_id!r} was cancelled"))
            await _settle(task)
            if not task.cancelled():
                task.exception()  # whatever the stopped attempt raised: nobody waits for it now
            self._record(TransferRecord("send", transfer_id, "failed", 0, time.monotonic() - start))
            raise
        finally:
            self._attempts.discard(attempt)
        seconds = time.monotonic() - start
        try:
            nbytes = task.result()
        except (TransferError, LayoutMismatch, asyncio.CancelledError) as e:  # cancelled: see _settle
            # Whatever surfaced first, a transfer that overran its time limit timed out
            # (a frozen event loop notices its deadline late).
            error = attempt.error or (timeout if seconds >= self._timeout_s else None)
            self._record(TransferRecord("send", transfer_id, _outcome_of(error or e), 0, seconds))
            if error is not None:
                raise error from e
            if isinstance(e, asyncio.CancelledError):
                raise TransferFailed(f"transfer {transfer_id!r} to {peer}: UCX did not stop") from e
            raise
        self._record(TransferRecord("send", transfer_id, "ok", nbytes, seconds))
        return nbytes

    async def close(self) -> None:
        for attempt in list(self._attempts):
            attempt.stop(TransferFailed("the prefill worker's KV transport closed"))
        for idle in self._idle.values():
            for chan in idle:
                chan.abort()
        self._idle.clear()

    async def _run(self, attempt: _Attempt, peer: str, transfer_id: str, token: bytes, src: list[int],
                   dst: tuple[int, ...], start: float) -> int:
        reusable = sending = False
        try:
            chan, seq, reply = await self._start_transfer(attempt, peer, transfer_id, token, dst, start)
            if isinstance(reply, wire.Reject):
                reusable = True  # nothing was posted on either side
                raise TransferRejected(f"{peer} refused transfer {transfer_id!r}: {reply.reason}")
            _expect(reply, wire.Ready, seq)
            sending = True
            await _device_written(self._kv_cache)
            await self._send_blocks(attempt, chan, seq, src)
            _expect(await chan.recv_msg(), wire.Done, seq)
            reusable = True
            return len(src) * self._layout.block_bytes
        except (TransferError, LayoutMismatch):
            raise
        except (TimeoutError, asyncio.TimeoutError) as e:  # connecting took the whole time limit
            raise TransferTimeout(f"transfer {transfer_id!r} to {peer}: {e!r}") from e
        except Exception as e:
            what = ("connection lost mid-transfer (the decode worker cancelled or failed it, or died)"
                    if sending else "connection failed")
            raise TransferFailed(f"transfer {transfer_id!r} to {peer}: {what}: {e!r}") from e
        finally:
            if attempt.channel is not None:
                self._release(peer, attempt.channel, reusable and not attempt.stopped.is_set())

    async def _start_transfer(self, attempt: _Attempt, peer: str, transfer_id: str, token: bytes,
                              dst: tuple[int, ...], start: float,
                              ) -> tuple[Channel, int, wire.Message]:
        """Send the header; a pooled connection whose peer went away is replaced once."""
        for retry in (False, True):
            chan, pooled = await self._checkout(attempt, peer, start)
            seq = chan.next_seq()
            try:
                await chan.send_msg(wire.TransferHeader(seq, transfer_id, dst, token))
                return chan, seq, await chan.recv_msg()
            except Exception:
                if not pooled or retry or attempt.stopped.is_set():
                    raise
                chan.abort()
                log.info("kvtransfer: pooled connection to %s was broken; reconnecting", peer)
        raise AssertionError("unreachable")

    async def _checkout(self, attempt: _Attempt, peer: str, start: float) -> tuple[Channel, bool]:
        idle = self._idle.get(peer, [])
        while idle:
            chan = idle.pop()
            if not chan.closed:
                attempt.channel = chan
                return chan, True
        import ucxx  # after kvtransfer.transport applied the UCX environment

        host, port = _split_address(peer)
        remaining = max(0.1, self._timeout_s - (time.monotonic() - start))
        chan = Channel(await ucxx.create_endpoint(host, port, connect_timeout=remaining))
        attempt.channel = chan
        if attempt.stopped.is_set():
            raise TransferFailed(f"stopped while connecting to {peer}")  # send() raises the reason
        await chan.send_msg(wire.Hello(self._layout))
        ack = await chan.recv_msg()
        if not isinstance(ack, wire.HelloAck):
            raise wire.WireError(f"expected HELLO_ACK, got {type(ack).__name__}")
        try:
            check_compatible(self._layout, ack.layout)
        except LayoutMismatch:
            self._stats.layout_mismatches += 1
            raise
        if ack.error:
            raise TransferFailed(f"{peer} refused the connection: {ack.error}")
        return chan, False

    @property
    def num_pending(self) -> int:
        return len(self._attempts)

    def _release(self, peer: str, chan: Channel, reusable: bool) -> None:
        idle = self._idle.setdefault(peer, [])
        if reusable and not chan.closed and len(idle) < MAX_IDLE_PER_PEER:
            idle.append(chan)
        else:
            chan.abort()

    async def _send_blocks(self, attempt: _Attempt, chan: Channel, seq: int, src: list[int]) -> None:
        # Tagged sends, one tag per block, at most `_window` in flight: enough to
        # keep UCX busy, few enough to bound the memory it pins or stages.
        inflight: set[asyncio.Future[None]] = set()
        try:
            for i, block_id in enumerate(src):
                if self.fault is not None and i == self.fault.stall_after_blocks:
                    await _drain(inflight, 0)
                    await _stall(self.fault, attempt)
                await _drain(inflight, self._window - 1)
                buf = block_buffer(self._kv_cache, block_id)
                inflight.add(asyncio.ensure_future(chan.send_block(buf, seq, i)))
            await _drain(inflight, 0)
        finally:
            if inflight:  # failed or timed out while UCX may still read kv_cache: make it stop
                chan.abort()
                await asyncio.wait(inflight)
                for f in inflight:
                    f.exception()


async def _drain(inflight: set[asyncio.Future[None]], limit: int) -> None:
    while len(inflight) > limit:
        done, _ = await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
        inflight -= done
        errors = [e for e in (f.exception() for f in done) if e is not None]
        if errors:
            raise errors[0]


async def _stall(fault: SendFault, attempt: _Attempt) -> None:
    if fault.wait is not None:
        await fault.wait(fault, attempt.stopped)
        return
    if fault.freeze_loop:
        time.sleep(fault.stall_s)
        return
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(attempt.stopped.wait(), fault.stall_s)


async def _settle(task: asyncio.Task[int]) -> None:
    """Wait for `task` after its connection was closed, without cancelling it."""
    done, _ = await asyncio.wait({task}, timeout=ABORT_GRACE_S)
    if not done:
        log.error("kvtransfer: UCX did not complete a closed connection's sends within %ss",
                  ABORT_GRACE_S)
        task.cancel()
        await asyncio.wait({task})


async def _device_written(kv_cache: torch.Tensor) -> None:
    """Wait, without blocking the loop, until kernels queued on the current CUDA
    stream (the prefill that wrote these blocks) have finished."""
    if kv_cache.device.type != "cuda":
        return
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(kv_cache.device))
    while not event.query():
        await asyncio.sleep(0.0002)


def _expect(msg: wire.Message, kind: type, seq: int) -> None:
    if not isinstance(msg, kind) or getattr(msg, "seq", None) != seq:
        raise wire.WireError(f"expected {kind.__name__} for transfer #{seq}, got {msg!r}")


def _outcome_of(e: BaseException) -> Outcome:
    if isinstance(e, TransferRejected):
        return "rejected"
    if isinstance(e, TransferTimeout):
        return "timed_out"
    return "failed"


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"peer address must be 'host:port', got {address!r}")
    return host.strip("[]"), int(port)
