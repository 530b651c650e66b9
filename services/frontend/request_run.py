"""One request in flight: its worker fan-out, its accumulated results, its metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from services.frontend.admission import Ticket
from services.frontend.dispatch import Dispatcher
from services.frontend.errors import APIError
from services.frontend.metrics import Metrics
from services.frontend.prepare import Plan
from services.frontend.results import Choice, Event, Results

if TYPE_CHECKING:
    from services.frontend.request_trace import RequestTrace

CLIENT_CLOSED = "499"  # nginx's status for "the client went away"; only a metrics label


class RequestRun:
    def __init__(self, plan: Plan, dispatcher: Dispatcher, metrics: Metrics, endpoint: str,
                 arrival: float, active: set[RequestRun], trace: RequestTrace | None = None,
                 ticket: Ticket | None = None, timeout: float | None = None) -> None:
        self.plan = plan
        self.trace = trace  # None: tracing is off
        self.results = Results(plan)
        self.metrics = metrics
        self.endpoint = endpoint
        self.arrival = arrival
        self._first_token = False
        self._last_output: dict[int, float] = {}  # choice -> when its last message came
        self._fanout = dispatcher.stream(plan, trace)
        self._ticket = ticket
        self._deadline = None
        if timeout:  # past it: every worker call is cancelled (the workers abort) and the client gets 504
            self._deadline = asyncio.get_running_loop().call_later(
                timeout, self._fanout.fail, APIError(504, f"the request took longer than its timeout of "
                                                          f"{timeout:g} s", None, "timeout"))
        metrics.in_flight.inc()
        self._open = True
        self._active = active
        active.add(self)

    async def events(self) -> AsyncIterator[tuple[Choice, Event]]:
        """Worker messages in arrival order, each with its choice so far."""
        async for event in self._fanout:
            if not self._first_token:
                self._first_token = True
                if self._ticket is not None:
                    self._ticket.started()
                self.metrics.ttft(self.endpoint, time.monotonic() - self.arrival)
                if self.trace is not None:
                    self.trace.first_token()
            now = time.monotonic()
            last = self._last_output.get(event.index)
            if last is not None:
                self.metrics.itl.observe(now - last)
            self._last_output[event.index] = now
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
        if self._deadline is not None:
            self._deadline.cancel()
        if self._ticket is not None:
            self._ticket.release()
        self.metrics.in_flight.dec()
        self.metrics.requests.labels(self.endpoint, status).inc()
        if self.trace is not None:
            self.trace.finish(status, self.results)
        if status == "200":
            self.metrics.finished(self.endpoint, time.monotonic() - self.arrival, self.results.usage(),
                                  [c.finish_reason or "stop" for c in self.results.choices])
