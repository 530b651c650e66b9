"""Prefix index in Redis: the cluster default (`--redis-url`).

Layout, all keys under `splitserve:{<model_id>}:` so several models share one
Redis.  The braces are a Redis Cluster hash tag: every key of one model lands
in one slot, which the Lua scripts below need.

    blk:<16-byte hash>   SET   worker ids that hold the block
    held:<worker>        SET   16-byte hashes the worker holds (for cleanup)
    alive:<worker>       STR   heartbeat, with a TTL; absent = dead
    workers              SET   workers that reported, for the lazy sweep

Lookup is one Lua script (EVALSHA, one round trip): a pipeline of SMISMEMBER
per block would also be one round trip, but must ask about all N blocks and
every worker, ship N replies back and check liveness in a second step; the
script walks the blocks in order, asks SMISMEMBER only for workers still
running, stops at the first block no live worker holds (a 1,000-token prompt
that matches 2 blocks costs 2 set probes, not 62), checks liveness in the same
step, and returns only {worker: run}.  It builds the `alive:` keys itself from
the member ids; they share the hash tag, so it stays in one slot.

A dead worker (heartbeat key expired) stops counting at once, since the script
checks `alive:`; its entries are dropped by `remove_worker`, a "cleared" event,
or lazily by the sweep that any live worker's heartbeat runs now and then.

Lookups use their own connection pool with a socket timeout of a few ms and one
immediate retry (enough to replace a pooled connection broken by a Redis
restart); writes get a longer timeout and a short backoff.  Connections are
re-created by the pool after any error, so the index reconnects by itself.
Every failure surfaces as `IndexUnavailable`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import cast

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry

from engine.vocab.cache_events import CacheEvent
from engine.vocab.hashing import BlockHash
from services.index.base import IndexUnavailable, PrefixIndex
from services.secret_env import redis_password

# KEYS: blk keys of the query, in order.  ARGV[1]: alive-key prefix;
# ARGV[2]: "1" if ARGV[3..] restrict the workers, else "0".
# Returns {worker, run, worker, run, ...} for runs >= 1.
_LONGEST_PREFIX_LUA = """
local alive = ARGV[1]
local filter = nil
if ARGV[2] == '1' then
  filter = {}
  for i = 3, #ARGV do filter[ARGV[i]] = true end
end
local running = {}
for _, w in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if (filter == nil or filter[w]) and redis.call('EXISTS', alive .. w) == 1 then
    running[#running + 1] = w
  end
end
local out = {}
for i = 2, #KEYS do
  if #running == 0 then return out end
  local held = redis.call('SMISMEMBER', KEYS[i], unpack(running))
  local still = {}
  for j, w in ipairs(running) do
    if held[j] == 1 then still[#still + 1] = w
    else out[#out + 1] = w; out[#out + 1] = i - 1 end
  end
  running = still
end
for _, w in ipairs(running) do out[#out + 1] = w; out[#out + 1] = #KEYS end
return out
"""

# Drop every entry of one worker, atomically.  KEYS[1]: held:<worker>;
# KEYS[2]: alive:<worker>.  ARGV[1]: blk-key prefix; ARGV[2]: worker id;
# ARGV[3]: "1" = only if the worker is dead (the sweep; it may have come back).
# O(blocks held): a worker with 100k cached blocks blocks Redis for ~tens of ms.
_DROP_WORKER_LUA = """
if ARGV[3] == '1' and redis.call('EXISTS', KEYS[2]) == 1 then return -1 end
local hashes = redis.call('SMEMBERS', KEYS[1])
for _, h in ipairs(hashes) do redis.call('SREM', ARGV[1] .. h, ARGV[2]) end
redis.call('DEL', KEYS[1])
return #hashes
"""


@contextmanager
def _unavailable(what: str) -> Iterator[None]:
    try:
        yield
    except (redis.RedisError, OSError) as e:
        raise IndexUnavailable(f"prefix index: {what}: {type(e).__name__}: {e}") from e


class RedisPrefixIndex(PrefixIndex):
    def __init__(self, url: str, model_id: str, lookup_timeout_s: float = 0.005,
                 write_timeout_s: float = 0.5, sweep_interval_s: float = 5.0) -> None:
        self.prefix = f"splitserve:{{{model_id}}}:".encode()
        self._lookup = redis.Redis.from_url(
            url, socket_timeout=lookup_timeout_s, socket_connect_timeout=lookup_timeout_s,
            retry=Retry(NoBackoff(), 1), decode_responses=False, password=redis_password())
        self._write = redis.Redis.from_url(
            url, socket_timeout=write_timeout_s, socket_connect_timeout=write_timeout_s,
            retry=Retry(ExponentialBackoff(cap=0.05, base=0.005), 2), decode_responses=False,
            password=redis_password())
        self._longest_prefix = self._lookup.register_script(_LONGEST_PREFIX_LUA)
        self._drop_worker = self._write.register_script(_DROP_WORKER_LUA)
        self._sweep_interval_s = sweep_interval_s
        self._next_sweep = 0.0

    def _key(self, kind: bytes, name: bytes) -> bytes:
        return self.prefix + kind + name

    def apply(self, worker_id: str, events: Sequence[CacheEvent]) -> None:
        if not events:
            return
        w = worker_id.encode()
        held = self._key(b"held:", w)
        pipe = self._write.pipeline(transaction=False)
        for event in events:
            if event.kind == "stored":
                for h in event.block_hashes:
                    pipe.sadd(self._key(b"blk:", h), w)
                if event.block_hashes:
                    pipe.sadd(held, *event.block_hashes)
                pipe.sadd(self.prefix + b"workers", w)
            elif event.kind == "removed":
                for h in event.block_hashes:
                    pipe.srem(self._key(b"blk:", h), w)
                if event.block_hashes:
                    pipe.srem(held, *event.block_hashes)
            elif event.kind == "cleared":
                self._queue_drop(pipe, w, only_if_dead=False)
            else:
                raise ValueError(f"CacheEvent.kind: unknown {event.kind!r}")
        with _unavailable("apply"):
            pipe.execute()

    def heartbeat(self, worker_id: str, ttl_s: float) -> None:
        w = worker_id.encode()
        with _unavailable("heartbeat"):
            pipe = self._write.pipeline(transaction=False)
            pipe.set(self._key(b"alive:", w), b"1", px=max(1, round(ttl_s * 1000)))
            pipe.sadd(self.prefix + b"workers", w)
            pipe.execute()
            if time.monotonic() >= self._next_sweep:
                self._next_sweep = time.monotonic() + self._sweep_interval_s
                self._sweep_dead()

    def _sweep_dead(self) -> None:
        # decode_responses=False: members come back as bytes.
        workers = sorted(cast("set[bytes]", self._write.smembers(self.prefix + b"workers")))
        if not workers:
            return
        pipe = self._write.pipeline(transaction=False)
        for w in workers:
            pipe.exists(self._key(b"alive:", w))
        dead = [w for w, alive in zip(workers, pipe.execute(), strict=True) if not alive]
        if dead:
            pipe = self._write.pipeline(transaction=False)
            for w in dead:
                self._queue_drop(pipe, w, only_if_dead=True)
            pipe.execute()

    def remove_worker(self, worker_id: str) -> None:
        w = worker_id.encode()
        pipe = self._write.pipeline(transaction=False)
        pipe.delete(self._key(b"alive:", w))
        self._queue_drop(pipe, w, only_if_dead=False)
        pipe.srem(self.prefix + b"workers", w)
        with _unavailable("remove_worker"):
            pipe.execute()

    def _queue_drop(self, pipe: redis.client.Pipeline, w: bytes, only_if_dead: bool) -> None:
        self._drop_worker(keys=[self._key(b"held:", w), self._key(b"alive:", w)],
                          args=[self.prefix + b"blk:", w, b"1" if only_if_dead else b"0"], client=pipe)

    def longest_prefix(self, block_hashes: Sequence[BlockHash],
                       worker_ids: Sequence[str] | None = None) -> dict[str, int]:
        if not block_hashes or (worker_ids is not None and not worker_ids):
            return {}
        args = [self.prefix + b"alive:", b"0" if worker_ids is None else b"1"]
        args += [w.encode() for w in worker_ids or ()]
        with _unavailable("longest_prefix"):
            flat = self._longest_prefix(keys=[self._key(b"blk:", h) for h in block_hashes], args=args)
        return {flat[i].decode(): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    def close(self) -> None:
        self._lookup.close()
        self._write.close()
