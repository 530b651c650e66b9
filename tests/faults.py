"""Faults for worker processes, installed through the product's one seam
(services/fault_hooks.py): start a worker with `fault_env(...)` (engine-thread
and send-delay faults) or `kv_transfer_fault_env(...)` (faults inside a KV
transfer) added to its environment; it then calls `install` below, once, before
its engine thread and its UCX transport start.  Each engine-thread or send-delay
fault logs a line starting "fault:" when it hits, so a test can prove it did;
the transfer faults write signal files instead (see kv_transfer_fault_env)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from services.fault_hooks import ENV, FaultHooks

log = logging.getLogger("tests.faults")

CRASH_FILE = "SPLITSERVE_TEST_CRASH_FILE"  # while it exists the engine thread raises outside step()
STEP_FAIL_FILE = "SPLITSERVE_TEST_STEP_FAIL_FILE"  # once it appears the next step raises (it is removed)
STEP_SLOW_FILE = "SPLITSERVE_TEST_STEP_SLOW_FILE"  # while it exists each step waits the seconds it holds
SEND_DELAY = "SPLITSERVE_TEST_SEND_DELAY"  # seconds a prefill worker waits before each KV send
KV_TRANSFER = "SPLITSERVE_TEST_FAULTS"  # a JSON object: the KV transfer faults below
POLL_S = 0.02


def fault_env(*, crash_file: Path | None = None, step_fail_file: Path | None = None,
              step_slow_file: Path | None = None, send_delay: float | None = None) -> dict[str, str]:
    env = {ENV: "tests.faults:install"}
    if crash_file is not None:
        env[CRASH_FILE] = str(crash_file)
    if step_fail_file is not None:
        env[STEP_FAIL_FILE] = str(step_fail_file)
    if step_slow_file is not None:
        env[STEP_SLOW_FILE] = str(step_slow_file)
    if send_delay is not None:
        env[SEND_DELAY] = str(send_delay)
    return env


def kv_transfer_fault_env(signals: Path, **faults: object) -> dict[str, str]:
    """The environment of a worker with faults inside its KV transfers, which write
    their signals under `signals`.  Keys of `faults`:

      stall_after_blocks  the sender stalls once that many blocks of a transfer
                          have been sent and UCX completed them (bytes moved)
      stall_count         how many transfers stall (default 1); later ones run
      freeze              true: the stall blocks the event loop (a hung process:
                          no gRPC, no cancel seen) until released; false (default):
                          it waits until released or the send is stopped (its
                          timeout, its caller's cancel)
      count_received      true: `signals/received` holds the number of KV blocks
                          this process has received in full

    Signals: `signals/stalled-K` (K = 1, 2, ...) appears when the K-th stall begins
    and holds the number of blocks sent; the test creates `signals/release-K` to
    end it, and `signals/resumed-K` appears as the released sender goes on sending."""
    return {ENV: "tests.faults:install", KV_TRANSFER: json.dumps({"dir": str(signals), **faults})}


def install(hooks: FaultHooks, role: str) -> None:
    crash, step_fail = os.environ.get(CRASH_FILE), os.environ.get(STEP_FAIL_FILE)
    step_slow = os.environ.get(STEP_SLOW_FILE)
    delay = float(os.environ.get(SEND_DELAY, "0"))
    if crash:
        def engine_iteration() -> None:
            if os.path.exists(crash):
                log.error("fault: engine thread crashes (%s exists)", crash)
                raise RuntimeError(f"injected engine-thread fault ({crash} exists)")
        hooks.engine_iteration = engine_iteration
    if step_fail or step_slow:
        slowed = [False]

        def before_step() -> None:
            try:
                wait = float(Path(step_slow).read_text()) if step_slow else 0.0
            except FileNotFoundError:
                wait = 0.0
            if wait and not slowed[0]:
                log.warning("fault: each step waits %ss (%s exists)", wait, step_slow)
            slowed[0] = bool(wait)
            time.sleep(wait)
            if step_fail and os.path.exists(step_fail):
                os.unlink(step_fail)
                log.error("fault: this step fails (%s)", step_fail)
                raise RuntimeError(f"injected step failure ({step_fail})")
        hooks.before_step = before_step
    if delay and role == "prefill":
        async def before_kv_send(request_id: str) -> None:
            log.warning("fault: KV send of %s waits %ss", request_id, delay)
            await asyncio.sleep(delay)
        hooks.before_kv_send = before_kv_send
    if os.environ.get(KV_TRANSFER):
        _install_kv_transfer_faults(hooks, json.loads(os.environ[KV_TRANSFER]))


def _write(path: Path, text: str) -> None:
    """Atomically, so a test never reads half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _install_kv_transfer_faults(hooks: FaultHooks, config: Mapping[str, Any]) -> None:
    from kvtransfer.channel import Channel
    from kvtransfer.sender import SendFault

    signals = Path(config["dir"])
    signals.mkdir(parents=True, exist_ok=True)

    if "stall_after_blocks" in config:
        stalls = [0]
        limit = int(config.get("stall_count", 1))
        freeze = bool(config.get("freeze", False))

        async def stall(fault: SendFault, stopped: asyncio.Event) -> None:
            if stalls[0] >= limit:
                return
            stalls[0] += 1
            release = signals / f"release-{stalls[0]}"
            _write(signals / f"stalled-{stalls[0]}", str(fault.stall_after_blocks))
            while not release.exists():
                if freeze:
                    time.sleep(POLL_S)
                elif stopped.is_set():
                    return
                else:
                    await asyncio.sleep(POLL_S)
            # Released: the sender goes straight on to post its next blocks.
            _write(signals / f"resumed-{stalls[0]}", "")

        hooks.kv_send = SendFault(int(config["stall_after_blocks"]), stall_s=0.0, freeze_loop=freeze,
                                  wait=stall)

    if config.get("count_received"):
        # A probe, not a fault: the product has no hook here, so the test wraps
        # the receiving channel's method in this process.
        received = [0]
        recv_block = Channel.recv_block

        async def counted(self: Channel, buffer: Any, seq: int, index: int) -> None:
            await recv_block(self, buffer, seq, index)
            received[0] += 1
            _write(signals / "received", str(received[0]))

        Channel.recv_block = counted  # type: ignore[method-assign]
