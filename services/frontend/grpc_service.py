"""The public gRPC API: splitserve.v1.Frontend/Generate, plus health and reflection.

With API keys configured, Frontend calls want `authorization: Bearer KEY`
metadata (UNAUTHENTICATED otherwise), checked by an interceptor before the
request is read; health and reflection stay open, like REST's /health."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from protos import pb, pb_grpc
from services.frontend.auth import Auth
from services.frontend.core import Frontend
from services.frontend.errors import APIError
from services.frontend.request_run import CLIENT_CLOSED

ENDPOINT = "grpc.Generate"
SERVICE_NAME = "splitserve.v1.Frontend"


class FrontendServicer(pb_grpc.FrontendServicer):
    def __init__(self, fe: Frontend) -> None:
        self.fe = fe

    async def Generate(self, request: pb.GenerateRequest,  # noqa: N802 (gRPC's name)
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        fe = self.fe
        arrival = time.monotonic()
        request_id = fe.new_request_id("gen")  # the workers' id; the client's is only echoed
        try:
            echo = fe.client_request_id(request.request_id, "request_id") or request_id
            authorization = _metadata(context).get("authorization")
            tenant = fe.auth.authenticate(authorization)  # the interceptor let it in; which key?
            plan = fe.isolate(await fe.off_loop(fe.preparer.grpc, request, request_id), tenant)
            fe.dispatcher.check_available()
            ticket = fe.admit(plan, fe.tenant_name(tenant, authorization, request.user))
        except APIError as e:
            fe.metrics.requests.labels(ENDPOINT, str(e.status)).inc()
            await context.abort(e.grpc_code, e.message)
        remaining = context.time_remaining()  # the client's deadline, if it set one
        run = fe.start(plan, ENDPOINT, arrival, context.invocation_metadata(), ticket,
                       remaining if remaining is not None and remaining < 1e6 else None)
        status = CLIENT_CLOSED
        try:
            async for _, event in run.events():
                msg = event.msg
                yield pb.GenerateResponse(request_id=echo, index=event.index, token_ids=msg.token_ids,
                                          text=msg.text, logprobs=msg.logprobs,
                                          prompt_logprobs=msg.prompt_logprobs,
                                          finish_reason=msg.finish_reason, stop_reason=msg.stop_reason)
            status = "200"
            yield pb.GenerateResponse(request_id=echo, usage=run.results.usage().to_proto())
        except APIError as e:
            status = str(e.status)
            await context.abort(e.grpc_code, e.message)
        finally:
            run.close(status)


def _metadata(context: grpc.aio.ServicerContext) -> dict[str, str]:
    return {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}


class RequireKey(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """UNAUTHENTICATED for a Frontend call without a valid key, before its request is read."""

    def __init__(self, auth: Auth) -> None:
        self.auth = auth

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(f"/{SERVICE_NAME}/"):
            return handler
        metadata = {k: v for k, v in details.invocation_metadata or () if isinstance(v, str)}
        try:
            self.auth.authenticate(metadata.get("authorization"))
        except APIError as e:
            return _refusal(handler, e)
        return handler


def _refusal(handler: grpc.RpcMethodHandler, e: APIError) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that only answers with `e`."""
    async def refuse(_: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(e.grpc_code, e.message)

    kinds = {(False, False): grpc.unary_unary_rpc_method_handler,
             (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler,
             (True, True): grpc.stream_stream_rpc_method_handler}
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(refuse, request_deserializer=None, response_serializer=handler.response_serializer)


def build_grpc_server(fe: Frontend, address: str) -> tuple[grpc.aio.Server, health_aio.HealthServicer]:
    limit = fe.config.max_body_bytes
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit),
                                      ("grpc.so_reuseport", 0)],
                             interceptors=[RequireKey(fe.auth)] if fe.auth.enabled else None)
    pb_grpc.add_FrontendServicer_to_server(FrontendServicer(fe), server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    config = fe.config
    if config.tls_cert and config.tls_key:
        creds = grpc.ssl_server_credentials([(Path(config.tls_key).read_bytes(),
                                              Path(config.tls_cert).read_bytes())])
        port = server.add_secure_port(address, creds)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"grpc: cannot bind {address}")
    return server, health


async def set_serving(health: health_aio.HealthServicer, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", SERVICE_NAME):
        await health.set(name, status)
