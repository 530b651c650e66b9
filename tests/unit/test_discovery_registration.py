"""Redis is data, not authority: what a registration must be for a reader to
use it (the integration test plants these in a real Redis)."""

from __future__ import annotations

import pytest

from services.discovery import InvalidRegistration, check_registration, registration_value

TOKEN = "registration-token"
MODEL = "SmolLM2-135M-Instruct"


def test_check_registration_refuses_what_does_not_check_out() -> None:
    layout = {"model_id": MODEL, "block_size": 16}
    good = registration_value(MODEL, "decode", "d0", "10.0.0.1:5000", layout, TOKEN)
    assert check_registration(good, MODEL, "decode", TOKEN, layout) == "10.0.0.1:5000"
    bad = {
        "unsigned": registration_value(MODEL, "decode", "d0", "10.0.0.1:5000", layout, None),
        "another token": registration_value(MODEL, "decode", "d0", "10.0.0.1:5000", layout, "other"),
        "another model": registration_value("other", "decode", "d0", "10.0.0.1:5000", layout, TOKEN),
        "another role": registration_value(MODEL, "prefill", "d0", "10.0.0.1:5000", layout, TOKEN),
        "another layout": registration_value(MODEL, "decode", "d0", "10.0.0.1:5000", {"block_size": 32},
                                             TOKEN),
        "not an address": registration_value(MODEL, "decode", "d0", "http://x/y", layout, TOKEN),
        "not UTF-8": b"\xff\xfe\x00",
        "not JSON": b"10.0.0.1:5000",  # the old plain-address form
        "not an object": b"[1, 2]",
    }
    for what, value in bad.items():
        with pytest.raises(InvalidRegistration):
            check_registration(value, MODEL, "decode", TOKEN, layout)
            pytest.fail(what)
    # without a cluster token only the MAC goes unchecked
    assert check_registration(bad["unsigned"], MODEL, "decode", None, layout) == "10.0.0.1:5000"


class Pool:
    def __init__(self) -> None:
        self.synced: dict[str, set[str]] = {}

    @property
    def all(self) -> list[str]:
        return [a for addresses in self.synced.values() for a in addresses]

    def sync(self, role: str, addresses: set[str]) -> None:
        self.synced[role] = addresses


def test_a_vanished_registration_is_kept_for_one_ttl(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Redis restarted empty holds no entries until the workers' next refresh:
    discovery keeps a worker for a registration's TTL before it retires it."""
    import asyncio

    from redis.exceptions import ConnectionError as RedisConnectionError

    from services import discovery

    registered = {"decode": {"10.0.0.1:5000"}, "prefill": {"10.0.0.2:5000"}}
    clock = [100.0]
    down = [False]

    async def read(*args: object, **kwargs: object) -> dict[str, set[str]]:
        if down[0]:
            raise RedisConnectionError("refused")
        return {role: set(a) for role, a in registered.items()}

    monkeypatch.setattr(discovery, "read_registrations", read)
    monkeypatch.setattr(discovery.time, "monotonic", lambda: clock[0])
    pool = Pool()
    disc = discovery.Discovery("redis://127.0.0.1:1/0", MODEL, pool)
    assert asyncio.run(disc.refresh())
    assert pool.synced == registered
    down[0] = True  # Redis dies for longer than the grace: that time does not count
    clock[0] += 10 * disc.absence_grace_s
    assert not asyncio.run(disc.refresh())
    down[0] = False
    registered["decode"] = set()  # back empty (or the worker deregistered meanwhile)
    asyncio.run(disc.refresh())
    assert pool.synced["decode"] == {"10.0.0.1:5000"}
    clock[0] += disc.absence_grace_s
    asyncio.run(disc.refresh())
    assert pool.synced["decode"] == {"10.0.0.1:5000"}  # not yet: it may just not have refreshed
    clock[0] += 0.1
    asyncio.run(disc.refresh())
    assert pool.synced == {"decode": set(), "prefill": {"10.0.0.2:5000"}}
