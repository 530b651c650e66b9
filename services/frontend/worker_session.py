"""This frontend's Session call to one decode worker (services/decode/session.py
is the other end): every request to that worker is a stream on it, read and
cancelled as a Generate call is, so the dispatcher treats both alike.

A step's outputs for all of this frontend's requests arrive in one message; a
broken call (the worker died, or its channel closed) ends every stream on it
with the call's error, as each of their own calls would have ended, and the
next request opens a new call.  A worker without Session (an older version
during a rolling update) answers UNIMPLEMENTED before anything else: the
stream then runs as a Generate call, and so do later ones to that worker."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

import grpc

from protos import pb

log = logging.getLogger("splitserve.frontend.worker_session")

_CODES = {c.value[0]: c for c in grpc.StatusCode}
SESSION_MAX_REQUEST_BYTES = 1 << 20
_Item = pb.WorkerGenerateResponse | BaseException | object


class WorkerStream(Protocol):
    """What the dispatcher reads a request's worker stream through: a stream on a
    session or a Generate call.  read() -> a message or grpc.aio.EOF; raises the
    status the stream ended with (grpc.aio.AioRpcError), or CancelledError once
    cancel() was called."""

    async def read(self) -> Any: ...

    def cancel(self) -> Any: ...


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error a stream ends with, as a Generate call would raise it."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class WorkerSession:
    def __init__(self, stub: Any) -> None:
        self._call = stub.Session()
        self._streams: dict[str, asyncio.Queue[_Item]] = {}
        self._outbox: asyncio.Queue[pb.SessionRequest] = asyncio.Queue()
        self.broken: grpc.aio.AioRpcError | None = None
        self._reader = asyncio.create_task(self._read(), name="session-read")
        self._writer = asyncio.create_task(self._write(), name="session-write")

    def open(self, request: pb.WorkerGenerateRequest,
             metadata: list[tuple[str, str]] | None) -> SessionStream:
        q: asyncio.Queue[_Item] = asyncio.Queue()
        self._streams[request.request_id] = q
        self._outbox.put_nowait(pb.SessionRequest(start=pb.SessionStart(
            request=request, metadata=dict(metadata or ()))))
        return SessionStream(self, request.request_id, q)

    def has(self, request_id: str) -> bool:
        return request_id in self._streams

    def cancel(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None and self.broken is None:
            self._outbox.put_nowait(pb.SessionRequest(cancel=request_id))

    def close(self) -> None:
        self._call.cancel()
        self._reader.cancel()
        self._writer.cancel()

    async def _write(self) -> None:
        while True:
            msg = await self._outbox.get()
            try:
                await self._call.write(msg)
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
                return  # the call is over: the reader ends the streams with its status

    async def _read(self) -> None:
        err = rpc_error(grpc.StatusCode.UNAVAILABLE, "worker: the session ended")
        try:
            while True:
                resp = await self._call.read()
                if resp is grpc.aio.EOF:
                    break
                for item in resp.items:
                    q = self._streams.get(item.request_id)
                    if q is None:  # cancelled here: what was already on the way is dropped
                        continue
                    if item.HasField("response"):
                        q.put_nowait(item.response)
                        continue
                    del self._streams[item.request_id]
                    code = _CODES.get(item.code, grpc.StatusCode.UNKNOWN)
                    ok = code == grpc.StatusCode.OK
                    q.put_nowait(grpc.aio.EOF if ok else rpc_error(code, item.details))
        except grpc.aio.AioRpcError as e:
            err = e
        except asyncio.CancelledError:
            err = rpc_error(grpc.StatusCode.CANCELLED, "frontend: the session was closed")
        finally:
            self.broken = err
            streams, self._streams = self._streams, {}
            for q in streams.values():
                q.put_nowait(err)
            self._writer.cancel()


class SessionStream:
    """One request on a session, read and cancelled as a Generate call is."""

    def __init__(self, session: WorkerSession, request_id: str, q: asyncio.Queue[_Item]) -> None:
        self._session = session
        self._request_id = request_id
        self._q = q
        self._done = False

    async def read(self) -> Any:
        item = await self._q.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item is grpc.aio.EOF:
            self._done = True
        return item

    def cancel(self) -> None:
        if not self._done:
            self._done = True
            self._session.cancel(self._request_id)
            self._q.put_nowait(asyncio.CancelledError())  # a pending read ends, as a cancelled call's does


class DecodeStreams:
    """A decode worker's streams: on its session, or Generate calls where it has none."""

    def __init__(self, stub: Any) -> None:
        self._stub = stub
        self._session: WorkerSession | None = None
        self._sessions_work = True

    def open(self, request: pb.WorkerGenerateRequest, metadata: list[tuple[str, str]] | None) -> WorkerStream:
        # A request past the worker's message limit (4 MiB) would end the whole
        # call, every stream on it: a big one goes alone, as its own Generate call.
        if not self._sessions_work or request.ByteSize() > SESSION_MAX_REQUEST_BYTES:
            return self._stub.Generate(request, metadata=metadata)
        if self._session is None or self._session.broken is not None:
            self._session = WorkerSession(self._stub)
        if self._session.has(request.request_id):  # ids are unique; a second one is refused on its own call
            return self._stub.Generate(request, metadata=metadata)
        return _FallBack(self, self._session.open(request, metadata), request, metadata)

    def generate_only(self) -> None:
        if self._sessions_work:
            log.warning("decode worker has no Session RPC (an older version): one Generate call per request")
        self._sessions_work = False

    def close(self) -> None:
        if self._session is not None:
            self._session.close()


class _FallBack:
    """A session stream that turns into a Generate call if the worker has no Session."""

    def __init__(self, streams: DecodeStreams, stream: SessionStream, request: pb.WorkerGenerateRequest,
                 metadata: list[tuple[str, str]] | None) -> None:
        self._streams = streams
        self._call: WorkerStream = stream
        self._request = request
        self._metadata = metadata
        self._first = True

    async def read(self) -> Any:
        if not self._first:
            return await self._call.read()
        try:
            msg = await self._call.read()
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            self._streams.generate_only()
            self._call = self._streams.open(self._request, self._metadata)
            msg = await self._call.read()
        self._first = False
        return msg

    def cancel(self) -> None:
        self._call.cancel()
