"""The frontend's parts wired together; the REST and gRPC layers both call this."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from services.frontend.admission import Admission, Limits, Ticket
from services.frontend.auth import Auth, Tenant, bearer
from services.frontend.config import FrontendConfig
from services.frontend.dispatch import Dispatcher
from services.frontend.errors import APIError
from services.frontend.loras import LoRARegistry
from services.frontend.metrics import Metrics
from services.frontend.prepare import Plan, Preparer
from services.frontend.request_run import RequestRun
from services.frontend.router import LoadRouter, Router
from services.frontend.tokenizer import Tokenizer
from services.frontend.worker_pool import WorkerPool
from services.tracing import Carrier, Tracing

T = TypeVar("T")
MAX_CLIENT_ID_CHARS = 256  # a client's own request id, echoed back

class Frontend:
    def __init__(self, config: FrontendConfig, tokenizer: Tokenizer, pool: WorkerPool, model_name: str,
                 router: Router | None = None, tracing: Tracing | None = None) -> None:
        self.config = config
        self.tracing = tracing or Tracing.off()
        self.model_name = model_name
        self.pool = pool
        router = router or LoadRouter(config.local_prefill_threshold)
        self.metrics = Metrics(pool, router, model_name, f"frontend-{socket.gethostname()}-{config.port}")
        if hasattr(router, "observe_lookup"):
            router.observe_lookup = self.metrics.observe_lookup
        self.dispatcher = Dispatcher(pool, router, self.metrics, config.max_migrations)
        # A request with more choices than the waiting room holds could never be
        # admitted: it is refused as too large (400), not told to retry (429).
        max_choices = min(config.max_choices, config.max_waiting_requests or config.max_choices)
        self.loras = LoRARegistry(config.lora)
        self.preparer = Preparer(tokenizer, model_name, config.max_n, pool.max_model_len,
                                 max_prompts=config.max_prompts, max_choices=max_choices,
                                 max_prompt_chars=config.max_prompt_chars,
                                 tool_call_parser=config.tool_call_parser, loras=self.loras)
        self.admission = Admission(Limits(config.max_waiting_requests, config.max_waiting_prompt_tokens,
                                          config.max_requests_per_tenant))
        self.metrics.waiting.set_function(lambda: self.admission.waiting)
        self.auth = Auth(config.api_keys)
        # Parsing, chat templates and tokenizing (the tokenizer lets go of the GIL)
        # run here, off the event loop, so that one large prompt stalls nobody else.
        self._prepare_pool = ThreadPoolExecutor(2, thread_name_prefix="prepare")
        self.created = int(time.time())
        self.active: set[RequestRun] = set()

    @staticmethod
    def new_request_id(prefix: str) -> str:
        """Worker-side ids are always made here; a client's own id is only echoed back."""
        return f"{prefix}-{uuid.uuid4().hex}"

    @staticmethod
    def client_request_id(value: str | None, field: str) -> str | None:
        if value and len(value) > MAX_CLIENT_ID_CHARS:
            raise APIError(400, f"{field}: at most {MAX_CLIENT_ID_CHARS} characters, got {len(value)}", field)
        return value or None

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            future = asyncio.get_running_loop().run_in_executor(self._prepare_pool, fn, *args)
        except RuntimeError:  # the pool is shut down: the frontend is stopping
            raise APIError(503, "the frontend is shutting down; retry", None, "shutting_down") from None
        return await future

    def close(self) -> None:
        self._prepare_pool.shutdown(wait=False, cancel_futures=True)

    def tenant_name(self, tenant: Tenant | None, authorization: str | None, user: str | None) -> str | None:
        """Whom per-tenant limits count: the API key when keys are configured; else
        whatever the client calls itself (a bearer token or `user`)."""
        if self.auth.enabled:
            return tenant.name if tenant is not None else None
        return bearer(authorization) or user or None

    def isolate(self, plan: Plan, tenant: Tenant | None) -> Plan:
        """--cache-isolation tenant: the plan's cache salt becomes the key's own."""
        if self.config.cache_isolation != "tenant" or tenant is None:
            return plan
        return dataclasses.replace(plan, cache_salt=tenant.cache_salt(plan.cache_salt))

    def admit(self, plan: Plan, tenant: str | None) -> Ticket:
        """A place in the waiting room, or a 429 (APIError) at once.  Each choice
        (prompts x n) is a worker stream, and waits as a request of its own."""
        return self.admission.admit(sum(len(p.token_ids) for p in plan.prompts) * plan.n, tenant,
                                    requests=len(plan.prompts) * plan.n)

    def start(self, plan: Plan, endpoint: str, arrival: float, carrier: Carrier | None = None,
              ticket: Ticket | None = None, timeout: float | None = None) -> RequestRun:
        """carrier: the client's headers or gRPC metadata (a `traceparent` continues its trace)."""
        trace = None
        if self.tracing.enabled:
            from services.frontend.request_trace import RequestTrace

            trace = RequestTrace(self.tracing, plan, endpoint, self.model_name, arrival, carrier)
        if timeout is None:
            timeout = self.config.request_timeout_seconds or None
        return RequestRun(plan, self.dispatcher, self.metrics, endpoint, arrival, self.active, trace,
                          ticket, timeout)

    async def drain(self, grace_seconds: float) -> None:
        """Shutdown: give requests in flight `grace_seconds` to finish, then end the
        rest with a 503 (UNAVAILABLE) so that their clients get an answer."""
        deadline = time.monotonic() + grace_seconds
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for run in list(self.active):
            run.fail(APIError(503, "the frontend is shutting down; retry", None, "shutting_down"))

    def health(self) -> tuple[bool, dict[str, Any]]:
        decodes, prefills = self.pool.healthy("decode"), self.pool.healthy("prefill")
        ok = bool(decodes) and self.pool.max_model_len() is not None
        return ok, {"status": "ok" if ok else "unavailable", "model": self.model_name,
                    "healthy_decode_workers": len(decodes), "decode_workers": len(self.pool.decodes),
                    "healthy_prefill_workers": len(prefills), "prefill_workers": len(self.pool.prefills)}

    def models(self) -> dict[str, Any]:
        card: dict[str, Any] = {"id": self.model_name, "object": "model", "created": self.created,
                                "owned_by": "splitserve", "root": self.model_name, "parent": None}
        if (max_len := self.pool.max_model_len()) is not None:
            card["max_model_len"] = max_len
        return {"object": "list", "data": [card, *self.loras.cards(self.model_name, self.created)]}

    def cluster(self) -> dict[str, Any]:
        router = self.dispatcher.router
        routing = {"policy": type(router).__name__,
                   "decisions": dict(getattr(router, "decisions", {})),
                   "index_fallbacks": getattr(router, "index_fallbacks", 0)}
        return {"model": self.model_name, "workers": [w.describe() for w in self.pool.all],
                "routing": routing}
