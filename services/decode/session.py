"""Decode.Session: many Generate streams over one call.  A frontend starts and
cancels requests on it; each request runs exactly as its own Generate call
would (the same refusals, errors, tracing and cleanup), and the outputs that
one engine step hands to its requests leave in one SessionResponse.

Per token, a Generate stream costs a gRPC message on each side, and on two
cores that CPU is taken from the kernels mid-step: at 32 streams a step's
tokens were 32 messages, here they are one (docs/ARCHITECTURE.md, "One call
per frontend and decode worker")."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from protos import pb
from services.decode.stats import DecodeStats

log = logging.getLogger(__name__)

GenerateFn = Callable[[pb.WorkerGenerateRequest, Any], AsyncIterator[pb.WorkerGenerateResponse]]


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class _RequestContext:
    """What Generate reads of its call's context, for one request of a session."""

    def __init__(self, metadata: dict[str, str]) -> None:
        self._metadata = tuple(metadata.items())

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise _Aborted(code, details)


class GenerateSession:
    """One Session call: a task per started request, one writer for the call."""

    def __init__(self, generate: GenerateFn, context: grpc.aio.ServicerContext,
                 stats: DecodeStats | None = None) -> None:
        self._generate = generate
        self._context = context
        self._stats = stats if stats is not None else DecodeStats()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._items: list[pb.SessionItem] = []
        self._ready = asyncio.Event()  # items are waiting, or the reader ended

    async def run(self, requests: AsyncIterator[pb.SessionRequest]) -> None:
        reader = asyncio.create_task(self._read(requests))
        try:
            while True:
                await self._ready.wait()
                self._ready.clear()
                if self._items:
                    # Every request the same engine step woke has queued its
                    # output by now: their wakeups ran before this one.
                    items, self._items = self._items, []
                    self._stats.session_messages += 1
                    await self._context.write(pb.SessionResponse(items=items))
                if reader.done() and not self._tasks and not self._items:
                    reader.result()  # a broken request stream ends the call with its error
                    return
        finally:
            reader.cancel()
            tasks = [reader, *self._tasks.values()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _read(self, requests: AsyncIterator[pb.SessionRequest]) -> None:
        try:
            async for req in requests:
                if req.HasField("start"):
                    self._start(req.start)
                elif req.HasField("cancel"):
                    task = self._tasks.get(req.cancel)
                    if task is not None:
                        task.cancel()
        finally:
            self._ready.set()  # the writer returns once the started requests are done

    def _start(self, start: pb.SessionStart) -> None:
        request_id = start.request.request_id
        if not request_id or request_id in self._tasks:
            why = ("request_id: required on a session" if not request_id
                   else f"request_id: {request_id!r} is already running on this session")
            self._put(pb.SessionItem(request_id=request_id, end=True,
                                     code=grpc.StatusCode.INVALID_ARGUMENT.value[0], details=why))
            return
        self._stats.session_requests += 1
        self._tasks[request_id] = asyncio.create_task(self._serve(request_id, start))

    async def _serve(self, request_id: str, start: pb.SessionStart) -> None:
        end = pb.SessionItem(request_id=request_id, end=True)
        try:
            async for msg in self._generate(start.request, _RequestContext(dict(start.metadata))):
                self._stats.session_outputs += 1
                self._put(pb.SessionItem(request_id=request_id, response=msg))
        except _Aborted as e:
            end.code, end.details = e.code.value[0], e.details
        except asyncio.CancelledError:
            return  # the frontend cancelled it (or the call ended): nobody to tell
        except Exception as e:  # noqa: BLE001 - one request's failure, as its own call's would be
            log.exception("session request %s failed", request_id)
            end.code, end.details = grpc.StatusCode.INTERNAL.value[0], f"worker: {e!r}"
        finally:
            self._tasks.pop(request_id, None)
            self._ready.set()
        self._put(end)

    def _put(self, item: pb.SessionItem) -> None:
        self._items.append(item)
        self._ready.set()
