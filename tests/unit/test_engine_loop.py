"""EngineLoop's ordering: an output handed over from inside a `call` reaches its
stream ahead of the tokens that the following steps produce, however fast
those steps are.  The decode worker hands over the remote prefill's first
token this way; when it put that token on the stream itself after awaiting the
call, a quick step could land the second token first (seen in the 2x2 stack)."""

from __future__ import annotations

import asyncio
from typing import Any

from engine.outputs import StepOutput
from services.engine_loop import EngineLoop
from services.fault_hooks import FaultHooks


class InstantEngine:
    """Stands in for the engine's thread-side surface only: a request that
    becomes runnable when its KV lands and then yields a token per step, with
    steps that take no time at all (the race is about scheduling, not the model)."""

    def __init__(self, steps: int) -> None:
        self.runnable = False
        self.steps = steps
        self.produced = 0
        self.kv: Any = type("KV", (), {"take_events": staticmethod(lambda: []), "num_free_blocks": 0})()

    def has_unfinished(self) -> bool:
        return self.runnable

    def step(self) -> list[StepOutput]:
        self.produced += 1
        done = self.produced == self.steps
        self.runnable = not done
        return [StepOutput("r", [self.produced], "", None, finished=done)]

    def landed(self) -> StepOutput:
        self.runnable = True
        return StepOutput("r", [0], "", None)


def test_output_emitted_inside_a_call_comes_before_the_next_steps() -> None:
    async def run() -> list[int]:
        engine = InstantEngine(steps=5)
        loop = EngineLoop(engine, asyncio.get_running_loop())  # type: ignore[arg-type]
        q = loop.open_stream("r")
        loop.start()
        try:
            await loop.call(lambda e: loop.emit([e.landed()]))  # type: ignore[attr-defined]
            tokens: list[int] = []
            while True:
                out = await asyncio.wait_for(q.get(), timeout=5)
                assert isinstance(out, StepOutput)
                tokens += out.new_token_ids
                if out.finished:
                    return tokens
        finally:
            loop.stop()

    for _ in range(5):  # the old order failed on most tries
        assert asyncio.run(run()) == [0, 1, 2, 3, 4, 5]


def test_a_dead_engine_thread_fails_every_stream_and_call_and_says_so(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An error outside step() (here a fault hook) ends the thread:
    the open stream gets EngineDead, pending and later calls raise it, and
    on_death runs on the loop; nothing waits forever."""
    from services.engine_loop import EngineDead

    async def run() -> None:
        engine = InstantEngine(steps=10**9)
        crash = tmp_path / "crash"
        def crash_once_the_file_exists() -> None:
            if crash.exists():
                raise RuntimeError("injected engine-thread fault")

        loop = EngineLoop(engine, asyncio.get_running_loop(),  # type: ignore[arg-type]
                          faults=FaultHooks(engine_iteration=crash_once_the_file_exists))
        died = asyncio.Event()
        loop.on_death = lambda err: died.set()
        q = loop.open_stream("r")
        loop.start()
        try:
            await loop.call(lambda e: loop.emit([e.landed()]))  # type: ignore[attr-defined]
            crash.touch()
            await asyncio.wait_for(died.wait(), timeout=5)
            items = [await asyncio.wait_for(q.get(), timeout=5) for _ in range(q.qsize())]
            assert isinstance(items[-1], EngineDead), items
            try:
                await asyncio.wait_for(loop.call(lambda e: 1), timeout=5)
                raise AssertionError("a call on a dead engine returned")
            except EngineDead:
                pass
            assert isinstance(loop.open_stream("late").get_nowait(), EngineDead)
        finally:
            loop.stop()

    asyncio.run(run())


def test_a_failed_step_spares_requests_whose_kv_is_in_flight() -> None:
    """Invariant 3: blocks a transfer may still write are freed by the request's own
    RPC after it cancelled the transfer, never by the failure path."""
    from engine.request import RequestStatus

    class Req:
        def __init__(self, status: RequestStatus) -> None:
            self.status = status

    class FailingEngine(InstantEngine):
        def __init__(self) -> None:
            super().__init__(steps=1)
            self.runnable = True
            self.aborted: list[str] = []
            self.scheduler: Any = type("S", (), {})()
            self.scheduler.requests = {"running": Req(RequestStatus.RUNNING),
                                       "receiving": Req(RequestStatus.WAITING_FOR_REMOTE_KV)}

        def step(self) -> list[StepOutput]:
            self.runnable = False
            raise RuntimeError("boom")

        def abort(self, rid: str) -> bool:
            self.aborted.append(rid)
            return True

    async def run() -> list[str]:
        engine = FailingEngine()
        loop = EngineLoop(engine, asyncio.get_running_loop())  # type: ignore[arg-type]
        q = loop.open_stream("running")
        loop.start()
        try:
            out = await asyncio.wait_for(q.get(), timeout=5)
            assert isinstance(out, RuntimeError)
            return engine.aborted
        finally:
            loop.stop()

    assert asyncio.run(run()) == ["running"]
