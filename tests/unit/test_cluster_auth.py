"""The cluster token on worker RPCs, in process: the server interceptor refuses
unary, streaming and bidirectional calls without it (health stays open), and both client
helpers attach it to both kinds of call.  (A grpc.aio interceptor object of
two kinds is filed under one only: its streaming calls once went bare.)"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos import pb, pb_grpc
from services.cluster_auth import (
    ENV,
    FILE_ENV,
    aio_channel,
    cluster_token,
    is_loopback,
    server_interceptors,
    sync_channel,
    token_matches,
)

TOKEN = "unit-token"


class Worker(pb_grpc.DecodeServicer):
    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.WorkerInfo:
        return pb.WorkerInfo(role="decode")

    async def WatchLoad(self, request: pb.LoadRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[pb.LoadReport]:
        for i in range(2):
            yield pb.LoadReport(running=i)

    async def Session(self, request_iterator: AsyncIterator[pb.SessionRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.SessionResponse]:
        async for req in request_iterator:  # each start answered with its id
            yield pb.SessionResponse(items=[pb.SessionItem(request_id=req.start.request.request_id)])


async def serve() -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(interceptors=server_interceptors(TOKEN))
    pb_grpc.add_DecodeServicer_to_server(Worker(), server)
    probe = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(probe, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await probe.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, f"127.0.0.1:{port}"


async def codes(address: str, token: str | None) -> tuple[object, object, object]:
    async with aio_channel(address, token) as ch:
        stub = pb_grpc.DecodeStub(ch)
        try:
            unary: object = (await stub.Info(pb.InfoRequest(), timeout=5)).role
        except grpc.aio.AioRpcError as e:
            unary = e.code()
        try:
            stream: object = [r.running async for r in stub.WatchLoad(pb.LoadRequest(), timeout=5)]
        except grpc.aio.AioRpcError as e:
            stream = e.code()
        call = stub.Session(timeout=5)
        try:
            await call.write(pb.SessionRequest(start=pb.SessionStart(request=pb.WorkerGenerateRequest(
                request_id="r1"))))
            bidi: object = [i.request_id for i in (await call.read()).items]
        except grpc.aio.AioRpcError as e:
            bidi = e.code()
        call.cancel()
    return unary, stream, bidi


def test_token_on_unary_and_streaming_calls() -> None:
    async def run() -> None:
        server, address = await serve()
        try:
            assert await codes(address, TOKEN) == ("decode", [0, 1], ["r1"])
            refused = grpc.StatusCode.UNAUTHENTICATED
            assert await codes(address, None) == (refused, refused, refused)
            assert await codes(address, "unit-toke") == (refused, refused, refused)
            async with grpc.aio.insecure_channel(address) as ch:  # probes need no secret
                reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING

            def blocking() -> tuple[str, list[int]]:
                with sync_channel(address, TOKEN) as ch:
                    stub = pb_grpc.DecodeStub(ch)
                    return (stub.Info(pb.InfoRequest(), timeout=5).role,
                            [r.running for r in stub.WatchLoad(pb.LoadRequest(), timeout=5)])

            assert await asyncio.to_thread(blocking) == ("decode", [0, 1])
        finally:
            await server.stop(None)

    asyncio.run(run())


def test_token_sources_and_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv(FILE_ENV, raising=False)
    assert cluster_token(argparse.Namespace(cluster_token=None)) is None
    assert cluster_token(argparse.Namespace(cluster_token="flag")) == "flag"
    monkeypatch.setenv(ENV, "env")
    assert cluster_token(argparse.Namespace(cluster_token=None)) == "env"
    monkeypatch.delenv(ENV)
    (tmp_path / "t").write_text("from-file\n")
    monkeypatch.setenv(FILE_ENV, str(tmp_path / "t"))
    assert cluster_token(argparse.Namespace(cluster_token=None)) == "from-file"
    (tmp_path / "t").write_text("")
    with pytest.raises(SystemExit, match="empty"):
        cluster_token(argparse.Namespace(cluster_token=None))
    assert token_matches("abc", "abc") and token_matches("abc", b"abc")
    assert not token_matches("abc", None) and not token_matches("abc", "abd") and not token_matches("abc", "")
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("") and not is_loopback("10.1.2.3")
