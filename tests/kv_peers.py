"""KV transports in child processes, driven from the parent: the integration
tests and the benchmark use it to run real UCX between real processes.

A PeerProcess is a spawned process with one asyncio loop, one ucxx context and
one KVTransport per named cache (filled with seeded random values).  The parent
sends commands over a pipe; each runs as a task in the child, so a slow one
(a stalled send) does not hold up the others.  The parent never imports ucxx.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvtransfer import wire
from kvtransfer.layout import KVLayout
from kvtransfer.sender import SendFault
from kvtransfer.transport import KVTransport
from kvtransfer.ucx_env import shutdown_ucx


@dataclass(frozen=True)
class CacheSpec:
    dtype: str = "float32"
    num_blocks: int = 128
    num_layers: int = 4
    block_size: int = 16
    num_kv_heads: int = 2
    head_dim: int = 64
    model_id: str = "test-model"
    seed: int = 0  # different seeds give different contents, so a wrong write shows

    def layout(self) -> KVLayout:
        return KVLayout(self.model_id, self.dtype, self.dtype, self.block_size, self.num_layers,
                        self.num_kv_heads, self.head_dim)


def make_cache(spec: CacheSpec) -> torch.Tensor:
    shape = (spec.num_blocks, spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
    g = torch.Generator().manual_seed(spec.seed)
    return torch.randn(shape, generator=g).to(getattr(torch, spec.dtype))


def block_digests(kv_cache: torch.Tensor) -> list[str]:
    raw = kv_cache.view(kv_cache.shape[0], -1).view(torch.uint8).cpu().numpy()
    return [hashlib.blake2b(row.tobytes(), digest_size=16).hexdigest() for row in raw]


class PeerError(Exception):
    """A command failed in the child; `type_name` is the exception's class name there."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.message = message


class PeerProcess:
    def __init__(self, caches: dict[str, CacheSpec], options: dict[str, dict[str, Any]] | None = None,
                 **default_options: Any) -> None:
        """caches: transport name -> its cache.  KVTransport keyword arguments: default_options
        for every transport, updated by options[name] for that one."""
        per_name = {name: {**default_options, **(options or {}).get(name, {})} for name in caches}
        ctx = mp.get_context("spawn")  # a fork would share the parent's UCX and torch threads
        self._conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=_child_main, args=(child_conn, caches, per_name), daemon=True)
        self.process.start()
        child_conn.close()
        self._next_id = 0
        self._results: dict[int, tuple[bool, Any]] = {}
        self.addresses: dict[str, str] = {}

    def wait_ready(self, timeout: float = 60.0) -> dict[str, str]:
        ok, value = self._wait_for(0, timeout)
        if not ok:
            raise PeerError(*value)
        self.addresses = value
        return value

    def submit(self, cmd: str, *args: Any) -> int:
        self._next_id += 1
        self._conn.send((self._next_id, cmd, args))
        return self._next_id

    def result(self, req_id: int, timeout: float = 10.0) -> Any:
        ok, value = self._wait_for(req_id, timeout)
        if not ok:
            raise PeerError(*value)
        return value

    def call(self, cmd: str, *args: Any, timeout: float = 10.0) -> Any:
        return self.result(self.submit(cmd, *args), timeout)

    def kill(self) -> None:
        if self.process.pid is not None and self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(5)

    def request_stop(self) -> None:
        """Ask the child to close its transports and exit; stop() waits for it."""
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self._conn.send((-1, "stop", ()))

    def stop(self, timeout: float = 10.0) -> None:
        self.request_stop()
        self.process.join(timeout)
        if self.process.is_alive():
            self.kill()
        self._conn.close()

    def _wait_for(self, req_id: int, timeout: float) -> tuple[bool, Any]:
        deadline = time.monotonic() + timeout
        while req_id not in self._results:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"peer process gave no answer to request {req_id} in {timeout}s")
            try:
                if self._conn.poll(min(remaining, 0.5)):
                    rid, ok, value = self._conn.recv()
                    self._results[rid] = (ok, value)
                elif not self.process.is_alive():
                    raise RuntimeError(f"peer process exited with code {self.process.exitcode}")
            except EOFError as e:
                raise RuntimeError(f"peer process exited with code {self.process.exitcode}") from e
        return self._results.pop(req_id)


def _child_main(conn: Connection, caches: dict[str, CacheSpec], options: dict[str, dict[str, Any]]) -> None:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format="%(process)d %(name)s %(levelname)s %(message)s")
    asyncio.run(_child(conn, caches, options))


async def _child(conn: Connection, caches: dict[str, CacheSpec], options: dict[str, dict[str, Any]]) -> None:
    kv = {name: make_cache(spec) for name, spec in caches.items()}
    transports = {name: KVTransport(kv[name], spec.layout(), **options[name])
                  for name, spec in caches.items()}
    try:
        for t in transports.values():
            await t.start()
    except Exception as e:
        conn.send((0, False, (type(e).__name__, str(e))))
        return
    conn.send((0, True, {name: t.address for name, t in transports.items()}))
    futures: dict[str, asyncio.Future[int]] = {}

    async def expect(name: str, tid: str, ids: list[int], timeout_s: float | None = None) -> bytes:
        """-> the transfer's token, for the sender's `send`."""
        token = wire.new_transfer_token()
        futures[tid] = transports[name].expect(tid, ids, timeout_s, token=token)
        return token

    async def wait(tid: str, timeout_s: float) -> int:
        fut = futures[tid]
        done, _ = await asyncio.wait({fut}, timeout=timeout_s)  # never cancels fut
        if not done:
            raise TimeoutError(f"transfer {tid!r} still pending after {timeout_s}s")
        return fut.result()

    async def cancel(name: str, tid: str) -> float:
        start = time.monotonic()
        await transports[name].cancel(tid)
        return time.monotonic() - start

    async def send(name: str, peer: str, tid: str, src: list[int], dst: list[int],
                   token: bytes = b"") -> tuple[int, float]:
        start = time.monotonic()
        nbytes = await transports[name].send(peer, tid, src, dst, token)
        return nbytes, time.monotonic() - start

    async def digests(name: str) -> list[str]:
        return block_digests(kv[name])

    async def fault(name: str, fault: SendFault | None) -> None:
        transports[name].fault = fault

    async def stats(name: str) -> dict[str, Any]:
        return dataclasses.asdict(transports[name].stats)

    handlers: dict[str, Callable[..., Coroutine[Any, Any, Any]]] = {
        "expect": expect, "wait": wait, "cancel": cancel, "send": send, "digests": digests,
        "fault": fault, "stats": stats}
    inbox: asyncio.Queue[tuple[int, str, tuple[Any, ...]]] = asyncio.Queue()
    loop = asyncio.get_running_loop()

    def on_readable() -> None:
        try:
            inbox.put_nowait(conn.recv())
        except (EOFError, OSError):  # the parent is gone
            loop.remove_reader(conn.fileno())
            inbox.put_nowait((-1, "stop", ()))

    async def run(req_id: int, cmd: str, args: tuple[Any, ...]) -> None:
        try:
            reply = (req_id, True, await handlers[cmd](*args))
        except Exception as e:
            reply = (req_id, False, (type(e).__name__, str(e)))
        with contextlib.suppress(OSError):
            conn.send(reply)

    loop.add_reader(conn.fileno(), on_readable)
    running: set[asyncio.Task[None]] = set()
    while True:
        req_id, cmd, args = await inbox.get()
        if cmd == "stop":
            break
        task = asyncio.ensure_future(run(req_id, cmd, args))
        running.add(task)
        task.add_done_callback(running.discard)
    loop.remove_reader(conn.fileno())
    for t in transports.values():
        await t.close()
    for task in running:
        task.cancel()
    shutdown_ucx()
