"""Decode worker: continuous batching over the paged cache; prompts are
prefilled by a prefill worker whose KV lands straight in blocks reserved here
first (DESIGN.md invariants 2 and 3), or locally when short."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from engine.outputs import StepOutput
from engine.sampler import SampledToken
from engine.sampling_params import SamplingParams
from kvtransfer.wire import new_transfer_token
from protos import pb, pb_grpc
from services.cluster_auth import aio_channel
from services.convert import (
    logprobs_from_proto,
    logprobs_to_proto,
    prompt_logprobs_to_proto,
    sampling_from_proto,
)
from services.peers import KnownPeers
from services.tracing import now_ns
from services.worker import WorkerRPCs, WorkerState, abort_with, layout_proto
from services.worker_tracing import DecodeTrace

log = logging.getLogger(__name__)


@dataclass
class DecodeStats:
    remote_prefills: int = 0
    local_prefills: int = 0
    kv_transfer_failures: int = 0
    kv_transfer_recomputes: int = 0
    kv_bytes_received: int = 0
    waits_for_blocks: int = 0
    unknown_prefill_refusals: int = 0  # Generate named a prefill worker this worker does not know
    kv_transfer_seconds: float = 0.0  # total, from asking the prefill worker to the blocks landing


class DecodeServicer(WorkerRPCs, pb_grpc.DecodeServicer):
    def __init__(self, state: WorkerState, transport, *, local_prefill_threshold: int,  # type: ignore[no-untyped-def]
                 failure_policy: str, transfer_timeout: float, reserve_timeout: float = 60.0,
                 prefills: KnownPeers | None = None, cluster_token: str | None = None) -> None:
        self.state = state
        self.prefills = prefills if prefills is not None else KnownPeers("prefill")
        self.cluster_token = cluster_token
        self.transport = transport
        self.threshold = local_prefill_threshold
        self.failure_policy = failure_policy
        self.transfer_timeout = transfer_timeout
        self.reserve_timeout = reserve_timeout
        self.stats = DecodeStats()
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _prefill_stub(self, address: str) -> pb_grpc.PrefillStub:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = aio_channel(address, self.cluster_token)
        return pb_grpc.PrefillStub(ch)

    async def Generate(self, request: pb.WorkerGenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.WorkerGenerateResponse]:
        if self.state.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker: draining (shutting down); use another")
        rid = request.request_id or uuid.uuid4().hex
        loop = self.state.engine
        try:
            params = sampling_from_proto(request.sampling)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        ids = list(request.prompt_token_ids)
        resumed = request.resumed_output_tokens
        if params.guided is not None:  # compile (or find cached) here, not on the engine thread
            try:
                await asyncio.to_thread(loop.engine.grammars.compile, params.guided)
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        q = loop.open_stream(rid)
        finished = False
        remote = bool(request.prefill_address) and len(ids) >= self.threshold
        if remote and not await self.prefills.knows(request.prefill_address):
            self.stats.unknown_prefill_refusals += 1
            log.warning("refused Generate %s: prefill_address %r is not a known prefill worker",
                        rid, request.prefill_address)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"prefill_address: {request.prefill_address!r} is not a prefill worker this "
                                "decode worker knows (its --prefill flag or Redis registrations)")
        timings: dict[str, float] = {}
        clock = self.state.metrics.clock(len(ids)) if self.state.metrics is not None else None
        trace = None
        if self.state.tracing.enabled:
            trace = DecodeTrace(self.state.tracing, context.invocation_metadata(),
                                worker_id=self.state.worker_id, request_id=rid, params=params,
                                num_prompt_tokens=len(ids), remote=remote,
                                max_batched_tokens=loop.engine.config.scheduler.max_num_batched_tokens)
        try:
            try:
                if remote:  # the first token reaches q from the engine thread, ahead of the second
                    await self._remote_prefill(rid, ids, params, request, context, timings, trace)
                else:
                    self.stats.local_prefills += 1
                    await loop.call(lambda e: e.add_request(rid, ids, params, priority=request.priority,
                                                            cache_salt=request.cache_salt or None,
                                                            num_resumed_tokens=resumed))
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            while True:
                out = await q.get()
                if isinstance(out, BaseException):
                    await abort_with(context, out)
                    return
                if trace is not None:
                    trace.token(out)
                if clock is not None:
                    clock.output(out)
                    if out.finished:
                        clock.finish(out.finish_reason or "stop")
                yield self._response(out, remote, timings, ids)
                timings = {}
                if out.finished:
                    finished = True
                    return
        finally:
            if clock is not None:
                clock.finish("abort")  # no-op when it finished
            if trace is not None:
                trace.end(None if finished else "ended before finishing (cancelled, deadline or error)")
            loop.close_stream(rid)
            if not finished:  # client went away, deadline, or error: free everything
                await self.transport.cancel(rid)
                await loop.call(lambda e: e.abort(rid))

    def _response(self, out: StepOutput, remote: bool, timings: dict[str, float],
                  prompt_ids: list[int]) -> pb.WorkerGenerateResponse:
        logprobs = [logprobs_to_proto(t, pos) for t, pos in
                    zip(out.new_token_ids, out.new_logprobs or [], strict=False)]
        return pb.WorkerGenerateResponse(
            token_ids=out.new_token_ids, text=out.new_text, logprobs=logprobs,
            finish_reason=out.finish_reason or "",
            stop_reason="" if out.stop_reason is None else str(out.stop_reason),
            prompt_tokens=out.num_prompt_tokens, cached_tokens=out.num_cached_tokens,
            remote_prefill=remote, timings=timings,
            prompt_logprobs=prompt_logprobs_to_proto(prompt_ids, out.prompt_logprobs or []))

    async def _reserve(self, rid: str, ids: list[int], params: SamplingParams,
                       request: pb.WorkerGenerateRequest) -> tuple[list[int], int]:
        """Blocks first, KV second: wait (bounded) until the pool has room."""
        deadline = time.monotonic() + self.reserve_timeout
        loop = self.state.engine
        while True:
            def reserve(e):  # type: ignore[no-untyped-def]
                req = e.reserve_remote(rid, ids, params, priority=request.priority,
                                       cache_salt=request.cache_salt or None,
                                       num_resumed_tokens=request.resumed_output_tokens)
                return None if req is None else (e.kv.block_ids(rid), req.num_computed_tokens)
            got = await loop.call(reserve)
            if got is not None:
                return got
            self.stats.waits_for_blocks += 1
            if time.monotonic() > deadline:
                raise TimeoutError("no KV blocks free for the prompt")
            await asyncio.sleep(0.02)

    async def _remote_prefill(self, rid: str, ids: list[int], params: SamplingParams,
                              request: pb.WorkerGenerateRequest, context: grpc.aio.ServicerContext,
                              timings: dict[str, float],
                              trace: DecodeTrace | None = None) -> None:
        t_start = time.monotonic()
        queued_ns = now_ns() if trace is not None else 0
        try:
            block_ids, num_local = await self._reserve(rid, ids, params, request)
        except TimeoutError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        loop = self.state.engine
        first_block = num_local // loop.engine.kv.block_size
        token = new_transfer_token()  # only the prefill worker we ask learns it
        landed = self.transport.expect(rid, block_ids[first_block:], token=token)
        t0 = time.monotonic()
        timings["reserve"] = t0 - t_start
        if trace is not None:
            trace.queued(queued_ns, len(block_ids) - first_block)
        try:
            resp = await self._prefill_stub(request.prefill_address).Prefill(
                pb.PrefillRequest(request_id=rid, prompt_token_ids=ids, sampling=request.sampling,
                                  priority=request.priority, cache_salt=request.cache_salt,
                                  kv_address=self.transport.address, dst_block_ids=block_ids,
                                  first_block=first_block, layout=layout_proto(loop.engine),
                                  kv_token=token, resumed_output_tokens=request.resumed_output_tokens),
                timeout=self.transfer_timeout, metadata=trace.metadata() if trace is not None else None)
            await asyncio.wait_for(landed, timeout=self.transfer_timeout)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, ConnectionError, OSError, RuntimeError) as e:
            await self.transport.cancel(rid)  # after this, nothing more is written to the blocks
            self.stats.kv_transfer_failures += 1
            log.warning("remote prefill of %s via %s failed: %s", rid, request.prefill_address, e)
            if trace is not None:
                trace.kv_failed(str(e), recompute=self.failure_policy != "fail")
            if self.failure_policy == "fail":
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"remote prefill failed: {e}")
            self.stats.kv_transfer_recomputes += 1
            # Aborted meanwhile (Abort RPC): the request is gone and its stream holds the error.
            await loop.call(lambda eng: eng.remote_kv_failed(rid) if rid in eng.scheduler.requests else None)
            return
        self.stats.remote_prefills += 1
        self.stats.kv_bytes_received += resp.bytes_sent
        self.stats.kv_transfer_seconds += time.monotonic() - t0
        if self.state.metrics is not None:
            self.state.metrics.kv_transfer_seconds.observe(resp.transfer_seconds)
        ft = resp.first_token
        first = SampledToken(ft.token_id, ft.logprob, ft.rank, {t.token_id: t.logprob for t in ft.top})
        t_landed = time.monotonic()
        prompt_lps = [logprobs_from_proto(m) for m in resp.prompt_logprobs] if resp.prompt_logprobs else None
        await loop.call(lambda eng: loop.emit([eng.remote_kv_landed(rid, first, prompt_lps)])
                        if rid in eng.scheduler.requests else None)  # else aborted meanwhile
        timings.update(prefill=resp.prefill_seconds, transfer=resp.transfer_seconds,
                       rpc_and_wait=t_landed - t0, admit=time.monotonic() - t_landed)

    async def before_free(self, request_id: str) -> None:
        """Abort: no byte of the request's KV transfer lands once this returns (invariant 3)."""
        await self.transport.cancel(request_id)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
