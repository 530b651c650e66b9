"""Send a planned request to the workers: one worker call per choice, routed,
retried once on another decode worker when it fails before any token, merged
into one stream of events in arrival order.  Cancelling the merged stream (the
client went away) cancels every worker call, which aborts the request there."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from engine.sampling_params import SamplingParams
from protos import pb
from services.convert import sampling_to_proto
from services.frontend import errors
from services.frontend.metrics import Metrics
from services.frontend.prepare import Plan
from services.frontend.router import Router, RouteRequest
from services.frontend.workers import Worker, WorkerPool

log = logging.getLogger("splitserve.frontend.dispatch")
MAX_ATTEMPTS = 2  # the first decode worker, then one other


@dataclass(frozen=True)
class Job:
    """One choice: one worker request."""

    index: int  # the choice's index in the response (prompt_index * n + i)
    prompt_index: int
    prompt_token_ids: list[int]
    params: SamplingParams  # n == 1
    request_id: str
    priority: int
    cache_salt: str

    def to_proto(self, prefill_address: str) -> pb.WorkerGenerateRequest:
        return pb.WorkerGenerateRequest(
            request_id=self.request_id, prompt_token_ids=self.prompt_token_ids,
            sampling=sampling_to_proto(self.params), priority=self.priority,
            cache_salt=self.cache_salt, prefill_address=prefill_address)


@dataclass(frozen=True)
class Event:
    index: int
    msg: pb.WorkerGenerateResponse


def plan_jobs(plan: Plan) -> list[Job]:
    """n choices per prompt; with a seed, choice i samples with seed + i (as the offline LLM does)."""
    jobs = []
    for p, prompt in enumerate(plan.prompts):
        n, seed = prompt.params.n, prompt.params.seed
        for i in range(n):
            index = p * n + i
            params = dataclasses.replace(prompt.params, n=1, seed=None if seed is None else seed + i)
            jobs.append(Job(index, p, prompt.token_ids, params, f"{plan.request_id}-{index}",
                            plan.priority, plan.cache_salt))
    return jobs


class _WorkerFailed(Exception):
    def __init__(self, error: errors.APIError, retryable: bool) -> None:
        super().__init__(error.message)
        self.error = error
        self.retryable = retryable


class Dispatcher:
    def __init__(self, pool: WorkerPool, router: Router, metrics: Metrics) -> None:
        self.pool = pool
        self.router = router
        self.metrics = metrics

    def check_available(self) -> None:
        if not self.pool.healthy("decode"):
            raise errors.no_worker()

    def stream(self, plan: Plan) -> FanOut:
        return FanOut([(job.index, self.call(job)) for job in plan_jobs(plan)])

    async def call(self, job: Job) -> AsyncIterator[pb.WorkerGenerateResponse]:
        """Relay one choice's worker stream; on a failure before its first token,
        try once more on another decode worker."""
        tried: list[str] = []
        for attempt in range(MAX_ATTEMPTS):
            decode, prefill = self._route(job, exclude=tried)
            tried.append(decode.address)
            started = False
            try:
                async for msg in self._call_worker(decode, prefill, job):
                    started = True
                    yield msg
                return
            except _WorkerFailed as e:
                self.metrics.worker_failures.labels(decode.worker_id, e.error.code or "error").inc()
                others = self.pool.healthy("decode", exclude=tried)
                if started or not e.retryable or attempt + 1 == MAX_ATTEMPTS or not others:
                    raise e.error from None
                log.warning("request %s: decode worker %s failed before its first token (%s); "
                            "retrying on another", job.request_id, decode.worker_id, e.error.message)
                self.metrics.worker_retries.labels(e.error.code or "error").inc()

    def _route(self, job: Job, exclude: list[str]) -> tuple[Worker, Worker | None]:
        decodes = self.pool.healthy("decode", exclude=exclude)
        prefills = self.pool.healthy("prefill")
        route = self.router.route(RouteRequest(job.request_id, job.prompt_token_ids, job.cache_salt),
                                  [w.snapshot() for w in decodes], [w.snapshot() for w in prefills])
        if route is None:
            raise errors.no_worker()
        prefill = self.pool.prefills.get(route.prefill) if route.prefill else None
        decode = self.pool.decodes[route.decode]
        for w in (decode, prefill):
            if w is not None:
                w.routed += 1
        return decode, prefill

    async def _call_worker(self, decode: Worker, prefill: Worker | None,
                           job: Job) -> AsyncIterator[pb.WorkerGenerateResponse]:
        num_prompt = len(job.prompt_token_ids)
        decode.inflight += 1
        if prefill is not None:
            prefill.inflight_prompt_tokens += num_prompt
        call = decode.stub.Generate(job.to_proto(prefill.address if prefill else ""))
        finished = False
        try:
            async for msg in call:
                if prefill is not None:  # the prompt is done once anything comes back
                    prefill.inflight_prompt_tokens -= num_prompt
                    prefill = None
                if msg.finish_reason in ("error", "abort"):
                    raise _WorkerFailed(errors.APIError(
                        503, f"worker: the request ended with {msg.finish_reason} on {decode.worker_id}",
                        None, msg.finish_reason), retryable=not msg.token_ids)
                finished = bool(msg.finish_reason)
                yield msg
                if finished:
                    return
            raise _WorkerFailed(errors.APIError(
                503, f"worker: {decode.worker_id} closed the stream before the request finished",
                None, "stream_ended"), retryable=True)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                decode.mark_down()
            raise _WorkerFailed(errors.from_worker_error(e), errors.retryable(e)) from None
        finally:
            call.cancel()  # no-op when the call is done; else the worker aborts the request
            decode.inflight -= 1
            if prefill is not None:
                prefill.inflight_prompt_tokens -= num_prompt


_DONE = object()


class FanOut:
    """Several async streams merged in arrival order; the first error cancels the rest."""

    def __init__(self, streams: list[tuple[int, AsyncIterator[pb.WorkerGenerateResponse]]]) -> None:
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._remaining = len(streams)
        self._tasks = [asyncio.create_task(self._pump(i, s)) for i, s in streams]

    async def _pump(self, index: int, stream: AsyncIterator[pb.WorkerGenerateResponse]) -> None:
        try:
            async for msg in stream:
                self._queue.put_nowait(Event(index, msg))
            self._queue.put_nowait(_DONE)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # delivered to the consumer
            self._queue.put_nowait(e)

    def __aiter__(self) -> FanOut:
        return self

    async def __anext__(self) -> Event:
        while self._remaining:
            item = await self._queue.get()
            if item is _DONE:
                self._remaining -= 1
            elif isinstance(item, Exception):
                self.cancel()
                raise item
            else:
                assert isinstance(item, Event)
                return item
        raise StopAsyncIteration

    def cancel(self) -> None:
        for t in self._tasks:
            t.cancel()
        self._remaining = 0

    def fail(self, error: Exception) -> None:
        """Stop every stream; the consumer's next read raises `error`."""
        for t in self._tasks:
            t.cancel()
        self._queue.put_nowait(error)

    async def aclose(self) -> None:
        self.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
