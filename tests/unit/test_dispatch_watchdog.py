"""The frontend's watchdog over a worker stream (dispatch._watched), against a
real gRPC server whose stream sends one token and then goes quiet: while the
worker is alive (its load reports go on) the stream waits, however long;
once the worker stops reporting the stream fails with worker_unresponsive
(the caller then resumes it elsewhere: tests/integration/test_failover.py
SIGSTOPs a real worker); the caller's own cancellation stays a cancellation."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest

from protos import pb
from services.frontend import dispatch

METHOD = "/test.Quiet/Generate"


@dataclass
class Decode:
    """What _watched reads of a worker: its id and whether it still reports."""

    worker_id: str = "d0"
    alive: bool = True


async def one_then_quiet(request: pb.WorkerGenerateRequest, context: grpc.aio.ServicerContext,
                         ) -> AsyncIterator[pb.WorkerGenerateResponse]:
    yield pb.WorkerGenerateResponse(token_ids=[7])
    await asyncio.Event().wait()  # until the call ends


async def with_server(body):  # type: ignore[no-untyped-def]
    server = grpc.aio.server()
    handler = grpc.unary_stream_rpc_method_handler(
        one_then_quiet, request_deserializer=pb.WorkerGenerateRequest.FromString,
        response_serializer=pb.WorkerGenerateResponse.SerializeToString)
    service = grpc.method_handlers_generic_handler("test.Quiet", {"Generate": handler})
    server.add_generic_rpc_handlers([service])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    call = channel.unary_stream(METHOD, request_serializer=pb.WorkerGenerateRequest.SerializeToString,
                                response_deserializer=pb.WorkerGenerateResponse.FromString)
    try:
        return await body(lambda: call(pb.WorkerGenerateRequest()))
    finally:
        await channel.close()
        await server.stop(0)


def test_a_quiet_stream_fails_once_its_worker_stops_reporting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch, "_WATCH_S", 0.2)

    async def body(start):  # type: ignore[no-untyped-def]
        decode, got = Decode(), []
        loop = asyncio.get_running_loop()
        with pytest.raises(dispatch._WorkerFailed) as failed:
            async for msg in dispatch._watched(start(), decode):
                got.append(list(msg.token_ids))
                decode.alive = False  # its reports stop right after the token
                quiet_from = loop.time()
        return got, failed.value, loop.time() - quiet_from

    got, failed, waited = asyncio.run(with_server(body))
    assert got == [[7]]
    assert failed.retryable and failed.error.code == "worker_unresponsive"
    assert "d0 stopped answering" in failed.error.message
    assert 0.2 <= waited < 2.0  # one or two watchdog rounds, not a hang


def test_a_quiet_stream_of_a_live_worker_waits_and_its_callers_cancel_stays_a_cancel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch, "_WATCH_S", 0.05)

    async def body(start):  # type: ignore[no-untyped-def]
        first = asyncio.Event()

        async def consume() -> None:
            async for _ in dispatch._watched(start(), Decode()):
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        await asyncio.sleep(0.5)  # ten watchdog rounds of quiet
        waiting = not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return waiting

    assert asyncio.run(with_server(body)), "the stream of a live worker gave up"
