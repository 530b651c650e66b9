"""Decode worker: continuous batching over the paged cache; prompts are
prefilled by a prefill worker whose KV lands straight in blocks reserved here
first (docs/ARCHITECTURE.md, invariants 2 and 3; remote_prefill.py), or locally when short."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator

import grpc

from engine.outputs import StepOutput
from kvtransfer.transport import KVTransport
from protos import pb, pb_grpc
from services.cluster_auth import aio_channel
from services.convert import logprobs_to_proto, lora_from_proto, prompt_logprobs_to_proto
from services.decode.remote_prefill import RemotePrefill, RemotePrefillFailed, ReserveTimeout
from services.decode.session import GenerateSession
from services.decode.stats import DecodeStats
from services.peers import KnownPeers
from services.worker import WorkerRPCs, WorkerState, abort_with, request_sampling
from services.worker_tracing import DecodeTrace

log = logging.getLogger(__name__)

__all__ = ["DecodeServicer", "DecodeStats"]


class DecodeServicer(WorkerRPCs, pb_grpc.DecodeServicer):
    def __init__(self, state: WorkerState, transport: KVTransport, *, local_prefill_threshold: int,
                 failure_policy: str, transfer_timeout: float, reserve_timeout: float = 60.0,
                 prefills: KnownPeers | None = None, cluster_token: str | None = None) -> None:
        self.state = state
        self.prefills = prefills if prefills is not None else KnownPeers("prefill")
        self.cluster_token = cluster_token
        self.transport = transport
        self.threshold = local_prefill_threshold
        self.stats = DecodeStats()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.remote_prefill = RemotePrefill(state, transport, self.stats, self._prefill_stub,
                                            failure_policy=failure_policy, transfer_timeout=transfer_timeout,
                                            reserve_timeout=reserve_timeout)

    def _prefill_stub(self, address: str) -> pb_grpc.PrefillStub:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = aio_channel(address, self.cluster_token)
        return pb_grpc.PrefillStub(ch)

    async def Generate(self, request: pb.WorkerGenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.WorkerGenerateResponse]:
        if self.state.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker: draining (shutting down); use another")
        request_id = request.request_id or uuid.uuid4().hex
        loop = self.state.engine
        try:
            params = await request_sampling(self.state, request.sampling)
            lora, lora_digest = lora_from_proto(request.lora if request.HasField("lora") else None)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        ids = list(request.prompt_token_ids)
        remote = bool(request.prefill_address) and len(ids) >= self.threshold
        if remote and not await self.prefills.knows(request.prefill_address):
            self.stats.unknown_prefill_refusals += 1
            log.warning("refused Generate %s: prefill_address %r is not a known prefill worker",
                        request_id, request.prefill_address)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"prefill_address: {request.prefill_address!r} is not a prefill worker this "
                                "decode worker knows (its --prefill flag or Redis registrations)")
        # Opened only once refusals are behind: the `finally` below closes it, and a
        # stream left open counts as in flight forever (a SIGTERM drain waits for it).
        q = loop.open_stream(request_id)
        finished = False
        timings: dict[str, float] = {}
        clock = self.state.metrics.clock(len(ids)) if self.state.metrics is not None else None
        trace = None
        if self.state.tracing.enabled:
            trace = DecodeTrace(self.state.tracing, context.invocation_metadata(),
                                worker_id=self.state.worker_id, request_id=request_id, params=params,
                                num_prompt_tokens=len(ids), remote=remote,
                                max_batched_tokens=loop.engine.config.scheduler.max_num_batched_tokens)
        try:
            try:
                if remote:  # the first token reaches q from the engine thread, ahead of the second
                    await self.remote_prefill.run(request_id, ids, params, request, timings, trace,
                                                  (lora, lora_digest))
                else:
                    self.stats.local_prefills += 1
                    await loop.call(lambda e: e.add_request(
                        request_id, ids, params, priority=request.priority,
                        cache_salt=request.cache_salt or None,
                        num_resumed_tokens=request.resumed_output_tokens, lora=lora,
                        lora_digest=lora_digest))
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except ReserveTimeout as e:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            except RemotePrefillFailed as e:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
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
            loop.close_stream(request_id)
            if not finished:  # client went away, deadline, or error: free everything
                await self.transport.cancel(request_id)
                await loop.call(lambda e: e.abort(request_id))

    async def Session(self, request_iterator: AsyncIterator[pb.SessionRequest],
                      context: grpc.aio.ServicerContext) -> None:
        """Many Generate streams over one call (services/decode/session.py)."""
        await GenerateSession(self.Generate, context, self.stats).run(request_iterator)

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

    async def before_free(self, request_id: str) -> None:
        """Abort: no byte of the request's KV transfer lands once this returns (invariant 3)."""
        await self.transport.cancel(request_id)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
