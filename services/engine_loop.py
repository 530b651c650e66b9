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
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from engine.llm_engine import LLMEngine
from engine.outputs import StepOutput
from engine.request import RequestStatus
from engine.vocab.cache_events import CacheEvent
from services.fault_hooks import FaultHooks
from services.sched_policy import name_this_thread

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
                 faults: FaultHooks | None = None) -> None:
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
        self._faults = faults or FaultHooks()  # tests only (services/fault_hooks.py)
        # The pool's free blocks as of the thread's last report, read on the loop;
        # `_free_changed` is set (and replaced) with each new report.
        self.num_free_blocks = engine.kv.num_free_blocks
        self._free_reported = self.num_free_blocks  # the thread's side of the same number
        self._free_changed = asyncio.Event()

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
        name_this_thread("ss-engine")  # beside the kernels' "ss-kernel" threads
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
        self._free_changed.set()  # a reservation waiting for blocks learns it at once
        self._fail_all(EngineDead(f"engine thread died: {err!r}"))
        if self.on_death is not None:
            self.on_death(err)

    async def wait_free_blocks(self, more_than: int, timeout: float) -> bool:
        """On the loop: until the pool has more than `more_than` free blocks (as the
        engine thread last reported; it reports each change once per iteration),
        or `timeout` seconds passed (-> False).  A dead engine returns at once (True: the
        caller's next `call` raises EngineDead)."""
        deadline = self._loop.time() + timeout
        while self.num_free_blocks <= more_than and self.dead is None:
            remaining = deadline - self._loop.time()
            if remaining <= 0:
                return False
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._free_changed.wait(), remaining)
        return True

    def _report_free_blocks(self) -> None:
        """On the engine thread, after each iteration: hand a changed free-block count to the loop."""
        free = self.engine.kv.num_free_blocks
        if free != self._free_reported:
            self._free_reported = free
            self._loop.call_soon_threadsafe(self._free_blocks_now, free)

    def _free_blocks_now(self, free: int) -> None:
        self.num_free_blocks = free
        changed, self._free_changed = self._free_changed, asyncio.Event()
        changed.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            idle = True
            while True:  # every pending command, then one step
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    break
                cmd.run()
            if self._faults.engine_iteration is not None:
                self._faults.engine_iteration()  # raising here kills the thread, as an engine bug would
            if self.engine.has_unfinished():
                try:
                    if self._faults.before_step is not None:
                        self._faults.before_step()
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
            self._report_free_blocks()
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
        for request_id, req in list(self.engine.scheduler.requests.items()):
            if req.status != RequestStatus.WAITING_FOR_REMOTE_KV:
                self.engine.abort(request_id)

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
