"""Workers and frontends find each other through Redis (the compose cluster):
no worker address is configured anywhere.

Keys, next to the prefix index's under `splitserve:{<model_id>}:` (one model's
workers serve one frontend's tokenizer):

    reg:<role>               SET   ids of the workers of that role that registered
    reg:<role>:<worker id>   STR   the worker's registration (JSON, below), with a TTL

A registration says what the worker is: {"address", "role", "model_id",
"worker_id", "layout"} and, when the cluster has a token, "mac": HMAC-SHA256
of the rest under that token.  Redis is data, not authority (docs/ARCHITECTURE.md): a
reader refuses entries whose MAC, model, role, layout or address do not check
out, and logs and skips malformed ones (non-UTF-8, not JSON) without ever
letting them stop it.

A worker (`Registration`) sets its key every `interval` seconds with a TTL of
three intervals, and deletes it when it stops; a key that expired means the
worker is gone.  A frontend (`Discovery`) reads both roles every `interval` and
adds and retires workers in its pool to match.  While Redis is unreachable the
worker keeps trying and the frontend keeps the workers it has.  A worker whose
entry is gone is retired only once it has been missing for a registration's
TTL: a Redis restarted empty, or one hung past the TTLs, holds no entries
until every worker's next refresh, and that is no reason to drop them all.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.aio_tasks import cancel_and_wait
from services.secret_env import redis_password

if TYPE_CHECKING:
    from collections.abc import Sized

log = logging.getLogger("splitserve.discovery")
ROLES = ("decode", "prefill")
REGISTRATION_INTERVAL_S = 1.0
_TIMEOUT_S = 1.0


def registration_prefix(model_id: str) -> str:
    return f"splitserve:{{{model_id}}}:reg:"


def _client(url: str) -> aioredis.Redis:
    # Bytes, decoded here: a non-UTF-8 value is one bad entry, not an exception in redis-py.
    return aioredis.Redis.from_url(url, socket_timeout=_TIMEOUT_S, socket_connect_timeout=_TIMEOUT_S,
                                   decode_responses=False, password=redis_password())


def _mac(token: str, fields: dict[str, Any]) -> str:
    body = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(token.encode(), body, hashlib.sha256).hexdigest()


def registration_value(model_id: str, role: str, worker_id: str, address: str,
                       layout: dict[str, Any] | None, token: str | None) -> bytes:
    fields: dict[str, Any] = {"address": address, "role": role, "model_id": model_id,
                              "worker_id": worker_id, "layout": layout or {}}
    if token:
        fields["mac"] = _mac(token, fields)
    return json.dumps(fields, separators=(",", ":")).encode()


def model_layout(model_dir: Path, model_id: str) -> dict[str, Any]:
    """The layout fields a model fixes (a frontend checks registrations against them; dtype
    and block size are the workers' flags, checked against the workers already serving)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = cfg.get("num_attention_heads") or 1
    return {"model_id": model_id, "num_layers": cfg.get("num_hidden_layers"),
            "num_kv_heads": cfg.get("num_key_value_heads") or heads,
            "head_dim": cfg.get("head_dim") or cfg.get("hidden_size", 0) // heads}


class InvalidRegistration(ValueError):
    """A registration a reader refuses; the message says why."""


def check_registration(raw: bytes, model_id: str, role: str, token: str | None,
                       layout: dict[str, Any] | None) -> str:
    """The registered gRPC address, or InvalidRegistration naming what is wrong.
    layout: the fields the registration's layout must have (None: unchecked)."""
    try:
        fields = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise InvalidRegistration(f"not UTF-8 JSON: {e}") from None
    if not isinstance(fields, dict):
        raise InvalidRegistration("not a JSON object")
    mac = fields.pop("mac", None)
    if token and not (isinstance(mac, str) and hmac.compare_digest(mac, _mac(token, fields))):
        raise InvalidRegistration("missing or wrong MAC (not signed with this cluster's token)")
    if fields.get("model_id") != model_id:
        raise InvalidRegistration(f"model_id {fields.get('model_id')!r}, expected {model_id!r}")
    if fields.get("role") != role:
        raise InvalidRegistration(f"role {fields.get('role')!r} under the {role} key")
    theirs = fields.get("layout")
    matches = isinstance(theirs, dict) and all(theirs.get(k) == v for k, v in (layout or {}).items())
    if layout is not None and not matches:
        raise InvalidRegistration(f"layout {theirs!r} does not match {layout!r}")
    address = fields.get("address")
    host, sep, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or any(
            c.isspace() or c in "/@?#" for c in host):
        raise InvalidRegistration(f"address {address!r} is not host:port")
    return cast(str, address)


class Registration:
    """A worker's entry: refreshed until stop(), then deleted."""

    def __init__(self, url: str, model_id: str, role: str, worker_id: str, address: str,
                 interval: float = REGISTRATION_INTERVAL_S, *, layout: dict[str, Any] | None = None,
                 token: str | None = None) -> None:
        self.redis = _client(url)
        self.members = registration_prefix(model_id) + role
        self.key = f"{self.members}:{worker_id}"
        self.worker_id = worker_id
        self.address = address
        self.value = registration_value(model_id, role, worker_id, address, layout, token)
        self.interval = interval
        self._task: asyncio.Task[None] | None = None

    async def register(self) -> None:
        """One refresh; raises RedisError or OSError."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.key, self.value, px=round(3 * self.interval * 1000))
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
        await cancel_and_wait(self._task)
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.delete(self.key)
            pipe.srem(self.members, self.worker_id)
            await pipe.execute()
        except (RedisError, OSError) as e:
            log.warning("could not deregister (the entry expires by itself): %s", e)
        await self.redis.aclose()


async def read_registrations(redis: aioredis.Redis, model_id: str, token: str | None = None,
                             layout: dict[str, Any] | None = None,
                             refused: dict[bytes, str] | None = None) -> dict[str, set[str]]:
    """role -> addresses of the live registered workers that check out (check_registration).
    Drops expired ids from the sets; refused entries are logged once per value (in `refused`)."""
    prefix = registration_prefix(model_id)
    seen = refused if refused is not None else {}
    out: dict[str, set[str]] = {}
    for role in ROLES:
        members = prefix + role
        ids = sorted(_bytes(i) for i in await redis.smembers(members))
        keys = [members.encode() + b":" + i for i in ids]
        values = [None if v is None else _bytes(v) for v in (await redis.mget(keys) if ids else [])]
        gone = [i for i, v in zip(ids, values, strict=True) if v is None]
        if gone:
            await redis.srem(members, *gone)
        out[role] = set()
        for key, value in zip(keys, values, strict=True):
            if value is None:
                continue
            try:
                out[role].add(check_registration(value, model_id, role, token, layout))
            except InvalidRegistration as e:
                if seen.get(value) is None:
                    log.warning("refused the registration at %r: %s", key, e)
                seen[value] = str(e)
    return out


def _bytes(value: bytes | str) -> bytes:
    """Whatever the client's decode_responses, the reader sees bytes and decodes them itself."""
    return value.encode() if isinstance(value, str) else bytes(value)


class PeerSet(Protocol):
    """What Discovery keeps in step with Redis: a frontend's WorkerPool, a worker's KnownPeers."""

    @property
    def all(self) -> Sized: ...

    def sync(self, role: Any, addresses: set[str]) -> None: ...


class Discovery:
    """Keeps a frontend's WorkerPool (or a worker's known peers) equal to the
    workers registered in Redis that check out."""

    def __init__(self, url: str, model_id: str, pool: PeerSet, interval: float = 1.0, *,
                 token: str | None = None,
                 layout: dict[str, Any] | Callable[[], dict[str, Any]] | None = None) -> None:
        self.redis = _client(url)
        self.model_id = model_id
        self.pool = pool
        self.interval = interval
        self.token = token
        self.layout = layout
        self.refused: dict[bytes, str] = {}  # value -> why (logged once each)
        self.absence_grace_s = 3 * REGISTRATION_INTERVAL_S  # a registration's TTL
        self._known: dict[str, set[str]] = {role: set() for role in ROLES}
        # address -> the first successful read that lacked it (time Redis was down does not count)
        self._missing_since: dict[str, dict[str, float]] = {role: {} for role in ROLES}
        self._task: asyncio.Task[None] | None = None
        self._up: bool | None = None

    async def refresh(self) -> bool:
        """One read; False when Redis could not be read (the pool is left as it is)."""
        if len(self.refused) > 10_000:
            self.refused.clear()
        try:
            layout = self.layout() if callable(self.layout) else self.layout
            found = await read_registrations(self.redis, self.model_id, self.token, layout, self.refused)
        except (RedisError, OSError) as e:
            if self._up is not False:
                log.warning("cannot read worker registrations from Redis (keeping %d workers): %s",
                            len(self.pool.all), e)
            self._up = False
            return False
        self._up = True
        now = time.monotonic()
        for role in ROLES:
            missing = self._missing_since[role]
            for address in found[role]:
                missing.pop(address, None)
            for address in self._known[role] - found[role]:
                missing.setdefault(address, now)
            gone = {a for a, t in missing.items() if now - t > self.absence_grace_s}
            for address in gone:
                del missing[address]
            self._known[role] = (self._known[role] | found[role]) - gone
            self.pool.sync(role, set(self._known[role]))
        return True

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="discovery")

    async def _run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - whatever Redis holds, discovery goes on
                log.exception("worker discovery failed this round (retrying)")
            await asyncio.sleep(self.interval)

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        await self.redis.aclose()
