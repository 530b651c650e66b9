"""Background asyncio tasks the services run until they close.  Torch-free."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Stop a background loop (None: none was started) and wait until it has: after
    this, it touches nothing the caller is about to close."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
