"""The PrefixIndex contract against a real redis-server on a free loopback
port, plus what only Redis has: TTL keys, outages, restarts, model prefixes."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from typing import cast

import pytest
import redis

from services.index import IndexUnavailable, PrefixIndex
from services.index.redis_index import RedisPrefixIndex
from tests.unit.test_prefix_index import TTL_S, H, PrefixIndexContract, stored

from .procs import free_port

# Generous for a shared 2-core CI machine; production default is 5 ms.
LOOKUP_TIMEOUT_S = 0.02


class RedisServer:
    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.1)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {self.port} did not start") from None
                time.sleep(0.02)
        client.close()
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    srv = RedisServer().start()
    yield srv
    srv.stop()


def make_index(srv: RedisServer, model_id: str | None = None) -> RedisPrefixIndex:
    return RedisPrefixIndex(srv.url, model_id or f"model-{uuid.uuid4().hex[:8]}",
                            lookup_timeout_s=LOOKUP_TIMEOUT_S, sweep_interval_s=0.0)


class TestRedisPrefixIndex(PrefixIndexContract):
    @pytest.fixture
    def index(self, server: RedisServer) -> Iterator[PrefixIndex]:
        idx = make_index(server)  # a fresh model id: an empty key space per test
        yield idx
        idx.close()


def model_keys(srv: RedisServer, idx: RedisPrefixIndex) -> set[bytes]:
    client = redis.Redis(port=srv.port)
    try:
        return set(cast("list[bytes]", client.keys(idx.prefix + b"*")))
    finally:
        client.close()


def test_heartbeat_is_a_ttl_key(server: RedisServer) -> None:
    idx = make_index(server)
    idx.heartbeat("p0", 0.2)
    client = redis.Redis(port=server.port)
    assert 0 < client.pttl(idx.prefix + b"alive:p0") <= 200
    client.close()
    idx.apply("p0", [stored(*H)])
    assert idx.longest_prefix(H) == {"p0": 4}
    time.sleep(0.3)
    assert idx.longest_prefix(H) == {}  # the key expired: no sweep needed to stop counting
    idx.close()


def test_cleanup_leaves_no_block_keys(server: RedisServer) -> None:
    idx = make_index(server)
    idx.heartbeat("p0", TTL_S)
    idx.heartbeat("p1", 0.05)
    idx.apply("p0", [stored(*H)])
    idx.apply("p1", [stored(*H)])
    idx.remove_worker("p0")
    time.sleep(0.1)
    idx.heartbeat("p2", TTL_S)  # sweeps p1
    assert model_keys(server, idx) == {idx.prefix + b"alive:p2", idx.prefix + b"workers"}
    idx.close()


def test_models_do_not_collide(server: RedisServer) -> None:
    a, b = make_index(server, "model-a"), make_index(server, "model-b")
    a.heartbeat("p0", TTL_S)
    a.apply("p0", [stored(*H)])
    assert a.longest_prefix(H) == {"p0": 4}
    assert b.longest_prefix(H) == {}
    b.heartbeat("p0", TTL_S)  # same worker id, other model: still nothing
    assert b.longest_prefix(H) == {}
    b.remove_worker("p0")
    assert a.longest_prefix(H) == {"p0": 4}
    assert all(k.startswith(b"splitserve:{model-a}:") for k in model_keys(server, a))
    a.close()
    b.close()


def assert_unavailable_fast(fn: object) -> None:
    t0 = time.monotonic()
    with pytest.raises(IndexUnavailable):
        fn()  # type: ignore[operator]
    assert time.monotonic() - t0 < 0.1


def test_redis_down_then_back() -> None:
    srv = RedisServer().start()  # its own server: this test stops it
    idx = make_index(srv)
    try:
        idx.heartbeat("p0", TTL_S)
        idx.apply("p0", [stored(*H)])
        assert idx.longest_prefix(H) == {"p0": 4}
        srv.stop()
        for _ in range(3):
            assert_unavailable_fast(lambda: idx.longest_prefix(H))
        with pytest.raises(IndexUnavailable):
            idx.apply("p0", [stored(*H)])
        with pytest.raises(IndexUnavailable):
            idx.heartbeat("p0", TTL_S)
        srv.start()  # same port, empty (no persistence); the same index object reconnects
        assert idx.longest_prefix(H) == {}
        idx.heartbeat("p0", TTL_S)
        idx.apply("p0", [stored(*H[:2])])
        assert idx.longest_prefix(H) == {"p0": 2}
    finally:
        idx.close()
        srv.stop()


def test_redis_hung_times_out_fast() -> None:
    srv = RedisServer().start()
    idx = make_index(srv)
    try:
        idx.heartbeat("p0", TTL_S)
        idx.apply("p0", [stored(*H)])
        assert srv.proc is not None
        os.kill(srv.proc.pid, signal.SIGSTOP)  # accepts connections, never answers
        try:
            assert_unavailable_fast(lambda: idx.longest_prefix(H))
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        assert idx.longest_prefix(H) == {"p0": 4}
    finally:
        idx.close()
        srv.stop()
