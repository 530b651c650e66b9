"""Redis is data, not authority (issue 14, acceptance 2): registrations written
by someone without the cluster token, for another model or role, or that are
not even UTF-8, never receive a request; the frontend's and the workers'
discovery survive them and keep serving with the real worker."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
import redis

from engine.vocab.models import model_id
from protos import pb, pb_grpc
from services.cluster_auth import ENV, sync_channel
from services.discovery import read_registrations, registration_prefix, registration_value
from services.kv_layout import layout_from_proto

from .procs import FrontendProc, Listener, start_worker
from .test_prefix_index_redis import RedisServer

pytestmark = pytest.mark.timeout(300)

TOKEN = "redis-test-token-0123456789"
MODEL = "SmolLM2-135M-Instruct"
MODEL_ID = model_id(None)  # name + weights digest: what workers and the frontend register under


def plant(client: redis.Redis, role: str, worker_id: bytes, value: bytes) -> None:
    members = registration_prefix(MODEL_ID) + role
    client.set(members.encode() + b":" + worker_id, value, px=600_000)
    client.sadd(members, worker_id)


def test_rogue_registrations_never_receive_a_request(redis_server: RedisServer, tmp_path: Path) -> None:
    env = {ENV: TOKEN}
    rogue = Listener()
    client = redis.Redis.from_url(redis_server.url)
    d0 = start_worker("decode", "d0", tmp_path, "--num-blocks", "64", "--redis-url", redis_server.url,
                      env=env)
    fe = FrontendProc(tmp_path, "frontend", "--redis-url", redis_server.url, "--discovery-interval", "0.2",
                      env=env)
    try:
        address = d0.wait_ready()
        info = pb_grpc.DecodeStub(sync_channel(address, TOKEN)).Info(pb.InfoRequest(), timeout=10)
        layout = layout_from_proto(info.layout).to_dict()  # every field, as a registration has them
        for role in ("decode", "prefill"):  # the frontend reads both; the decode worker reads prefill
            unsigned = registration_value(MODEL_ID, role, "x", rogue.address, layout, None)
            forged = registration_value(MODEL_ID, role, "x", rogue.address, layout, "guess")
            plant(client, role, b"unsigned", unsigned)
            plant(client, role, b"forged", forged)
            plant(client, role, b"not-utf8", b"\xff\xfe\x80 not UTF-8")
            plant(client, role, b"\xff\xfe-id", b"\x80")
            plant(client, role, b"plain", rogue.address.encode())  # the old form
        # signed with the real token, but for another role / layout: refused all the same
        for role, worker_id, value in (
                ("decode", b"other-role",
                 registration_value(MODEL_ID, "prefill", "x", rogue.address, layout, TOKEN)),
                ("decode", b"other-model-layout", registration_value(MODEL_ID, "decode", "x", rogue.address,
                                                                     {**layout, "num_layers": 2}, TOKEN)),
                ("prefill", b"other-layout", registration_value(MODEL_ID, "prefill", "x", rogue.address,
                                                                {**layout, "num_layers": 2}, TOKEN))):
            plant(client, role, worker_id, value)

        found = asyncio.run(_read(redis_server.url, layout))
        assert found == {"decode": {address}, "prefill": set()}

        deadline = time.monotonic() + 120
        while fe.health() != 200:
            assert time.monotonic() < deadline, fe.tail()
            time.sleep(0.1)
        # the block size is a worker flag: checked against the workers already serving
        plant(client, "decode", b"other-block-size", registration_value(
            MODEL_ID, "decode", "x", rogue.address, {**layout, "block_size": 32}, TOKEN))
        refused = "reg:decode:other-block-size': layout"
        while refused not in fe.tail(100_000):
            assert time.monotonic() < deadline, fe.tail()
            time.sleep(0.1)
        for i in range(6):
            r = httpx.post(f"{fe.url}/v1/completions", timeout=120,
                           json={"model": MODEL, "prompt": f"Count to {i}:", "max_tokens": 3})
            assert r.status_code == 200, r.text
        workers = httpx.get(f"{fe.url}/cluster", timeout=10).json()["workers"]
        assert [w["address"] for w in workers] == [address]
        assert not rogue.connected(within=0.5), "a rogue registration received a connection"
        assert "refused the registration" in fe.tail(100_000)
        assert "refused the registration" in d0.tail(100_000)
        assert fe.popen.poll() is None and d0.popen.poll() is None  # both discovery tasks survived
    finally:
        fe.stop()
        d0.stop()
        client.close()
        rogue.close()


async def _read(url: str, layout: dict[str, object]) -> dict[str, set[str]]:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url)
    try:
        return await read_registrations(client, MODEL_ID, TOKEN, layout)
    finally:
        await client.aclose()
