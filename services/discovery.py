"""Workers and frontends find each other through Redis (the compose cluster):
no worker address is configured anywhere.

Keys, next to the prefix index's under `splitserve:{<model_id>}:` (one model's
workers serve one frontend's tokenizer):

    reg:<role>               SET   ids of the workers of that role that registered
    reg:<role>:<worker id>   STR   the worker's advertised gRPC address, with a TTL

A worker (`Registration`) sets its key every `interval` seconds with a TTL of
three intervals, and deletes it when it stops; a key that expired means the
worker is gone.  A frontend (`Discovery`) reads both roles every `interval` and
adds and retires workers in its pool to match.  While Redis is unreachable the
worker keeps trying and the frontend keeps the workers it has.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError

if TYPE_CHECKING:
    from services.frontend.workers import WorkerPool

log = logging.getLogger("splitserve.discovery")
ROLES = ("decode", "prefill")
_TIMEOUT_S = 1.0


def registration_prefix(model_id: str) -> str:
    return f"splitserve:{{{model_id}}}:reg:"


def _client(url: str) -> aioredis.Redis:
    return aioredis.Redis.from_url(url, socket_timeout=_TIMEOUT_S, socket_connect_timeout=_TIMEOUT_S,
                                   decode_responses=True)


class Registration:
    """A worker's entry: refreshed until stop(), then deleted."""

    def __init__(self, url: str, model_id: str, role: str, worker_id: str, address: str,
                 interval: float = 1.0) -> None:
        self.redis = _client(url)
        self.members = registration_prefix(model_id) + role
        self.key = f"{self.members}:{worker_id}"
        self.worker_id = worker_id
        self.address = address
        self.interval = interval
        self._task: asyncio.Task[None] | None = None

    async def register(self) -> None:
        """One refresh; raises RedisError or OSError."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.key, self.address, px=round(3 * self.interval * 1000))
        pipe.sadd(self.members, self.worker_id)
        await pipe.execute()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="registration")

    async def _run(self) -> None:
        up: bool | None = None
        while True:
            try:
                await self.register()
                if not up:
                    log.info("registered %s at %s in Redis", self.worker_id, self.address)
                up = True
            except (RedisError, OSError) as e:
                if up is not False:
                    log.warning("cannot register in Redis (retrying every %.1f s): %s", self.interval, e)
                up = False
            await asyncio.sleep(self.interval)

    async def stop(self) -> None:
        """Deregister at once, so that frontends stop routing here before the server stops."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.delete(self.key)
            pipe.srem(self.members, self.worker_id)
            await pipe.execute()
        except (RedisError, OSError) as e:
            log.warning("could not deregister (the entry expires by itself): %s", e)
        await self.redis.aclose()


async def read_registrations(redis: aioredis.Redis, model_id: str) -> dict[str, set[str]]:
    """role -> addresses of the live registered workers.  Drops expired ids from the sets."""
    prefix = registration_prefix(model_id)
    out: dict[str, set[str]] = {}
    for role in ROLES:
        members = prefix + role
        # decode_responses=True: members and values come back as str.
        ids = sorted(cast("set[str]", await redis.smembers(members)))
        addresses = cast("list[str | None]", await redis.mget([f"{members}:{i}" for i in ids]) if ids else [])
        gone = [i for i, a in zip(ids, addresses, strict=True) if a is None]
        if gone:
            await redis.srem(members, *gone)
        out[role] = {a for a in addresses if a}
    return out


class Discovery:
    """Keeps a frontend's WorkerPool equal to the workers registered in Redis."""

    def __init__(self, url: str, model_id: str, pool: WorkerPool, interval: float = 1.0) -> None:
        self.redis = _client(url)
        self.model_id = model_id
        self.pool = pool
        self.interval = interval
        self._task: asyncio.Task[None] | None = None
        self._up: bool | None = None

    async def refresh(self) -> bool:
        """One read; False when Redis could not be read (the pool is left as it is)."""
        try:
            found = await read_registrations(self.redis, self.model_id)
        except (RedisError, OSError) as e:
            if self._up is not False:
                log.warning("cannot read worker registrations from Redis (keeping %d workers): %s",
                            len(self.pool.all), e)
            self._up = False
            return False
        self._up = True
        for role in ROLES:
            self.pool.sync(role, found[role])  # type: ignore[arg-type]
        return True

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="discovery")

    async def _run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.interval)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.redis.aclose()
