"""Runs an LLMEngine in its own thread so the asyncio loop (gRPC, UCX) never
blocks on a forward pass.  Callers submit commands that run between steps and
read each request's outputs from an asyncio queue."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from engine.block_pool import CacheEvent
from engine.llm_engine import LLMEngine
from engine.outputs import StepOutput

log = logging.getLogger(__name__)
T = TypeVar("T")

StreamItem = StepOutput | BaseException


class EngineLoop:
    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self._loop = loop
        self._cmds: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[StreamItem]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        # Called on the asyncio loop with each batch of prefix-cache events.
        self.on_cache_events: Callable[[list[CacheEvent]], None] | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._cmds.put(lambda: None)
        self._thread.join(timeout=10)

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run fn(engine) on the engine thread between two steps."""
        fut: asyncio.Future[T] = self._loop.create_future()

        def run() -> None:
            try:
                result: Any = fn(self.engine)
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting caller
                self._loop.call_soon_threadsafe(_set_exception, fut, e)
            else:
                self._loop.call_soon_threadsafe(_set_result, fut, result)

        self._cmds.put(run)
        return await fut

    def emit(self, outs: list[StepOutput]) -> None:
        """On the engine thread (inside a `call`): hand outputs to their
        streams in order with the steps' own, behind every output already handed
        over and ahead of the next step's.  An output the caller put on the
        stream itself after awaiting `call` could land behind the next step's
        token: the step may run before the awaiting coroutine resumes."""
        self._loop.call_soon_threadsafe(self._dispatch, outs)

    def open_stream(self, request_id: str) -> asyncio.Queue[StreamItem]:
        q: asyncio.Queue[StreamItem] = asyncio.Queue()
        self._streams[request_id] = q
        return q

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    @property
    def num_streams(self) -> int:
        """Requests being served (each RPC holds one stream while it runs)."""
        return len(self._streams)

    def _dispatch(self, outs: list[StepOutput]) -> None:
        for out in outs:
            q = self._streams.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    def _fail_all(self, err: BaseException) -> None:
        for q in self._streams.values():
            q.put_nowait(err)

    def _run(self) -> None:
        while not self._stop.is_set():
            idle = True
            while True:  # every pending command, then one step
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    break
                cmd()
            if self.engine.has_unfinished():
                try:
                    outs = self.engine.step()
                except Exception as e:  # noqa: BLE001 - a broken step fails its requests, not the worker
                    log.exception("engine step failed")
                    for rid in list(self.engine.scheduler.requests):
                        self.engine.abort(rid)
                    self._loop.call_soon_threadsafe(self._fail_all, e)
                    continue
                if outs:
                    idle = False
                    self._loop.call_soon_threadsafe(self._dispatch, outs)
                elif self.engine.scheduler.num_running or self.engine.scheduler.num_waiting:
                    idle = False  # a prefill chunk ran without sampling
            self._publish_cache_events()
            if idle:
                try:  # sleep until a command arrives (requests waiting for remote KV need one)
                    cmd = self._cmds.get(timeout=0.02)
                    cmd()
                except queue.Empty:
                    pass

    def _publish_cache_events(self) -> None:
        """Batched per step, handed to the loop: nothing of it on the step's path."""
        events = self.engine.kv.take_events()
        if events and self.on_cache_events is not None:
            self._loop.call_soon_threadsafe(self.on_cache_events, events)


def _set_result(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[Any], err: BaseException) -> None:
    if not fut.done():
        fut.set_exception(err)
