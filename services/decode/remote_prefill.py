"""The decode side of a remote prefill (docs/ARCHITECTURE.md, invariants 2, 3 and 6):

    reserve   the engine reserves the prompt's blocks and names them in a KVHandoff;
              no room: wait (bounded) until blocks are freed, then try again
    expect    invite the KV into the blocks to fill, with a one-time token
    Prefill   ask the prefill worker: it computes the prompt and sends the blocks
    landed    the request joins the running batch with the prefill worker's first token
    failed    cancel the transfer (nothing lands afterwards), then recompute the
              prompt here, or fail the request (--kv-failure-policy)

Plain asyncio; the servicer maps the two errors below to gRPC statuses."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from engine.kv_handoff import KVHandoff
from engine.llm_engine import LLMEngine
from engine.sampler import SampledToken
from engine.vocab.lora_request import LoRARequest
from engine.vocab.sampling_params import SamplingParams
from kvtransfer.layout import LayoutMismatch
from kvtransfer.transport import KVTransport
from kvtransfer.wire import new_transfer_token
from protos import pb, pb_grpc
from services.convert import logprobs_from_proto
from services.decode.stats import DecodeStats
from services.kv_layout import handoff_to_proto
from services.tracing import now_ns
from services.worker_state import WorkerState
from services.worker_tracing import DecodeTrace

log = logging.getLogger(__name__)
LoRAPick = tuple[LoRARequest | None, str | None]  # the adapter, the digest the caller expects


class ReserveTimeout(Exception):
    """No blocks freed up for the prompt in time (RESOURCE_EXHAUSTED)."""


class RemotePrefillFailed(Exception):
    """The KV did not arrive and the policy is to fail (UNAVAILABLE)."""


class RemotePrefill:
    def __init__(self, state: WorkerState, transport: KVTransport, stats: DecodeStats,
                 prefill_stub: Callable[[str], pb_grpc.PrefillStub], *, failure_policy: str,
                 transfer_timeout: float, reserve_timeout: float) -> None:
        self.state = state
        self.transport = transport
        self.stats = stats
        self.prefill_stub = prefill_stub
        self.failure_policy = failure_policy
        self.transfer_timeout = transfer_timeout
        self.reserve_timeout = reserve_timeout

    async def run(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                  request: pb.WorkerGenerateRequest, timings: dict[str, float],
                  trace: DecodeTrace | None = None, lora: LoRAPick = (None, None)) -> None:
        """Until the request runs here (its first token is on its stream, ahead of the
        second) or recomputes here.  Raises ReserveTimeout, RemotePrefillFailed, or
        ValueError (the prompt or params are invalid)."""
        t_start = time.monotonic()
        queued_ns = now_ns() if trace is not None else 0
        handoff = await self._reserve(request_id, prompt_token_ids, params, request, lora)
        kv_token = new_transfer_token()  # only the prefill worker we ask learns it
        landed = self.transport.expect(request_id, handoff.blocks_to_fill, token=kv_token)
        t0 = time.monotonic()
        timings["reserve"] = t0 - t_start
        if trace is not None:
            trace.queued(queued_ns, len(handoff.blocks_to_fill))
        try:
            resp = await self.prefill_stub(request.prefill_address).Prefill(
                self._prefill_request(handoff, prompt_token_ids, request, kv_token),
                timeout=self.transfer_timeout, metadata=trace.metadata() if trace is not None else None)
            await asyncio.wait_for(landed, timeout=self.transfer_timeout)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, ConnectionError, OSError, RuntimeError) as e:
            await self._failed(request_id, request.prefill_address, landed, e, trace)
            return
        self.stats.remote_prefills += 1
        self.stats.kv_bytes_received += resp.bytes_sent
        self.stats.kv_transfer_seconds += time.monotonic() - t0
        if self.state.metrics is not None:
            self.state.metrics.kv_transfer_seconds.observe(resp.transfer_seconds)
        ft = resp.first_token
        first = SampledToken(ft.token_id, ft.logprob, ft.rank, {t.token_id: t.logprob for t in ft.top})
        t_landed = time.monotonic()
        loop = self.state.engine
        prompt_lps = [logprobs_from_proto(m) for m in resp.prompt_logprobs] if resp.prompt_logprobs else None
        await loop.call(lambda e: loop.emit([e.remote_kv_landed(request_id, first, prompt_lps)])
                        if request_id in e.scheduler.requests else None)  # else aborted meanwhile
        timings.update(prefill=resp.prefill_seconds, transfer=resp.transfer_seconds,
                       rpc_and_wait=t_landed - t0, admit=time.monotonic() - t_landed)

    async def _reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       request: pb.WorkerGenerateRequest, lora: LoRAPick = (None, None)) -> KVHandoff:
        """Blocks first, KV second (invariant 2): wait, bounded, until the pool has room."""
        deadline = time.monotonic() + self.reserve_timeout

        def reserve(e: LLMEngine) -> tuple[KVHandoff | None, int]:
            handoff = e.reserve_remote(request_id, prompt_token_ids, params, priority=request.priority,
                                       cache_salt=request.cache_salt or None,
                                       num_resumed_tokens=request.resumed_output_tokens,
                                       lora=lora[0], lora_digest=lora[1])
            return handoff, e.kv.num_free_blocks

        while True:
            handoff, num_free = await self.state.engine.call(reserve)
            if handoff is not None:
                return handoff
            self.stats.waits_for_blocks += 1
            if not await self.state.engine.wait_free_blocks(num_free, deadline - time.monotonic()):
                raise ReserveTimeout("no KV blocks free for the prompt")

    def _prefill_request(self, handoff: KVHandoff, prompt_token_ids: list[int],
                         request: pb.WorkerGenerateRequest, kv_token: bytes) -> pb.PrefillRequest:
        return handoff_to_proto(
            handoff, prompt_token_ids=prompt_token_ids, sampling=request.sampling,
            priority=request.priority, cache_salt=request.cache_salt, kv_address=self.state.kv_address,
            kv_token=kv_token, resumed_output_tokens=request.resumed_output_tokens)

    async def _failed(self, request_id: str, prefill_address: str, landed: asyncio.Future[int],
                      err: BaseException, trace: DecodeTrace | None) -> None:
        await self.transport.cancel(request_id)  # after this, nothing more is written to the blocks
        if landed.done() and not landed.cancelled():
            landed.exception()  # retrieved: the failure is reported below
        self.stats.kv_transfer_failures += 1
        if _layout_refused(err):
            self.stats.kv_layout_refusals += 1
        log.warning("remote prefill of %s via %s failed: %s", request_id, prefill_address, err)
        if trace is not None:
            trace.kv_failed(str(err), recompute=self.failure_policy != "fail")
        if self.failure_policy == "fail":
            raise RemotePrefillFailed(f"remote prefill failed: {err}") from err
        self.stats.kv_transfer_recomputes += 1
        # Aborted meanwhile (Abort RPC): the request is gone and its stream holds the error.
        await self.state.engine.call(lambda e: e.remote_kv_failed(request_id)
                                     if request_id in e.scheduler.requests else None)


def _layout_refused(err: BaseException) -> bool:
    """The prefill worker's layout check (kvtransfer.layout.LayoutMismatch, sent
    back as FAILED_PRECONDITION) or the UCX handshake refused this worker's layout."""
    if isinstance(err, LayoutMismatch):
        return True
    return (isinstance(err, grpc.aio.AioRpcError) and err.code() == grpc.StatusCode.FAILED_PRECONDITION
            and (err.details() or "").startswith("KV layout mismatch"))
