"""Prefill worker: computes prompts (batched into chunked prefill steps by the
engine), samples token 1 with the request's params and seed, sends every block
the decode worker lacks straight from the KV cache, then frees its hold."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace

import grpc

from kvtransfer.layout import LayoutMismatch
from kvtransfer.transport import KVTransport
from protos import pb, pb_grpc
from services.convert import logprobs_to_proto, prompt_logprobs_to_proto
from services.kv_layout import InvalidLayout, handoff_from_proto
from services.peers import KnownDecodeListeners, KnownPeers
from services.tracing import now_ns
from services.worker import WorkerRPCs, WorkerState, abort_with, request_sampling
from services.worker_tracing import PrefillTrace

log = logging.getLogger(__name__)


@dataclass
class PrefillStats:
    prefills: int = 0
    blocks_sent: int = 0
    bytes_sent: int = 0
    transfer_failures: int = 0
    unknown_decode_refusals: int = 0  # kv_address was no known decode worker's UCX listener


class PrefillServicer(WorkerRPCs, pb_grpc.PrefillServicer):
    def __init__(self, state: WorkerState, transport: KVTransport,
                 decodes: KnownDecodeListeners | None = None) -> None:
        self.state = state
        self.transport = transport
        self.decodes = decodes or KnownDecodeListeners(KnownPeers("decode"), None,
                                                       state.engine.engine.model_id)
        self.stats = PrefillStats()
        self._sends: dict[str, asyncio.Task[int]] = {}  # request id -> its KV transfer in flight
        self._aborted: set[str] = set()  # Abort RPCs whose Prefill has not ended yet

    async def Prefill(self, request: pb.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        if self.state.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker: draining (shutting down); use another")
        loop = self.state.engine
        try:
            handoff = handoff_from_proto(request)  # the decode engine's, layout included
            handoff.check_layout(self.state.layout)  # before any work (invariant 7)
        except (InvalidLayout, LayoutMismatch) as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if not await self.decodes.knows(request.kv_address):  # before any work: push to no stranger
            self.stats.unknown_decode_refusals += 1
            log.warning("refused Prefill %s: kv_address %r is no known decode worker's",
                        request.request_id, request.kv_address)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"kv_address: {request.kv_address!r} is not the KV listener of a decode "
                                "worker this prefill worker knows (its --decode flag or Redis registrations)")
        try:
            params = await request_sampling(self.state, request.sampling)
            # Only token 1 is made here; min_tokens still bans EOS for it.
            params = replace(params, n=1, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        request_id = handoff.request_id
        ids = list(request.prompt_token_ids)
        trace = None
        if self.state.tracing.enabled:
            trace = PrefillTrace(self.state.tracing, context.invocation_metadata(),
                                 worker_id=self.state.worker_id, request_id=request_id,
                                 num_prompt_tokens=len(ids))
        answered = False
        clock = self.state.metrics.clock(len(ids)) if self.state.metrics is not None else None
        q = loop.open_stream(request_id)
        t0 = time.monotonic()
        try:
            try:
                await loop.call(lambda e: e.add_request(request_id, ids, params, priority=request.priority,
                                                        cache_salt=request.cache_salt or None,
                                                        hold_blocks=True,
                                                        num_resumed_tokens=request.resumed_output_tokens,
                                                        lora=handoff.lora,
                                                        lora_digest=handoff.lora_digest or None))
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            out = await q.get()
            if isinstance(out, BaseException):
                await abort_with(context, out)
                raise out  # abort() raises; this keeps the type checker informed
            prefill_s = time.monotonic() - t0
            if clock is not None:  # token 1 is the decode worker's to count
                clock.output(out, count_tokens=False)
            if trace is not None:
                trace.prefilled(trace.start_ns, out.num_cached_tokens,
                                loop.engine.config.scheduler.max_num_batched_tokens)
            try:
                src, dst = handoff.pair(await loop.call(lambda e: e.held_block_ids(request_id)))
            except ValueError as e:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
            t1 = time.monotonic()
            t1_ns = now_ns() if trace is not None else 0
            if self.state.faults.before_kv_send is not None:
                await self.state.faults.before_kv_send(request_id)
            if request_id in self._aborted:
                await context.abort(grpc.StatusCode.CANCELLED, f"request {request_id!r} was aborted")
            send = self._sends[request_id] = asyncio.ensure_future(self.transport.send(
                request.kv_address, request_id, src, dst, request.kv_token))
            try:
                nbytes = await send
            except asyncio.CancelledError:
                if request_id not in self._aborted:
                    raise
                await context.abort(grpc.StatusCode.CANCELLED,
                                    f"request {request_id!r} was aborted mid-transfer")
            except Exception as e:  # noqa: BLE001 - any transport failure is the decode side's to handle
                self.stats.transfer_failures += 1
                if trace is not None:
                    trace.sent(t1_ns, request.kv_address, len(src), 0, error=str(e))
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {e}")
            self.stats.prefills += 1
            self.stats.blocks_sent += len(src)
            self.stats.bytes_sent += nbytes
            if self.state.metrics is not None:
                self.state.metrics.kv_transfer_seconds.observe(time.monotonic() - t1)
            if trace is not None:
                trace.sent(t1_ns, request.kv_address, len(src), nbytes)
            answered = True
            token = out.new_token_ids[0]
            first_token = (logprobs_to_proto(token, out.new_logprobs[0]) if out.new_logprobs
                           else pb.TokenLogprobs(token_id=token))
            prompt_logprobs = prompt_logprobs_to_proto(ids, out.prompt_logprobs or [])
            return pb.PrefillResponse(first_token=first_token, cached_tokens=out.num_cached_tokens,
                                      bytes_sent=nbytes, blocks_sent=len(src),
                                      transfer_seconds=time.monotonic() - t1, prefill_seconds=prefill_s,
                                      prompt_logprobs=prompt_logprobs)
        finally:
            if trace is not None:
                trace.end(None if answered else "prefill failed or was cancelled")
            self._sends.pop(request_id, None)
            self._aborted.discard(request_id)
            loop.close_stream(request_id)
            await loop.call(lambda e: e.abort(request_id))  # frees held blocks (or the unfinished request)

    async def before_free(self, request_id: str) -> None:
        """Abort: stop the request's send before its held blocks are freed (UCX
        reads them until the send has ended; invariant 3 on this side)."""
        if not self.state.engine.has_stream(request_id):  # no Prefill of this id is running
            return
        self._aborted.add(request_id)
        send = self._sends.get(request_id)
        if send is not None and not send.done():
            send.cancel()  # Sender stops UCX reading our blocks, then re-raises
            await asyncio.wait({send})

    async def close(self) -> None:
        await self.decodes.close()
