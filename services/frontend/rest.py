"""OpenAI-compatible REST: /v1/completions, /v1/chat/completions (SSE streaming), /v1/models,
and /health, /metrics, /cluster.

With API keys configured every path but /health wants `Authorization: Bearer KEY`
(401 otherwise): the operator's views (/metrics, /cluster: worker addresses,
load) are no more open than the API."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from protos import pb
from services.frontend import lora_api
from services.frontend import openai_format as fmt
from services.frontend import tokenize_api as tok_api
from services.frontend.auth import Auth, Tenant
from services.frontend.core import Frontend
from services.frontend.errors import APIError
from services.frontend.prepare import Plan
from services.frontend.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from services.frontend.request_run import CLIENT_CLOSED, RequestRun
from services.frontend.results import Choice, Event
from services.frontend.tools import ToolStream

log = logging.getLogger("splitserve.frontend.rest")
T = TypeVar("T")
TENANT = "splitserve.tenant"  # ASGI scope key: the caller's Tenant, set by RequireKey
OPEN_PATHS = frozenset({"/health"})


class ClientGone(Exception):
    pass


def error_response(e: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    headers = dict(headers or {})
    if e.retry_after is not None:
        headers["Retry-After"] = str(max(1, round(e.retry_after)))
    if e.status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="splitserve"'
    return JSONResponse(e.to_json(), status_code=e.status, headers=headers or None)


class RequireKey:
    """ASGI middleware: the API key is checked before anything else, the body
    included, so an unauthenticated client costs nothing but the headers."""

    def __init__(self, app: ASGIApp, auth: Auth) -> None:
        self.app = app
        self.auth = auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            authorization = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"),
                                 None)
            try:
                scope[TENANT] = self.auth.authenticate(authorization)
            except APIError as e:
                await error_response(e)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(fe: Frontend) -> FastAPI:
    app = FastAPI(title="splitserve", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    _describe_bodies(app)
    if fe.auth.enabled:
        app.add_middleware(RequireKey, auth=fe.auth)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, e: HTTPException) -> JSONResponse:
        return error_response(APIError(e.status_code, str(e.detail)))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(APIError(400, str(e)))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(APIError(500, f"internal error: {type(e).__name__}"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(fe, request, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(fe, request, "chat.completions")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return fe.models()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        fe.preparer.check_model(model_id)  # 404 for any other name
        return next(dict(c) for c in fe.models()["data"] if c["id"] == model_id)

    @app.post("/v1/load_lora_adapter")
    async def load_lora(request: Request) -> PlainTextResponse:
        body = await read_body(request, fe.config.max_body_bytes)
        return PlainTextResponse(await lora_api.load_lora_adapter(fe, body))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(request: Request) -> PlainTextResponse:
        body = await read_body(request, fe.config.max_body_bytes)
        return PlainTextResponse(lora_api.unload_lora_adapter(fe, body))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = parse_body(await read_body(request, fe.config.max_body_bytes), tok_api.TokenizeRequest)
        return await fe.off_loop(tok_api.tokenize, fe.preparer, body, fe.pool.max_model_len())

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = parse_body(await read_body(request, fe.config.max_body_bytes), tok_api.DetokenizeRequest)
        return await fe.off_loop(tok_api.detokenize, fe.preparer, body)

    @app.get("/health")
    async def health() -> JSONResponse:
        ok, body = fe.health()
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(fe.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/cluster")
    async def cluster() -> dict[str, Any]:
        return fe.cluster()

    return app


async def read_body(request: Request, limit: int) -> bytes:
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise APIError(413, f"body: {length} bytes is over the limit of {limit}", "body", "request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"body: over the limit of {limit} bytes", "body", "request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


_BODIES: dict[str, type[CompletionRequest] | type[ChatCompletionRequest]] = {
    "/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}


def _describe_bodies(app: FastAPI) -> None:
    """The handlers read their bodies themselves (size limit first, then one
    strict parse that names the bad field); the OpenAPI document still says
    what they take, from the same pydantic models."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version="1", routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for path, model in _BODIES.items():
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
                ref = {"$ref": f"#/components/schemas/{model.__name__}"}
                doc["paths"][path]["post"]["requestBody"] = {
                    "required": True, "content": {"application/json": {"schema": ref}}}
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work` unless the client disconnects first (then cancel it: ClientGone)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone()
    finally:
        watcher.cancel()
        task.cancel()


def request_timeout(value: str | None) -> float | None:
    """The X-Request-Timeout header (seconds), overriding --request-timeout."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < 1e6:
        raise APIError(400, f"X-Request-Timeout: must be a number of seconds > 0, got {value!r}",
                       "X-Request-Timeout")
    return seconds


def _prepare(fe: Frontend, body: bytes, chat: bool,
             request_id: str) -> tuple[ChatCompletionRequest | CompletionRequest, Plan]:
    """Parse and plan (chat template, tokenizing): runs off the event loop."""
    if chat:
        chat_req = parse_body(body, ChatCompletionRequest)
        return chat_req, fe.preparer.chat(chat_req, request_id)
    req = parse_body(body, CompletionRequest)
    return req, fe.preparer.completion(req, request_id)


async def _generate(fe: Frontend, request: Request, endpoint: str) -> Response:
    arrival = time.monotonic()
    chat = endpoint == "chat.completions"
    request_id = fe.new_request_id("chatcmpl" if chat else "cmpl")
    headers = {"X-Request-Id": request_id}  # the client's own X-Request-Id, when it sent one
    try:
        headers["X-Request-Id"] = fe.client_request_id(request.headers.get("x-request-id"),
                                                       "X-Request-Id") or request_id
        tenant: Tenant | None = request.scope.get(TENANT)
        body = await read_body(request, fe.config.max_body_bytes)
        parsed, plan = await fe.off_loop(_prepare, fe, body, chat, request_id)
        plan = fe.isolate(plan, tenant)
        timeout = request_timeout(request.headers.get("x-request-timeout"))
        fe.dispatcher.check_available()
        ticket = fe.admit(plan, fe.tenant_name(tenant, request.headers.get("authorization"), parsed.user))
    except APIError as e:
        fe.metrics.requests.labels(endpoint, str(e.status)).inc()
        return error_response(e, headers)
    run = fe.start(plan, endpoint, arrival, request.headers, ticket, timeout)
    env = fmt.Envelope(request_id, int(time.time()), fe.model_name)
    if plan.stream:
        return await _stream(request, run, env, chat, headers)
    status = "500"
    try:
        results = await cancel_on_disconnect(request, run.collect())
        status = "200"
    except ClientGone:
        status = CLIENT_CLOSED
        return Response(status_code=499)
    except APIError as e:
        status = str(e.status)
        return error_response(e, headers)
    finally:
        run.close(status)
    if chat:
        return JSONResponse(fmt.chat_response(env, results.choices, results.usage(), plan.logprobs,
                                              plan.tools, plan.prompt_logprobs), headers=headers)
    return JSONResponse(fmt.completion_response(env, results.choices, results.usage(), plan.logprobs,
                                                plan.echo, plan.prompt_logprobs), headers=headers)


async def _stream(request: Request, run: RequestRun, env: fmt.Envelope, chat: bool,
                  headers: dict[str, str]) -> Response:
    """SSE.  The first event is awaited before answering, so a request that fails
    before any token still gets its error status instead of a 200 stream."""
    events = run.events()
    try:
        first = await cancel_on_disconnect(request, events.__anext__())
    except (ClientGone, StopAsyncIteration):
        run.close(CLIENT_CLOSED)
        return Response(status_code=499)
    except APIError as e:
        run.close(str(e.status))
        return error_response(e, headers)
    except BaseException:
        run.close("500")
        raise
    plan = run.plan

    tool_streams = {c.index: ToolStream(plan.tools) for c in run.results.choices} if plan.tools else {}

    async def body() -> AsyncIterator[str]:
        status = CLIENT_CLOSED  # unless the stream completes or fails on the server
        try:
            if chat:
                for c in run.results.choices:
                    yield fmt.sse(fmt.chat_role_chunk(env, c.index, plan.include_usage))
            elif plan.echo:
                for c in run.results.choices:
                    echo = pb.WorkerGenerateResponse(text=plan.echo[c.prompt_index])
                    yield fmt.sse(fmt.completion_chunk(env, c.index, echo, None, 0, plan.include_usage))
            chunk = _chunk(env, plan, *first, chat, tool_streams)
            if chunk:
                yield chunk
            async for choice, event in events:
                chunk = _chunk(env, plan, choice, event, chat, tool_streams)
                if chunk:
                    yield chunk
            if plan.include_usage:
                obj = "chat.completion.chunk" if chat else "text_completion"
                yield fmt.sse(fmt.usage_chunk(env, obj, run.results.usage()))
            status = "200"
            yield fmt.SSE_DONE
        except APIError as e:
            status = str(e.status)
            yield fmt.sse(e.to_json())
            yield fmt.SSE_DONE
        finally:
            run.close(status)

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", **headers})


def _chunk(env: fmt.Envelope, plan: Plan, choice: Choice, event: Event, chat: bool,
           tool_streams: dict[int, ToolStream]) -> str | None:
    msg = event.msg
    if chat and plan.tools is not None:
        chunks = fmt.chat_tool_chunks(env, event.index, msg, tool_streams[event.index], plan.logprobs,
                                      plan.include_usage)
        return "".join(fmt.sse(c) for c in chunks) or None
    if chat:
        if not (msg.text or msg.finish_reason or msg.logprobs):
            return None  # a token whose text is held back (stop-string prefix, partial UTF-8)
        return fmt.sse(fmt.chat_chunk(env, event.index, msg, plan.logprobs, plan.include_usage))
    offset = len(choice.text) - len(msg.text)
    return fmt.sse(fmt.completion_chunk(env, event.index, msg, plan.logprobs, offset, plan.include_usage))
