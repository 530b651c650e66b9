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
from typing import TYPE_CHECKING

import grpc

from engine.vocab.sampling_params import SamplingParams
from protos import pb
from services.convert import sampling_to_proto
from services.frontend import errors
from services.frontend.loras import LoRAEntry
from services.frontend.metrics import Metrics
from services.frontend.prepare import Plan
from services.frontend.results import Event
from services.frontend.router import Route, Router, RouteRequest
from services.frontend.worker_pool import Worker, WorkerPool
from services.frontend.worker_session import WorkerStream
from services.tracing import now_ns

if TYPE_CHECKING:
    from services.frontend.request_trace import RequestTrace

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
    resumed_tokens: int = 0  # the prompt's last tokens are this choice's output so far (a migration)
    lora: LoRAEntry | None = None

    def to_proto(self, prefill_address: str) -> pb.WorkerGenerateRequest:
        return pb.WorkerGenerateRequest(
            request_id=self.request_id, prompt_token_ids=self.prompt_token_ids,
            sampling=sampling_to_proto(self.params), priority=self.priority,
            cache_salt=self.cache_salt, prefill_address=prefill_address,
            resumed_output_tokens=self.resumed_tokens, lora=self.lora.to_proto() if self.lora else None)


def plan_jobs(plan: Plan) -> list[Job]:
    """n choices per prompt; with a seed, choice i samples with seed + i (as the offline LLM does)."""
    jobs = []
    for p, prompt in enumerate(plan.prompts):
        n, seed = prompt.params.n, prompt.params.seed
        for i in range(n):
            index = p * n + i
            # A prompt's choices share its prompt logprobs: the first computes them.
            params = dataclasses.replace(prompt.params, n=1, seed=None if seed is None else seed + i,
                                         prompt_logprobs=prompt.params.prompt_logprobs if i == 0 else None)
            jobs.append(Job(index, p, prompt.token_ids, params, f"{plan.request_id}-{index}",
                            plan.priority, plan.cache_salt, lora=plan.lora))
    return jobs


def resume(job: Job, relayed: list[int], migration: int) -> Job | None:
    """The rest of `job` after `relayed` tokens went out: those tokens join the
    prompt (the prefix cache makes re-prefilling them cheap) and the token
    budget shrinks by as many.  None when nothing is left to generate.

    The new worker treats the relayed tokens as output (resumed_tokens): a
    grammar resumes after them, penalties count them as output, and a seeded
    RNG moves on one draw per token, so greedy and seeded output continue
    exactly as undisturbed (seeded with speculation: a valid sample, not the
    same one, since rejected drafts drew extra)."""
    p = job.params
    n = len(relayed)
    if p.max_tokens is not None and p.max_tokens - n < 1:
        return None
    # The client has the prompt logprobs already (they came with the first token).
    params = dataclasses.replace(p, max_tokens=None if p.max_tokens is None else p.max_tokens - n,
                                 min_tokens=max(0, p.min_tokens - n), prompt_logprobs=None)
    return dataclasses.replace(job, prompt_token_ids=[*job.prompt_token_ids, *relayed], params=params,
                               request_id=f"{job.request_id}-m{migration}", resumed_tokens=n)


class _WorkerFailed(Exception):
    def __init__(self, error: errors.APIError, retryable: bool) -> None:
        super().__init__(error.message)
        self.error = error
        self.retryable = retryable


class Dispatcher:
    def __init__(self, pool: WorkerPool, router: Router, metrics: Metrics, max_migrations: int = 1) -> None:
        self.pool = pool
        self.router = router
        self.metrics = metrics
        self.max_migrations = max_migrations

    def check_available(self) -> None:
        if not self.pool.healthy("decode"):
            raise errors.no_worker()

    def stream(self, plan: Plan, trace: RequestTrace | None = None) -> FanOut:
        return FanOut([(job.index, self.call(job, trace)) for job in plan_jobs(plan)])

    async def call(self, job: Job,
                   trace: RequestTrace | None = None) -> AsyncIterator[pb.WorkerGenerateResponse]:
        """Relay one choice's worker stream.  A decode worker that fails before
        the first token: try once more on another.  One that dies or stops
        answering mid-stream: resume there with the prompt plus the tokens
        already relayed (at most `max_migrations` times), so the client's
        stream goes on with no token lost or repeated.  A stream resumes only
        on a worker with the same weights (model_key): during a rolling update
        no stream carries tokens of two versions; none left: the error."""
        tried: list[str] = []
        relayed: list[int] = []  # this choice's tokens the client has
        attempts = migrations = 0
        current = job
        model_key: str | None = None  # the weights the relayed tokens came from
        while True:
            attempts += 1
            decode, prefill, prefill_tokens = self._route(current, exclude=tried, trace=trace,
                                                          attempt=attempts, model_key=model_key)
            tried.append(decode.address)
            try:
                async for msg in self._call_worker(decode, prefill, current, trace, prefill_tokens):
                    if current is not job:  # usage speaks of the client's prompt, not the resumed one
                        msg.prompt_tokens = len(job.prompt_token_ids)
                    relayed.extend(msg.token_ids)
                    yield msg
                return
            except _WorkerFailed as e:
                self.metrics.worker_failures.labels(decode.worker_id, e.error.code or "error").inc()
                if trace is not None:
                    trace.worker_failed(decode, e.error.code or "error", e.error.message)
                if relayed:
                    model_key = decode.model_key
                if not e.retryable or not self.pool.healthy("decode", exclude=tried, model_key=model_key):
                    raise e.error from None
                if not relayed:
                    if attempts >= MAX_ATTEMPTS:
                        raise e.error from None
                    log.warning("request %s: decode worker %s failed before its first token (%s); "
                                "retrying on another", job.request_id, decode.worker_id, e.error.message)
                    self.metrics.worker_retries.labels(e.error.code or "error").inc()
                    # A new worker request id: the failed attempt may still be winding down
                    # on its prefill worker, which would refuse the same id.
                    current = dataclasses.replace(current, request_id=f"{job.request_id}-r{attempts}")
                    continue
                if migrations >= self.max_migrations:
                    raise e.error from None
                migrations += 1
                resumed = resume(job, relayed, migrations)
                if resumed is None:  # every token was out: only the finish was lost
                    yield pb.WorkerGenerateResponse(finish_reason="length",
                                                    prompt_tokens=len(job.prompt_token_ids))
                    return
                log.warning("request %s: decode worker %s failed after %d tokens (%s); resuming on another",
                            job.request_id, decode.worker_id, len(relayed), e.error.message)
                self.metrics.requests_migrated.inc()
                current = resumed

    def _route(self, job: Job, exclude: list[str], trace: RequestTrace | None = None,
               attempt: int = 1, model_key: str | None = None) -> tuple[Worker, Worker | None, int]:
        """(decode worker, prefill worker or None, prompt tokens the prefill worker will compute).
        model_key: only decode workers with these weights (a migrating stream's)."""
        start_ns = now_ns() if trace is not None else 0
        decodes = self.pool.healthy("decode", exclude=exclude, model_key=model_key)
        prefills = self.pool.healthy("prefill")
        request = RouteRequest(job.request_id, job.prompt_token_ids, job.cache_salt,
                               job.lora.digest if job.lora else "", job.params.prompt_logprobs is None)
        route = self.router.route(request, [w.snapshot() for w in decodes], [w.snapshot() for w in prefills])
        if route is None:
            if trace is not None:
                trace.route(start_ns, attempt, None, None, len(job.prompt_token_ids))
            raise errors.no_worker()
        decode = self.pool.decodes[route.decode]
        prefill = self.pool.prefills.get(route.prefill) if route.prefill else None
        if prefill is not None and prefill.model_key != decode.model_key:
            # Mid-rollout: the pair would refuse each other's KV (layout check).
            # Route again among the decode's own version (none: it prefills itself).
            same = [w.snapshot() for w in prefills if w.model_key == decode.model_key]
            route = self.router.route(request, [decode.snapshot()], same) or Route(decode.address)
            prefill = self.pool.prefills.get(route.prefill) if route.prefill else None
        for w in (decode, prefill):
            if w is not None:
                w.routed += 1
        if trace is not None:
            trace.route(start_ns, attempt, decode, prefill, len(job.prompt_token_ids))
        expected = len(job.prompt_token_ids) if route.prefill_tokens is None else route.prefill_tokens
        return decode, prefill, expected

    async def _call_worker(self, decode: Worker, prefill: Worker | None, job: Job,
                           trace: RequestTrace | None = None,
                           prefill_tokens: int = 0) -> AsyncIterator[pb.WorkerGenerateResponse]:
        """prefill_tokens: what the prefill worker is expected to compute (its
        queue as the router sees it, until the first token comes back)."""
        request = job.to_proto(prefill.address if prefill else "")  # before any counter goes up
        decode.inflight += 1
        if prefill is not None:
            prefill.inflight += 1
            prefill.inflight_prompt_tokens += prefill_tokens
        call = decode.streams.open(request, trace.metadata() if trace is not None else None)
        finished = False
        try:
            async for msg in _watched(call, decode):
                if prefill is not None:  # the prompt is done once anything comes back
                    prefill.inflight -= 1
                    prefill.inflight_prompt_tokens -= prefill_tokens
                    prefill = None
                if msg.finish_reason in ("error", "abort"):  # its tokens are not relayed
                    raise _WorkerFailed(errors.APIError(
                        503, f"worker: the request ended with {msg.finish_reason} on {decode.worker_id}",
                        None, msg.finish_reason), retryable=True)
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
                prefill.inflight -= 1
                prefill.inflight_prompt_tokens -= prefill_tokens


_WATCH_S = 1.0  # how often a quiet stream checks that its worker still reports


async def _watched(call: WorkerStream, decode: Worker) -> AsyncIterator[pb.WorkerGenerateResponse]:
    """The call's messages; if its worker stops answering (no message, and its
    load reports have stopped too), fail the call instead of waiting forever.
    A long prefill is quiet too, but its worker keeps reporting.  A watchdog
    beside the stream checks once a _WATCH_S: a timed wait around every read
    cost a task and a timer per token (40 us of the frontend's CPU each on
    a Zen 3)."""
    loop = asyncio.get_running_loop()
    last = loop.time()  # of the last message
    silenced = False  # the watchdog cancelled the call

    async def watch() -> None:
        nonlocal silenced
        while True:
            await asyncio.sleep(_WATCH_S)
            if loop.time() - last >= _WATCH_S and not decode.alive:
                silenced = True
                call.cancel()
                return

    watchdog = asyncio.create_task(watch())
    try:
        while True:
            try:
                msg = await call.read()
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if silenced and (task is None or not task.cancelling()):  # the watchdog's, not our caller's
                    raise _WorkerFailed(errors.APIError(
                        503, f"worker: {decode.worker_id} stopped answering mid-stream", None,
                        "worker_unresponsive"), retryable=True) from None
                raise
            if msg is grpc.aio.EOF:
                return
            last = loop.time()
            yield msg
    finally:
        watchdog.cancel()


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
