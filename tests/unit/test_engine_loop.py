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


class InstantEngine:
    """Stands in for the engine's thread-side surface only: a request that
    becomes runnable when its KV lands and then yields a token per step, with
    steps that take no time at all (the race is about scheduling, not the model)."""

    def __init__(self, steps: int) -> None:
        self.runnable = False
        self.steps = steps
        self.produced = 0
        self.kv: Any = type("KV", (), {"take_events": staticmethod(lambda: [])})()

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
