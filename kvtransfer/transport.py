"""KV block transport over UCX (ucxx), for asyncio services.

A decode worker (D) listens; a prefill worker (P) connects and pushes blocks
from its cache into blocks D reserved.  Both run KVTransport on the event loop
that also serves gRPC; nothing here blocks that loop except closing a
connection, which waits a few milliseconds for UCX.

Protocol (messages in wire.py; block i of transfer #seq travels on data_tag(seq, i)):

    P                                        D
    -- connect (ucxx endpoint; pooled per peer, one transfer at a time) --
    HELLO {P's KVLayout}                 ->  check_compatible(D, P)
                                         <-  HELLO_ACK {D's KVLayout, error}
    P checks too: on a mismatch both sides log/raise LayoutMismatch and P hangs up.
    HEADER {seq, transfer_id, token,     ->  known, idle transfer, its token (constant-time),
            dst ids}                         exactly these ids?
                                         <-  REJECT {seq, reason}       no: P raises TransferRejected;
                                                                        the connection stays usable
                                             yes: post tagged receives straight into
                                             kv_cache[dst[i]] (32 at a time, in order)
                                         <-  READY {seq}
    block i, tag data_tag(seq, i)        ->  (at most max_inflight_bytes in flight)
                                         <-  DONE {seq, nbytes}        after every receive completed
    P returns nbytes; the connection goes back to P's pool for the next transfer.

Stopping early: D's cancel() or timeout, P's timeout, or either side dying all
close the transfer's connection.  UCX then completes every posted send and
receive of it; each side finishes only after that (so a failed or cancelled
transfer never writes D's blocks or reads P's blocks afterwards), and the
other side sees the connection drop.  A connection carries one transfer at a
time precisely so that closing it stops nothing else.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvtransfer.layout import KVLayout
from kvtransfer.listen_host import ListenHost
from kvtransfer.receiver import Receiver
from kvtransfer.sender import Sender, SendFault
from kvtransfer.stats import DirectionStats, TransferRecord, TransportStats
from kvtransfer.ucx_env import (
    apply_ucx_env_defaults,
    import_what_the_progress_thread_would,
    lengthen_progress_wait,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_INFLIGHT_BYTES = 4 << 20  # ~11 blocks of the default model; more did not go faster here
DEFAULT_TIMEOUT_S = 30.0


class KVTransport:
    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, host: str = "127.0.0.1", port: int = 0,
                 max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES, timeout_s: float = DEFAULT_TIMEOUT_S,
                 on_transfer: Callable[[TransferRecord], None] | None = None,
                 listen_host: str | None = None) -> None:
        """kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], contiguous,
        on the CPU or a CUDA device.  host: the address peers use to reach this worker.
        listen_host: the local address connections must arrive on (a worker's --host); UCX
        listens on every interface, so connections that arrive elsewhere are closed unread
        (see listen_host.py); None, 0.0.0.0 or '::' admit any.  timeout_s: the limit for one
        send(), connecting included, and for the handshake of an incoming connection.
        on_transfer: called on the event loop for every finished transfer, in both directions
        (the services feed histograms with it)."""
        if not kv_cache.is_contiguous():
            raise ValueError("kv_cache must be contiguous: each block is sent as one region")
        actual = KVLayout.from_cache(kv_cache, layout.model_id, layout.dtype, layout.prefill_dtype)
        if actual != layout:
            raise ValueError(f"layout {layout} does not describe kv_cache ({actual})")
        if max_inflight_bytes < 1 or timeout_s <= 0:
            raise ValueError("max_inflight_bytes and timeout_s must be positive")
        self.layout = layout
        self.host = host
        self._port = port
        self._on_transfer = on_transfer
        self.stats = TransportStats(sent=DirectionStats(), received=DirectionStats())
        self._receiver = Receiver(kv_cache, layout, self.stats.received, self._record, timeout_s,
                                  None if listen_host is None else ListenHost(listen_host))
        self._sender = Sender(kv_cache, layout, self.stats.sent, self._record, max_inflight_bytes,
                              timeout_s)
        self._listener: Any = None
        self._closed = False

    async def start(self) -> None:
        """Start listening.  Call on the event loop that will run every other method: ucxx
        binds its progress and notifier threads to the loop that first uses it."""
        apply_ucx_env_defaults()
        import_what_the_progress_thread_would()
        import ucxx

        lengthen_progress_wait()

        self._listener = ucxx.create_listener(self._receiver.serve, port=self._port)
        log.info("kvtransfer: listening on %s (%s)", self.address, self.layout)

    @property
    def address(self) -> str:
        if self._listener is None:
            raise RuntimeError("KVTransport.start() has not run")
        return f"{self.host}:{self._listener.port}"

    @property
    def num_pending(self) -> int:
        """Transfers started and not yet ended, both directions (0 when idle: nothing leaks)."""
        return self._receiver.num_pending + self._sender.num_pending

    def expect(self, transfer_id: str, block_ids: Sequence[int], timeout_s: float | None = None, *,
               token: bytes) -> asyncio.Future[int]:
        """Receive transfer `transfer_id` into kv_cache[block_ids[i]] (block i of the sender's list).
        The services use the request's id as its transfer id.

        token: the one-time secret (wire.new_transfer_token()) the sender must present; a header
        without it is refused before any receive is posted, and the invitation stays open.

        The future resolves to the bytes received once every block landed, or fails with a
        TransferError; either way nothing of this transfer is written afterwards.  timeout_s
        (from now) fails it with TransferTimeout; None waits until cancel()."""
        self._check_open()
        return self._receiver.expect(transfer_id, block_ids, timeout_s, token=token)

    async def cancel(self, transfer_id: str) -> None:
        """Stop receiving `transfer_id`.  Once this returns no byte will ever again be written
        into its blocks, whatever the sender does; the caller may free them.  Its future fails
        with TransferCancelled unless it had already finished.  Unknown ids are ignored."""
        await self._receiver.cancel(transfer_id)

    async def send(self, kv_address: str, transfer_id: str, src_block_ids: Sequence[int],
                   dst_block_ids: Sequence[int], token: bytes = b"") -> int:
        """Send kv_cache[src[i]] into block dst[i] of the peer listening at kv_address (its
        `address`); returns the bytes sent.
        token: the one the receiver issued for this transfer (without it the peer refuses).

        Raises TransferRejected (the peer did not expect it), TransferTimeout, TransferFailed,
        or LayoutMismatch (the peer serves another layout: a deployment error).  When it returns
        or raises, the source blocks are no longer read."""
        self._check_open()
        return await self._sender.send(kv_address, transfer_id, src_block_ids, dst_block_ids, token)

    async def close(self) -> None:
        """Fail pending receives, stop sends in flight, drop all connections.  Call
        kvtransfer.shutdown_ucx() once before the process exits."""
        if self._closed:
            return
        self._closed = True
        if self._listener is not None:
            self._listener.close()
        await self._sender.close()
        await self._receiver.close()

    @property
    def fault(self) -> SendFault | None:
        """Test-only fault injection for the send side."""
        return self._sender.fault

    @fault.setter
    def fault(self, fault: SendFault | None) -> None:
        self._sender.fault = fault

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("KVTransport is closed")
        if self._listener is None:
            raise RuntimeError("KVTransport.start() has not run")

    def _record(self, rec: TransferRecord) -> None:
        (self.stats.sent if rec.direction == "send" else self.stats.received).record(rec)
        if self._on_transfer is not None:
            try:
                self._on_transfer(rec)
            except Exception:
                log.exception("kvtransfer: on_transfer callback failed")
