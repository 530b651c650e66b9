"""Runs an LLMEngine in its own thread so the asyncio loop (gRPC, UCX) never
blocks on a forward pass.  Callers submit commands that run between steps and
read each request's outputs from an asyncio queue.

A step that raises fails the requests it ran (the worker serves on).  Anything
else that ends the thread (an error outside `step()`) is the thread's death:
every stream and every pending or later `call` gets the error at once (no
request hangs), and `on_death` runs on the loop (the worker reports
NOT_SERVING and exits non-zero)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from engine.llm_engine import LLMEngine
from engine.outputs import StepOutput
from engine.request import RequestStatus
from engine.vocab.cache_events import CacheEvent

log = logging.getLogger(__name__)
T = TypeVar("T")

StreamItem = StepOutput | BaseException


class EngineDead(RuntimeError):
    """The engine thread has died; this worker can serve nothing more."""


@dataclass(eq=False)
class _Command:
    run: Callable[[], None]
    fail: Callable[[BaseException], None]


class EngineLoop:
    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop,
                 crash_file: str | None = None, step_fail_file: str | None = None) -> None:
        self.engine = engine
        self._loop = loop
        self._cmds: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[StreamItem]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="engine", daemon=True)
        # Called on the asyncio loop with each batch of prefix-cache events.
        self.on_cache_events: Callable[[list[CacheEvent]], None] | None = None
        # Called on the asyncio loop once, if the thread dies of an error.
        self.on_death: Callable[[BaseException], None] | None = None
        self.dead: BaseException | None = None  # set on the loop when the thread died
        self._died: BaseException | None = None  # set by the thread itself, before it ends
        # Test-only fault hooks (hidden worker flags): while crash_file exists the
        # thread raises outside step(), as an engine bug would; when step_fail_file
        # exists the next step raises (once: the file is removed).
        self._crash_file = crash_file
        self._step_fail_file = step_fail_file

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._cmds.put(_Command(lambda: None, lambda e: None))
        self._thread.join(timeout=10)

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run fn(engine) on the engine thread between two steps.  Raises
        EngineDead when the thread has died (or dies before running it)."""
        fut: asyncio.Future[T] = self._loop.create_future()

        def run() -> None:
            try:
                result: Any = fn(self.engine)
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting caller
                self._loop.call_soon_threadsafe(_set_exception, fut, e)
            else:
                self._loop.call_soon_threadsafe(_set_result, fut, result)

        def fail(err: BaseException) -> None:
            self._loop.call_soon_threadsafe(_set_exception, fut, EngineDead(f"engine thread died: {err!r}"))

        if self._died is not None:
            raise EngineDead(f"engine thread died: {self._died!r}")
        self._cmds.put(_Command(run, fail))
        if self._died is not None:  # died between the check and the put: nobody will run it
            self._fail_commands(self._died)
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
        if self.dead is not None:
            q.put_nowait(EngineDead(f"engine thread died: {self.dead!r}"))
        self._streams[request_id] = q
        return q

    def has_stream(self, request_id: str) -> bool:
        return request_id in self._streams

    def fail_stream(self, request_id: str, err: BaseException) -> None:
        """On the loop: end one request's stream with `err` (an Abort RPC)."""
        q = self._streams.get(request_id)
        if q is not None:
            q.put_nowait(err)

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

    def _main(self) -> None:
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 - the thread's death is reported, never silent
            log.critical("engine thread died", exc_info=True)
            self._died = e
            self._fail_commands(e)
            with contextlib.suppress(RuntimeError):  # a closed loop: the process is ending anyway
                self._loop.call_soon_threadsafe(self._on_died, e)

    def _fail_commands(self, err: BaseException) -> None:
        while True:
            try:
                self._cmds.get_nowait().fail(err)
            except queue.Empty:
                return

    def _on_died(self, err: BaseException) -> None:
        self.dead = err
        self._fail_all(EngineDead(f"engine thread died: {err!r}"))
        if self.on_death is not None:
            self.on_death(err)

    def _check_fault(self) -> None:
        if self._crash_file is not None and os.path.exists(self._crash_file):
            raise RuntimeError(f"injected engine-thread fault ({self._crash_file} exists)")

    def _check_step_fault(self) -> None:
        if self._step_fail_file is not None and os.path.exists(self._step_fail_file):
            os.unlink(self._step_fail_file)
            raise RuntimeError(f"injected step failure ({self._step_fail_file})")

    def _run(self) -> None:
        while not self._stop.is_set():
            idle = True
            while True:  # every pending command, then one step
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    break
                cmd.run()
            self._check_fault()
            if self.engine.has_unfinished():
                try:
                    self._check_step_fault()
                    outs = self.engine.step()
                except Exception as e:  # noqa: BLE001 - a broken step fails its requests, not the worker
                    log.exception("engine step failed")
                    self._abort_after_failed_step()
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
                    cmd.run()
                except queue.Empty:
                    pass

    def _abort_after_failed_step(self) -> None:
        """Frees the requests a failed step may have broken, except those whose
        blocks a KV transfer may still be writing (invariant 3): their RPC gets the
        error, cancels the transfer, and only then aborts them."""
        for rid, req in list(self.engine.scheduler.requests.items()):
            if req.status != RequestStatus.WAITING_FOR_REMOTE_KV:
                self.engine.abort(rid)

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
