"""The public gRPC API: splitserve.v1.Frontend/Generate, plus health and reflection."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from protos import pb, pb_grpc
from services.frontend.core import Frontend
from services.frontend.errors import APIError
from services.frontend.runner import CLIENT_CLOSED

ENDPOINT = "grpc.Generate"
SERVICE_NAME = "splitserve.v1.Frontend"


class FrontendServicer(pb_grpc.FrontendServicer):
    def __init__(self, fe: Frontend) -> None:
        self.fe = fe

    async def Generate(self, request: pb.GenerateRequest,  # noqa: N802 (gRPC's name)
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        fe = self.fe
        arrival = time.monotonic()
        request_id = request.request_id or fe.new_request_id("gen")
        try:
            plan = fe.preparer.grpc(request, request_id)
            fe.dispatcher.check_available()
            ticket = fe.admit(plan, request.user or None)
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
                yield pb.GenerateResponse(request_id=request_id, index=event.index, token_ids=msg.token_ids,
                                          text=msg.text, logprobs=msg.logprobs,
                                          finish_reason=msg.finish_reason, stop_reason=msg.stop_reason)
            status = "200"
            yield pb.GenerateResponse(request_id=request_id, usage=run.results.usage().to_proto())
        except APIError as e:
            status = str(e.status)
            await context.abort(e.grpc_code, e.message)
        finally:
            run.close(status)


def build_grpc_server(fe: Frontend, address: str) -> tuple[grpc.aio.Server, health_aio.HealthServicer]:
    limit = fe.config.max_body_bytes
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit),
                                      ("grpc.so_reuseport", 0)])
    pb_grpc.add_FrontendServicer_to_server(FrontendServicer(fe), server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    if server.add_insecure_port(address) == 0:
        raise OSError(f"grpc: cannot bind {address}")
    return server, health


async def set_serving(health: health_aio.HealthServicer, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", SERVICE_NAME):
        await health.set(name, status)
