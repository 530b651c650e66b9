"""The frontend's spans of one request: `request` (arrival to the answer, with
`first_token` and `finish` events) and one `route` per worker call.  The decode
worker's spans hang under `request` through the metadata of its Generate call."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from services.tracing import Carrier, Tracing, now_ns, sampling_attributes, server_kind, set_error, wall_ns

if TYPE_CHECKING:
    from services.frontend.prepare import Plan
    from services.frontend.results import Results
    from services.frontend.worker_pool import Worker

# What each endpoint does, in gen_ai.operation.name's vocabulary.
_OPERATIONS = {"chat.completions": "chat", "completions": "text_completion"}


class RequestTrace:
    def __init__(self, tracing: Tracing, plan: Plan, endpoint: str, model_name: str, arrival: float,
                 carrier: Carrier | None) -> None:
        self.tracing = tracing
        self.arrival = arrival
        attrs: dict[str, object] = {
            "gen_ai.operation.name": _OPERATIONS.get(endpoint, "generate"),
            "gen_ai.request.model": model_name, "splitserve.request_id": plan.request_id,
            "splitserve.endpoint": endpoint,
            "splitserve.stream": plan.stream, **sampling_attributes(plan.prompts[0].params)}
        if len(plan.prompts) > 1:
            attrs["splitserve.num_prompts"] = len(plan.prompts)
        self.span = tracing.start_span("request", tracing.extract(carrier), wall_ns(arrival),
                                       kind=server_kind(), attributes=attrs)
        self._metadata = tracing.metadata(self.span)

    def metadata(self) -> list[tuple[str, str]]:
        """For the decode worker's Generate call: its spans become this request's children."""
        return self._metadata

    def route(self, start_ns: int, attempt: int, decode: Worker | None, prefill: Worker | None,
              num_prompt_tokens: int) -> None:
        attrs: dict[str, object] = {"splitserve.route.attempt": attempt,
                                    "gen_ai.usage.input_tokens": num_prompt_tokens,
                                    "splitserve.prefill.remote": prefill is not None}
        if decode is not None:
            attrs["splitserve.decode.worker_id"] = decode.worker_id
        if prefill is not None:
            attrs["splitserve.prefill.worker_id"] = prefill.worker_id
        self.tracing.record("route", self.span, start_ns, now_ns(), attrs,
                            error=None if decode is not None else "no decode worker available")

    def worker_failed(self, decode: Worker, code: str, message: str) -> None:
        """Invariant 6: a failed worker call is visible in the trace (a retry shows as a second route)."""
        self.span.add_event("worker_failed", {"splitserve.decode.worker_id": decode.worker_id,
                                              "error.type": code, "exception.message": message})

    def first_token(self) -> None:
        self.span.add_event("first_token", {"splitserve.ttft_seconds": time.monotonic() - self.arrival})

    def finish(self, status: str, results: Results) -> None:
        usage = results.usage()
        reasons = [c.finish_reason or "" for c in results.choices]
        self.span.set_attributes({"gen_ai.usage.input_tokens": usage.prompt_tokens,
                                  "gen_ai.usage.output_tokens": usage.completion_tokens,
                                  "splitserve.usage.cached_tokens": usage.cached_tokens,
                                  "gen_ai.response.finish_reasons": reasons,
                                  "splitserve.status": status})
        self.span.add_event("finish", {"splitserve.status": status,
                                       "splitserve.e2e_seconds": time.monotonic() - self.arrival})
        if status != "200":
            set_error(self.span, f"status {status}")
        self.span.end()
