"""cancel_and_wait stops a background loop even when the loop survives its first
cancellation, so that closing a service never hangs on it."""

from __future__ import annotations

import asyncio

import pytest

from services.aio_tasks import cancel_and_wait


async def loop_that_swallows_one_cancel(state: dict[str, int]) -> None:
    """A loop whose first cancellation a library turned into an error of its own,
    which the loop logged and survived (the fault itself cannot be caused on demand)."""
    while True:
        try:
            await asyncio.sleep(0.01)
            state["rounds"] += 1
        except asyncio.CancelledError:
            state["cancels"] += 1
            if state["cancels"] > 1:
                raise


def test_a_loop_that_survives_its_cancellation_is_cancelled_again() -> None:
    async def main() -> dict[str, int]:
        state = {"rounds": 0, "cancels": 0}
        task = asyncio.create_task(loop_that_swallows_one_cancel(state), name="stubborn")
        while state["rounds"] < 3:  # running
            await asyncio.sleep(0.01)
        # asyncio.wait, not wait_for: a timeout must not cancel (and so help) cancel_and_wait
        closing = asyncio.create_task(cancel_and_wait(task, recancel_s=0.1))
        done, _ = await asyncio.wait({closing}, timeout=10)
        if not done:
            task.cancel()  # let the test end
        assert done, "cancel_and_wait still waiting 10 s after the loop survived its cancellation"
        assert task.cancelled()
        return state

    state = asyncio.run(main())
    assert state["cancels"] == 2, "the first cancellation was swallowed, the second ended the loop"


def test_a_loop_that_failed_raises_its_error() -> None:
    async def fails() -> None:
        raise ValueError("broken loop")

    async def main() -> None:
        task = asyncio.create_task(fails())
        await asyncio.sleep(0)
        with pytest.raises(ValueError, match="broken loop"):
            await cancel_and_wait(task)

    asyncio.run(main())


def test_none_is_nothing_to_stop() -> None:
    asyncio.run(cancel_and_wait(None))
