"""The load generator's HTTP/1.1 client (benchmarks/http_stream.py) against a
real server on a local socket: streamed chunks as they come, whole bodies,
kept and replaced connections, and what a broken server gets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from benchmarks.http_stream import HTTPStreamError, StreamClient
from tests.unit.http_sse_server import ServerLog, serve_sse


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_lines_arrive_while_the_response_streams() -> None:
    # The handler sends its second piece only after the client has read the
    # first line: a client that buffered the body would wait forever.
    seen = asyncio.Event()

    async def handler(body: dict) -> AsyncIterator[bytes]:  # type: ignore[type-arg]
        yield b"data: one\n\nda"  # a line split across two chunks, and two lines in one
        await seen.wait()
        yield b"ta: two\n\n"

    async def main() -> list[str]:
        async with serve_sse(handler) as url:
            client = StreamClient(url)
            resp = await client.post("/v1/completions", {"x": 1})
            lines = []
            async for line in resp.lines():
                lines.append(line)
                seen.set()
            resp.close()
            await client.aclose()
            return lines

    assert run(main()) == ["data: one", "", "data: two", ""]


def test_whole_body_status_and_headers_sent() -> None:
    log = ServerLog()

    def handler(body: dict) -> tuple[int, bytes]:  # type: ignore[type-arg]
        return 400, b'{"error": "bad field %s"}' % body["field"].encode()

    async def main() -> tuple[int, bytes]:
        async with serve_sse(handler, log=log) as url:
            client = StreamClient(url + "/base", headers={"Authorization": "Bearer k"})
            resp = await client.post("/v1/chat/completions", {"field": "n"})
            out = resp.status, await resp.read()
            resp.close()
            await client.aclose()
            return out

    assert run(main()) == (400, b'{"error": "bad field n"}')
    path, headers = log.requests[0]
    assert path == "/v1/chat/completions" and headers["authorization"] == "Bearer k"
    assert headers["content-type"] == "application/json" and headers["host"].startswith("127.0.0.1:")


@pytest.mark.parametrize("close_after,silent,connections", [
    (False, False, 1),  # kept alive: one connection for both
    (True, False, 2),  # Connection: close: a new one
    (True, True, 2),  # dropped unanswered: the request goes out again on a new one
])
def test_connections_are_kept_or_replaced(close_after: bool, silent: bool, connections: int) -> None:
    log = ServerLog()

    async def handler(body: dict) -> AsyncIterator[bytes]:  # type: ignore[type-arg]
        yield b"data: %d\n\n" % body["i"]

    async def main() -> list[str]:
        async with serve_sse(handler, close_after=close_after, silent=silent, log=log) as url:
            client = StreamClient(url)
            got = []
            for i in range(2):
                resp = await client.post("/", {"i": i})
                got += [line async for line in resp.lines() if line]
                resp.close()
                assert len(client._idle) == (0 if close_after and not silent else 1)
            await client.aclose()
            return got

    assert run(main()) == ["data: 0", "data: 1"]
    assert log.connections == connections and len(log.requests) == 2  # the dropped one unanswered


def test_a_broken_chunk_size_is_an_error() -> None:
    async def main() -> None:
        async def conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(2)  # the body: {}
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
            await writer.drain()

        server = await asyncio.start_server(conn, "127.0.0.1", 0)
        client = StreamClient(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        resp = await client.post("/", {})
        with pytest.raises(HTTPStreamError, match="bad chunk size"):
            await resp.read()
        resp.close()
        server.close()

    run(main())


def test_not_http_urls_are_refused() -> None:
    with pytest.raises(ValueError, match="not an http"):
        StreamClient("ftp://x/")
