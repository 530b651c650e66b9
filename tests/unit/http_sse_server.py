"""A small HTTP/1.1 server on a local socket for the load generator's tests:
each POST's JSON body goes to a handler, which answers with an async iterator
of byte pieces (streamed as chunks, each written as it comes) or with
(status, body) (sent with a Content-Length).  Connections stay open for the
next request unless `close_after` says otherwise: with a `Connection: close`
header, or, `silent`, without one (the next request on it is read and the
connection closed unanswered, as a server dropping an idle connection does
when the request crosses the close)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

Reply = AsyncIterator[bytes] | tuple[int, bytes]


@dataclass
class ServerLog:
    connections: int = 0
    requests: list[tuple[str, dict[str, str]]] = field(default_factory=list)  # (path, headers)


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, dict[str, str], bytes] | None:
    line = await reader.readline()
    if not line:
        return None
    path = line.split()[1].decode()
    headers: dict[str, str] = {}
    while (h := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = h.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    return path, headers, await reader.readexactly(int(headers.get("content-length", "0")))


@contextlib.asynccontextmanager
async def serve_sse(handler: Callable[[Any], Reply | Awaitable[Reply]], close_after: bool = False,
                    silent: bool = False, log: ServerLog | None = None) -> AsyncIterator[str]:
    """Yields the server's base URL (http://127.0.0.1:PORT)."""
    log = log or ServerLog()

    async def conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        log.connections += 1
        try:
            answered = 0
            while (req := await _read_request(reader)) is not None:
                if silent and answered:
                    break
                answered += 1
                path, headers, body = req
                log.requests.append((path, headers))
                reply = handler(json.loads(body))
                if isinstance(reply, Awaitable):
                    reply = await reply
                closing = b"Connection: close\r\n" if close_after and not silent else b""
                if isinstance(reply, tuple):
                    status, data = reply
                    writer.write(b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n%s\r\n%s"
                                 % (status, len(data), closing, data))
                else:
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                                 b"Transfer-Encoding: chunked\r\n%s\r\n" % closing)
                    async for piece in reply:
                        writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                        await writer.drain()
                    writer.write(b"0\r\n\r\n")
                await writer.drain()
                if close_after and not silent:
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client dropped the connection mid-stream
        finally:
            writer.close()

    server = await asyncio.start_server(conn, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(server.wait_closed(), 1)
