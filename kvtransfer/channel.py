"""One UCX connection between a prefill and a decode worker.

A channel carries one transfer at a time.  ucxx (0.52) cannot cancel a single
posted receive or send from Python: only closing the endpoint cancels them,
all at once.  Giving each in-flight transfer a connection of its own makes
"cancel this transfer" and "close this connection" the same act, and the
sender's pool reuses the connection when a transfer ends cleanly.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import torch

from kvtransfer import wire

_LEN = struct.Struct("<Q")
MAX_CONTROL_BYTES = 64 << 20  # a header for 16M block ids; anything larger is a broken peer
# How long abort() may block the event loop while ucxx cancels the endpoint's
# requests (measured: a few ms); UCX completes them with an error regardless.
ABORT_WAIT_NS = 1_000_000_000


def block_buffer(kv_cache: torch.Tensor, block_id: int) -> Any:
    """A zero-copy byte view of one block that UCX reads from or writes into.

    CPU: a numpy uint8 array over the tensor's memory (numpy has no bfloat16,
    bytes do).  CUDA: the uint8 tensor itself, which UCX reaches through
    __cuda_array_interface__ and moves device to device.
    """
    view = kv_cache[block_id].view(-1).view(torch.uint8)  # [block_bytes]
    return view.numpy() if view.device.type == "cpu" else view


class Channel:
    def __init__(self, endpoint: Any) -> None:
        self._ep = endpoint  # ucxx Endpoint; its tags are private to this connection
        self._seq = 0
        self.aborted = False

    @property
    def closed(self) -> bool:
        return self.aborted or self._ep.closed

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    async def send_msg(self, msg: wire.Message) -> None:
        payload = wire.encode(msg)
        # two messages on one tag arrive in order; the prefix lets any size through
        await self._ep.send(_LEN.pack(len(payload)), tag=wire.CONTROL_TAG)
        await self._ep.send(payload, tag=wire.CONTROL_TAG)

    async def recv_msg(self) -> wire.Message:
        head = bytearray(_LEN.size)
        await self._ep.recv(head, tag=wire.CONTROL_TAG)
        (n,) = _LEN.unpack(head)
        if n > MAX_CONTROL_BYTES:
            raise wire.WireError(f"control message of {n} bytes announced, at most {MAX_CONTROL_BYTES}")
        body = bytearray(n)
        await self._ep.recv(body, tag=wire.CONTROL_TAG)
        return wire.decode(body)

    async def recv_msg_within(self, timeout_s: float) -> wire.Message:
        # Never cancel a coroutine that awaits a UCX request: ucxx does not keep the
        # buffer alive.  Close the connection instead (UCX completes the request), then wait.
        task = asyncio.ensure_future(self.recv_msg())
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
        if not done:
            self.abort()
            await asyncio.wait({task})
            task.exception()
            raise TimeoutError(f"no control message within {timeout_s}s")
        return task.result()

    async def send_block(self, buffer: Any, seq: int, index: int) -> None:
        # Completion is local (UCX is done reading `buffer`); delivery is what DONE confirms.
        await self._ep.send(buffer, tag=wire.data_tag(seq, index))

    async def recv_block(self, buffer: Any, seq: int, index: int) -> None:
        await self._ep.recv(buffer, tag=wire.data_tag(seq, index))

    def abort(self) -> None:
        """Close now.  UCX completes every posted send and receive of this endpoint
        (with an error unless already done) and the peer sees the connection drop."""
        if not self.aborted:
            self.aborted = True
            self._ep.abort(period=ABORT_WAIT_NS)
