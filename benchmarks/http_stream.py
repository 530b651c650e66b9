"""The load generator's HTTP/1.1 client: POSTs whose responses are read as
they stream, over asyncio's own streams, connections kept alive for the next
request.

On a small machine the load generator shares the cores with the server it
measures, so what it spends on a chunk is taken from the server.  httpx
(through httpcore, anyio and h11) spent about 150 us of CPU a streamed chunk;
this client reads a chunk with two buffered reads and one split (Zen 4, the
decode32 workload: benchmarks/README.md).  It speaks only what a streamed
completion needs: a Content-Length or chunked body, or one read to the
connection's end."""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import urlsplit

_Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class HTTPStreamError(ConnectionError):
    """The server broke HTTP/1.1 or the connection."""


class StreamResponse:
    """One response: its status, then its body as lines (lines()) or whole (read())."""

    def __init__(self, client: StreamClient, conn: _Conn, status: int, headers: dict[str, str]) -> None:
        self.status = status
        self.headers = headers
        self._client, self._conn = client, conn
        self._chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        length = headers.get("content-length")
        self._left = int(length) if length is not None and not self._chunked else None
        self._done = False

    async def _pieces(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive."""
        reader = self._conn[0]
        if self._chunked:
            while True:
                size_line = await reader.readline()
                try:
                    size = int(size_line.split(b";", 1)[0], 16)
                except ValueError:
                    raise HTTPStreamError(f"bad chunk size {size_line[:40]!r}") from None
                if size == 0:
                    while (await reader.readline()).strip():  # trailers, then the blank line
                        pass
                    break
                data = await reader.readexactly(size + 2)
                yield data[:-2]
        elif self._left is not None:
            while self._left > 0:
                data = await reader.read(min(self._left, 65536))
                if not data:
                    raise HTTPStreamError("connection closed inside the body")
                self._left -= len(data)
                yield data
        else:  # to the connection's end, which cannot carry another request
            self.headers["connection"] = "close"
            while data := await reader.read(65536):
                yield data
        self._done = True

    async def lines(self) -> AsyncIterator[str]:
        """The body as text lines (without their newline), each as soon as it ends."""
        tail = b""
        async for piece in self._pieces():
            parts = (tail + piece).split(b"\n")
            tail = parts.pop()
            for part in parts:
                yield part.decode()
        if tail:
            yield tail.decode()

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self._pieces()])

    def close(self) -> None:
        """Back to the pool if the body was read to its end, else the connection is dropped."""
        if self._done and self.headers.get("connection", "").lower() != "close":
            self._client.release(self._conn)
        else:
            self._client.discard(self._conn)


class StreamClient:
    """POSTs to one server (http or https), at most `max_idle` idle connections kept."""

    def __init__(self, url: str, headers: Mapping[str, str] | None = None, max_idle: int = 100) -> None:
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.host, self.tls = u.hostname, u.scheme == "https"
        self.port = u.port or (443 if self.tls else 80)
        self.authority = u.netloc.rpartition("@")[2]
        self.headers = dict(headers or {})
        self.max_idle = max_idle
        self._idle: list[_Conn] = []

    async def _connect(self) -> _Conn:
        return await asyncio.open_connection(self.host, self.port,
                                             ssl=ssl.create_default_context() if self.tls else None)

    def release(self, conn: _Conn) -> None:
        if len(self._idle) < self.max_idle and not conn[0].at_eof():
            self._idle.append(conn)
        else:
            self.discard(conn)

    def discard(self, conn: _Conn) -> None:
        conn[1].close()

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for _, writer in idle:
            writer.close()
        for _, writer in idle:
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def post(self, path: str, body: Any) -> StreamResponse:
        """POST `body` as JSON to `path`; returns once the status and headers are
        in.  A kept connection the server closed meanwhile is replaced once."""
        payload = json.dumps(body).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.authority}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
                + "".join(f"{k}: {v}\r\n" for k, v in self.headers.items()) + "\r\n").encode()
        while self._idle:
            conn = self._idle.pop()
            try:
                return await self._exchange(conn, head + payload)
            except (ConnectionError, asyncio.IncompleteReadError):
                self.discard(conn)  # closed while idle: nothing was answered, so send again
        conn = await self._connect()
        try:
            return await self._exchange(conn, head + payload)
        except BaseException:
            self.discard(conn)
            raise

    async def _exchange(self, conn: _Conn, request: bytes) -> StreamResponse:
        reader, writer = conn
        writer.write(request)
        await writer.drain()
        status_line = await reader.readline()
        if not status_line:
            raise HTTPStreamError("connection closed before the response")
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise HTTPStreamError(f"not an HTTP/1.x response: {status_line[:60]!r}")
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if parts[0] == b"HTTP/1.0" and "connection" not in headers:
            headers["connection"] = "close"
        return StreamResponse(self, conn, int(parts[1]), headers)
