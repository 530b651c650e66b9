"""One request in flight: its worker fan-out, its accumulated results, its metrics."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from services.frontend.dispatch import Dispatcher, Event
from services.frontend.metrics import Metrics
from services.frontend.prepare import Plan
from services.frontend.results import Choice, Results

CLIENT_CLOSED = "499"  # nginx's status for "the client went away"; only a metrics label


class RequestRun:
    def __init__(self, plan: Plan, dispatcher: Dispatcher, metrics: Metrics, endpoint: str,
                 arrival: float, active: set[RequestRun]) -> None:
        self.plan = plan
        self.results = Results(plan)
        self.metrics = metrics
        self.endpoint = endpoint
        self.arrival = arrival
        self._first_token = False
        self._fanout = dispatcher.stream(plan)
        metrics.in_flight.inc()
        self._open = True
        self._active = active
        active.add(self)

    async def events(self) -> AsyncIterator[tuple[Choice, Event]]:
        """Worker messages in arrival order, each with its choice so far."""
        async for event in self._fanout:
            if not self._first_token:
                self._first_token = True
                self.metrics.ttft.labels(self.endpoint).observe(time.monotonic() - self.arrival)
            yield self.results.add(event), event

    async def collect(self) -> Results:
        async for _ in self.events():
            pass
        return self.results

    def fail(self, error: Exception) -> None:
        """End the request early with `error` (shutdown); its handler answers with it."""
        self._fanout.fail(error)

    def close(self, status: str) -> None:
        """Cancel whatever still runs (worker calls abort) and count the request; idempotent."""
        if not self._open:
            return
        self._open = False
        self._active.discard(self)
        self._fanout.cancel()
        self.metrics.in_flight.dec()
        self.metrics.requests.labels(self.endpoint, status).inc()
        if status == "200":
            usage = self.results.usage()
            self.metrics.e2e.labels(self.endpoint).observe(time.monotonic() - self.arrival)
            self.metrics.prompt_tokens.inc(usage.prompt_tokens)
            self.metrics.generation_tokens.inc(usage.completion_tokens)
            self.metrics.cached_tokens.inc(usage.cached_tokens)
