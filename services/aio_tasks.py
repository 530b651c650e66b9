"""Background asyncio tasks the services run until they close.  Torch-free."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

log = logging.getLogger(__name__)


async def cancel_and_wait(task: asyncio.Task[Any] | None, recancel_s: float = 1.0) -> None:
    """Stop a background loop (None: none was started) and wait until it has: after
    this, it touches nothing the caller is about to close.

    A loop can outlive one cancellation: a library that turns the CancelledError
    into an error of its own (as asyncio's timeouts can on Python 3.11 when the
    cancel and the timeout meet) leaves a loop that logs errors and goes on.  So
    the task is cancelled again every `recancel_s` until it ends: closing never
    hangs on it (a frontend did not exit after SIGTERM, its discovery loop
    still reading Redis)."""
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=recancel_s)
        if not task.done():
            log.warning("background task %s outlived its cancellation; cancelling it again", task.get_name())
    with contextlib.suppress(asyncio.CancelledError):
        await task
