"""The workers' spans of one request, made on the asyncio loop from times the
servicers note (`now_ns()`); nothing here touches the engine thread.

Decode worker, under the frontend's `request` span (context in the call's metadata):

    splitserve.v1.Decode/Generate   the whole call
      queue                          waiting for free KV blocks before asking for the prompt's KV
      prefill                        local prefill only: queued + computed here, to token 1
      decode                         token 1 to the last token; events first_token, finish

Prefill worker, under the decode worker's call span:

    splitserve.v1.Prefill/Prefill   the whole call
      prefill                        queued + computed, to token 1 (chunk count)
      kv_transfer                    the blocks to the decode worker (bytes, blocks, seconds)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.tracing import (
    Carrier,
    Tracing,
    now_ns,
    prefill_chunks,
    rpc_attributes,
    sampling_attributes,
    server_kind,
    set_error,
)

if TYPE_CHECKING:
    from engine.outputs import StepOutput
    from engine.vocab.sampling_params import SamplingParams


class _CallTrace:
    def __init__(self, tracing: Tracing, metadata: Carrier | None, service: str, method: str,
                 attributes: dict[str, object]) -> None:
        self.tracing = tracing
        self.start_ns = now_ns()
        self.span = tracing.start_span(f"{service}/{method}", tracing.extract(metadata), self.start_ns,
                                       kind=server_kind(),
                                       attributes={**rpc_attributes(service, method), **attributes})


class DecodeTrace(_CallTrace):
    def __init__(self, tracing: Tracing, metadata: Carrier | None, *, worker_id: str, request_id: str,
                 params: SamplingParams, num_prompt_tokens: int, remote: bool,
                 max_batched_tokens: int) -> None:
        super().__init__(tracing, metadata, "splitserve.v1.Decode", "Generate",
                         {"splitserve.worker_id": worker_id, "splitserve.request_id": request_id,
                          "gen_ai.usage.input_tokens": num_prompt_tokens, "splitserve.prefill.remote": remote,
                          **sampling_attributes(params)})
        self.remote = remote
        self.num_prompt_tokens = num_prompt_tokens
        self.max_batched_tokens = max_batched_tokens
        self.first_ns = 0
        self.last_ns = 0
        self.num_tokens = 0
        self.num_cached_tokens = 0
        self.finish_reason = ""

    def metadata(self) -> list[tuple[str, str]]:
        """For the Prefill call: the prefill worker's spans become this call's children."""
        return self.tracing.metadata(self.span)

    def queued(self, start_ns: int, blocks_reserved: int) -> None:
        self.tracing.record("queue", self.span, start_ns, now_ns(),
                            {"splitserve.kv.blocks_reserved": blocks_reserved})

    def kv_failed(self, error: str, recompute: bool) -> None:
        """Invariant 6: a failed transfer is visible in the trace."""
        self.span.add_event("kv_transfer_failed", {"exception.message": error,
                                                   "splitserve.kv.recompute": recompute})

    def token(self, out: StepOutput) -> None:
        """Per streamed output, on the loop: a clock read and a few fields."""
        self.last_ns = now_ns()
        if not self.first_ns:
            self.first_ns = self.last_ns
            self.num_cached_tokens = out.num_cached_tokens
        self.num_tokens += len(out.new_token_ids)
        if out.finish_reason:
            self.finish_reason = out.finish_reason

    def end(self, error: str | None) -> None:
        if self.first_ns:
            if not self.remote:
                chunks = prefill_chunks(self.num_prompt_tokens, self.num_cached_tokens,
                                        self.max_batched_tokens)
                self.tracing.record("prefill", self.span, self.start_ns, self.first_ns, {
                    "splitserve.prefill.location": "decode", "splitserve.prefill.chunks": chunks,
                    "splitserve.usage.cached_tokens": self.num_cached_tokens})
            decode = self.tracing.start_span("decode", self.span, self.first_ns,
                                             attributes={"gen_ai.usage.output_tokens": self.num_tokens})
            decode.add_event("first_token", timestamp=self.first_ns)
            if self.finish_reason:
                decode.add_event("finish", {"gen_ai.response.finish_reasons": [self.finish_reason]},
                                 timestamp=self.last_ns)
            decode.end(end_time=self.last_ns)
        self.span.set_attributes({"gen_ai.usage.output_tokens": self.num_tokens,
                                  "splitserve.usage.cached_tokens": self.num_cached_tokens})
        if self.finish_reason:
            self.span.set_attribute("gen_ai.response.finish_reasons", [self.finish_reason])
        if error is not None:
            set_error(self.span, error)
        self.span.end()


class PrefillTrace(_CallTrace):
    def __init__(self, tracing: Tracing, metadata: Carrier | None, *, worker_id: str, request_id: str,
                 num_prompt_tokens: int) -> None:
        super().__init__(tracing, metadata, "splitserve.v1.Prefill", "Prefill",
                         {"splitserve.worker_id": worker_id, "splitserve.request_id": request_id,
                          "gen_ai.usage.input_tokens": num_prompt_tokens})
        self.num_prompt_tokens = num_prompt_tokens

    def prefilled(self, start_ns: int, num_cached_tokens: int, max_batched_tokens: int) -> None:
        self.tracing.record("prefill", self.span, start_ns, now_ns(), {
            "splitserve.prefill.location": "prefill",
            "splitserve.prefill.chunks": prefill_chunks(self.num_prompt_tokens, num_cached_tokens,
                                                        max_batched_tokens),
            "gen_ai.usage.input_tokens": self.num_prompt_tokens,
            "splitserve.usage.cached_tokens": num_cached_tokens})

    def sent(self, start_ns: int, peer: str, blocks: int, nbytes: int, error: str | None = None) -> None:
        end_ns = now_ns()
        seconds = (end_ns - start_ns) / 1e9
        attrs: dict[str, object] = {"splitserve.kv.peer": peer, "splitserve.kv.blocks": blocks,
                                    "splitserve.kv.bytes": nbytes, "splitserve.kv.seconds": seconds}
        if nbytes and seconds > 0:
            attrs["splitserve.kv.gbps"] = nbytes / seconds / 1e9
        self.tracing.record("kv_transfer", self.span, start_ns, end_ns, attrs, error=error)

    def end(self, error: str | None) -> None:
        if error is not None:
            set_error(self.span, error)
        self.span.end()
