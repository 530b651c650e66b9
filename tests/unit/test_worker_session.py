"""Decode.Session end to end over a real gRPC server on a local port: the
worker's side (services/decode/session.py) runs a Generate the test drives,
the frontend's side (services/frontend/worker_session.py) reads its streams
as Generate calls.  What one step hands to several requests leaves in one
message; each stream ends as its own call would (OK, an abort's status, a
failure); a cancelled stream cancels its request on the worker; a broken call
ends every stream on it; a duplicate request id is refused; a worker without
Session serves the stream as a Generate call."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest

from protos import pb, pb_grpc
from services.decode.session import GenerateSession
from services.frontend.worker_session import SESSION_MAX_REQUEST_BYTES, DecodeStreams


class Worker(pb_grpc.DecodeServicer):
    """Generate yields what the test puts on the request's queue: a response, a
    (code, details) abort, or None to finish; `ended` records each request's end."""

    def __init__(self, with_session: bool = True) -> None:
        self.queues: dict[str, asyncio.Queue[Any]] = {}
        self.started: dict[str, asyncio.Event] = {}
        self.ended: dict[str, str] = {}
        self.metadata: dict[str, dict[str, str]] = {}
        self.responses_sent: list[int] = []  # items per SessionResponse
        self.live: set[str] = set()
        self.with_session = with_session

    def queue(self, request_id: str) -> asyncio.Queue[Any]:
        return self.queues.setdefault(request_id, asyncio.Queue())

    async def Generate(self, request: pb.WorkerGenerateRequest,
                       context: Any) -> AsyncIterator[pb.WorkerGenerateResponse]:
        rid = request.request_id
        if rid in self.live:  # as the engine refuses an id it is running
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request_id: {rid!r} is already running")
        self.live.add(rid)
        self.metadata[rid] = dict(context.invocation_metadata() or ())
        self.started.setdefault(rid, asyncio.Event()).set()
        q = self.queue(rid)
        try:
            while True:
                item = await q.get()
                if item is None:
                    self.ended[rid] = "finished"
                    return
                if isinstance(item, tuple):
                    self.ended[rid] = "aborted"
                    await context.abort(*item)
                if isinstance(item, Exception):
                    self.ended[rid] = "failed"
                    raise item
                yield item
        except asyncio.CancelledError:
            self.ended[rid] = "cancelled"
            raise
        finally:
            self.live.discard(rid)

    async def Session(self, request_iterator: Any, context: Any) -> None:
        if not self.with_session:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        await GenerateSession(self.Generate, Counted(context, self.responses_sent)).run(request_iterator)


class Counted:
    """The call's context, counting the items of each message written."""

    def __init__(self, context: Any, sent: list[int]) -> None:
        self.context, self.sent = context, sent

    async def write(self, msg: pb.SessionResponse) -> None:
        self.sent.append(len(msg.items))
        await self.context.write(msg)


async def serving(worker: Worker, body: Callable[[DecodeStreams], Awaitable[Any]]) -> Any:
    server = grpc.aio.server()
    pb_grpc.add_DecodeServicer_to_server(worker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    streams = DecodeStreams(pb_grpc.DecodeStub(channel))
    try:
        return await asyncio.wait_for(body(streams), 20)
    finally:
        streams.close()
        await channel.close()
        await server.stop(0)


def request(rid: str) -> pb.WorkerGenerateRequest:
    return pb.WorkerGenerateRequest(request_id=rid, prompt_token_ids=[1, 2, 3])


def token(t: int) -> pb.WorkerGenerateResponse:
    return pb.WorkerGenerateResponse(token_ids=[t])


async def started(worker: Worker, *rids: str) -> None:
    for rid in rids:
        await worker.started.setdefault(rid, asyncio.Event()).wait()


def test_a_steps_outputs_leave_in_one_message_and_each_stream_ends_ok() -> None:
    worker = Worker()

    async def body(streams: DecodeStreams) -> Any:
        calls = {rid: streams.open(request(rid), [("traceparent", f"tp-{rid}")]) for rid in ("a", "b", "c")}
        await started(worker, "a", "b", "c")
        for rid, t in (("a", 1), ("b", 2), ("c", 3)):  # one step's outputs, handed over together
            worker.queue(rid).put_nowait(token(t))
        got = {rid: list((await call.read()).token_ids) for rid, call in calls.items()}
        for rid in calls:
            worker.queue(rid).put_nowait(None)
        ends = [await call.read() for call in calls.values()]
        return got, ends

    got, ends = asyncio.run(serving(worker, body))
    assert got == {"a": [1], "b": [2], "c": [3]}
    assert ends == [grpc.aio.EOF] * 3
    assert worker.responses_sent[0] == 3  # the three tokens: one message, not three
    assert worker.ended == {"a": "finished", "b": "finished", "c": "finished"}
    assert worker.metadata["b"] == {"traceparent": "tp-b"}


def test_an_abort_ends_its_stream_with_that_status_and_the_others_go_on() -> None:
    worker = Worker()

    async def body(streams: DecodeStreams) -> Any:
        a, b = streams.open(request("a"), None), streams.open(request("b"), None)
        await started(worker, "a", "b")
        worker.queue("a").put_nowait((grpc.StatusCode.RESOURCE_EXHAUSTED, "no room"))
        worker.queue("b").put_nowait(RuntimeError("engine broke"))
        errs = []
        for call in (a, b):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call.read()
            errs.append((e.value.code(), e.value.details()))
        c = streams.open(request("c"), None)  # the session still serves
        await started(worker, "c")
        worker.queue("c").put_nowait(token(9))
        return errs, list((await c.read()).token_ids)

    errs, tokens = asyncio.run(serving(worker, body))
    assert errs[0] == (grpc.StatusCode.RESOURCE_EXHAUSTED, "no room")
    assert errs[1][0] == grpc.StatusCode.INTERNAL and "engine broke" in errs[1][1]
    assert tokens == [9]


def test_a_cancelled_stream_cancels_its_request_on_the_worker() -> None:
    worker = Worker()

    async def body(streams: DecodeStreams) -> Any:
        a, b = streams.open(request("a"), None), streams.open(request("b"), None)
        await started(worker, "a", "b")
        pending = asyncio.create_task(a.read())
        await asyncio.sleep(0)
        a.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending  # a read in progress ends, as a cancelled call's does
        while "a" not in worker.ended:
            await asyncio.sleep(0.01)
        worker.queue("b").put_nowait(token(4))
        return list((await b.read()).token_ids), dict(worker.ended)

    tokens, ended = asyncio.run(serving(worker, body))
    assert tokens == [4] and ended == {"a": "cancelled"}  # b served on


def test_a_duplicate_request_id_is_refused_and_the_first_runs_on() -> None:
    worker = Worker()

    async def body(streams: DecodeStreams) -> Any:
        call = streams._stub.Session()  # a raw call, as a confused client would make it
        start = pb.SessionRequest(start=pb.SessionStart(request=request("a")))
        await call.write(start)
        await started(worker, "a")
        await call.write(start)
        refused = (await call.read()).items
        worker.queue("a").put_nowait(token(5))
        served = (await call.read()).items
        call.cancel()
        return refused, served

    refused, served = asyncio.run(serving(worker, body))
    assert len(refused) == 1 and refused[0].request_id == "a" and refused[0].end
    assert refused[0].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "already running" in refused[0].details
    assert [(i.request_id, list(i.response.token_ids)) for i in served] == [("a", [5])]


def test_a_broken_session_ends_every_stream_and_the_next_request_opens_another() -> None:
    worker = Worker()

    async def body(streams: DecodeStreams) -> Any:
        a, b = streams.open(request("a"), None), streams.open(request("b"), None)
        await started(worker, "a", "b")
        first = streams._session
        assert first is not None
        first._call.cancel()  # the call breaks (as when the worker's process dies)
        codes = []
        for call in (a, b):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call.read()
            codes.append(e.value.code())
        c = streams.open(request("c"), None)
        await started(worker, "c")
        worker.queue("c").put_nowait(token(6))
        return codes, streams._session is not first, list((await c.read()).token_ids)

    codes, new_session, tokens = asyncio.run(serving(worker, body))
    assert codes == [grpc.StatusCode.CANCELLED] * 2
    assert new_session and tokens == [6]
    assert worker.ended.get("a") == worker.ended.get("b") == "cancelled"


def test_a_worker_without_session_serves_the_stream_as_a_generate_call() -> None:
    worker = Worker(with_session=False)

    async def body(streams: DecodeStreams) -> Any:
        a = streams.open(request("a"), [("traceparent", "tp")])
        worker.queue("a").put_nowait(token(7))
        first = list((await a.read()).token_ids)
        worker.queue("a").put_nowait(None)
        end = await a.read()
        b = streams.open(request("b"), None)  # straight to Generate now
        worker.queue("b").put_nowait(token(8))
        return first, end, list((await b.read()).token_ids), type(b).__name__

    first, end, second, kind = asyncio.run(serving(worker, body))
    assert first == [7] and end == grpc.aio.EOF and second == [8]
    assert kind != "_FallBack"
    assert worker.metadata["a"]["traceparent"] == "tp"
    assert worker.responses_sent == []


def test_a_request_too_big_for_a_session_goes_alone_as_a_generate_call() -> None:
    # Past the worker's message limit a start would end the call and every
    # stream on it; a big request (a long grammar, say) gets its own call.
    worker = Worker()

    async def body(streams: DecodeStreams) -> Any:
        small = streams.open(request("a"), None)
        await started(worker, "a")
        big_request = request("b")
        big_request.sampling.guided.regex = "x" * (SESSION_MAX_REQUEST_BYTES + 1)
        big = streams.open(big_request, None)
        worker.queue("b").put_nowait(token(2))
        worker.queue("a").put_nowait(token(1))
        return type(big).__name__, list((await big.read()).token_ids), list((await small.read()).token_ids)

    kind, big_tokens, small_tokens = asyncio.run(serving(worker, body))
    assert kind != "_FallBack" and big_tokens == [2] and small_tokens == [1]
    assert worker.responses_sent == [1]  # only the small one's token went on the session


def test_a_second_stream_of_an_id_still_open_goes_on_its_own_call_and_is_refused_alone() -> None:
    worker = Worker()

    async def body(streams: DecodeStreams) -> Any:
        first = streams.open(request("a"), None)
        await started(worker, "a")
        second = streams.open(request("a"), None)  # not on the session: its refusal ends only its call
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await second.read()
        worker.queue("a").put_nowait(token(3))
        return refused.value.code(), type(second).__name__, list((await first.read()).token_ids)

    code, kind, got = asyncio.run(serving(worker, body))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and kind != "_FallBack" and got == [3]
