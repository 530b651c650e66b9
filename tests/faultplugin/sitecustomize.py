"""Faults inside the KV transfer of a worker process that a test starts (issue 13).

Python imports `sitecustomize` at start-up from the first folder on
PYTHONPATH that has one; `tests.integration.procs.fault_env()` puts this
folder there and sets SPLITSERVE_TEST_FAULTS to a JSON object.  Without that
variable this module does nothing, and nothing in the product knows it: it
sets the sender's own test seam (`KVTransport.fault`, a `SendFault`) and
wraps two functions of kvtransfer.

Keys of SPLITSERVE_TEST_FAULTS:
  dir                 where the signals below are written (required)
  stall_after_blocks  the sender stalls once that many blocks of a transfer
                      have been sent and UCX completed them (bytes moved)
  stall_count         how many transfers stall (default 1); later ones run
  freeze              true: the stall blocks the event loop (a hung process:
                      no gRPC, no cancel seen) until released; false (default):
                      it waits until released or the send is stopped (its
                      timeout, its caller's cancel)
  count_received      true: `dir/received` holds the number of KV blocks this
                      process has received in full

Signals: `dir/stalled-K` (K = 1, 2, ...) appears when the K-th stall begins
and holds the number of blocks sent; the test creates `dir/release-K` to end
it, and `dir/resumed-K` appears as the released sender goes on sending.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

_CONFIG = os.environ.get("SPLITSERVE_TEST_FAULTS")
POLL_S = 0.02


def _write(path: Path, text: str) -> None:
    """Atomically, so a test never reads half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _install(config: dict) -> None:  # type: ignore[type-arg]
    import asyncio
    import time

    root = str(Path(__file__).resolve().parents[2])
    if root not in sys.path:
        sys.path.insert(0, root)
    from kvtransfer import channel, sender, transport

    signals = Path(config["dir"])
    signals.mkdir(parents=True, exist_ok=True)

    if "stall_after_blocks" in config:
        stalls = [0]
        limit = int(config.get("stall_count", 1))
        freeze = bool(config.get("freeze", False))
        init = transport.KVTransport.__init__

        def patched_init(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
            init(self, *args, **kwargs)
            self.fault = sender.SendFault(int(config["stall_after_blocks"]), stall_s=0.0, freeze_loop=freeze)

        async def stall(fault, attempt) -> None:  # type: ignore[no-untyped-def]
            if stalls[0] >= limit:
                return
            stalls[0] += 1
            release = signals / f"release-{stalls[0]}"
            _write(signals / f"stalled-{stalls[0]}", str(fault.stall_after_blocks))
            while not release.exists():
                if freeze:
                    time.sleep(POLL_S)
                elif attempt.stopped.is_set():
                    return
                else:
                    await asyncio.sleep(POLL_S)
            # Released: the sender goes straight on to post its next blocks.
            _write(signals / f"resumed-{stalls[0]}", "")

        transport.KVTransport.__init__ = patched_init  # type: ignore[method-assign]
        sender._stall = stall

    if config.get("count_received"):
        received = [0]
        recv_block = channel.Channel.recv_block

        async def counted(self, buffer, seq: int, index: int) -> None:  # type: ignore[no-untyped-def]
            await recv_block(self, buffer, seq, index)
            received[0] += 1
            _write(signals / "received", str(received[0]))

        channel.Channel.recv_block = counted  # type: ignore[method-assign]


if _CONFIG:
    _install(json.loads(_CONFIG))
