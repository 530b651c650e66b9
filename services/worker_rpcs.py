"""Info, WatchLoad and Abort: the RPCs both roles answer the same way; a request's
sampling params with its grammar compiled; the mapping of a stream's error to
the status a caller acts on."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from engine.vocab.cache_events import CacheEvent
from engine.vocab.sampling_params import SamplingParams
from protos import pb
from services.cache_event_log import cache_events_proto
from services.convert import sampling_from_proto
from services.engine_loop import EngineDead
from services.worker_state import WorkerState


class WorkerRPCs:
    """Mixed into each role's servicer."""

    state: WorkerState

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.WorkerInfo:
        return self.state.info()

    async def WatchLoad(self, request: pb.LoadRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[pb.LoadReport]:
        interval = min(max(request.interval_seconds or 0.5, 0.05), 10.0)
        log_ = self.state.cache_events
        pending: list[CacheEvent] | None = None
        cursor = 0
        while True:
            if pending is None:  # first report, or fell behind: a snapshot
                hashes = await self.state.engine.call(lambda e: e.kv.pool.cached_hashes())
                cursor = log_.end  # events logged after this are newer than the snapshot
                pending = [CacheEvent("cleared"), CacheEvent("stored", hashes)]
            report = self.state.load()
            report.cache_events.extend(cache_events_proto(pending))
            yield report
            await asyncio.sleep(interval)
            pending = log_.since(cursor)
            cursor = log_.end

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        request_id = request.request_id
        await self.before_free(request_id)  # its KV transfer first: no write may land in freed blocks
        found = await self.state.engine.call(lambda e: e.abort(request_id))
        self.state.engine.fail_stream(request_id, RequestAborted(f"request {request_id!r} was aborted"))
        return pb.AbortResponse(found=found)

    async def before_free(self, request_id: str) -> None:
        """Stop the request's KV transfer, if any, before its blocks are freed."""

    async def close(self) -> None:
        pass


async def request_sampling(state: WorkerState, msg: pb.SamplingParams) -> SamplingParams:
    """A Generate or Prefill request's sampling params, with their grammar (if any)
    compiled, or found cached, here on the event loop's worker thread and not on the
    engine thread, which then never waits for xgrammar.  ValueError naming the field."""
    params = sampling_from_proto(msg)
    if params.guided is not None:
        await asyncio.to_thread(state.engine.engine.grammars.compile, params.guided)
    return params


class RequestAborted(Exception):
    """An Abort RPC ended the request; its stream answers CANCELLED."""


async def abort_with(context: grpc.aio.ServicerContext, err: BaseException) -> None:
    """End an RPC whose stream got `err` instead of an output, with the status that says
    what a caller may do: UNAVAILABLE (engine dead: retry elsewhere), CANCELLED, INTERNAL."""
    if isinstance(err, EngineDead):
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker: {err}; use another")
    if isinstance(err, RequestAborted):
        await context.abort(grpc.StatusCode.CANCELLED, str(err))
    await context.abort(grpc.StatusCode.INTERNAL, f"engine failed: {err}")
