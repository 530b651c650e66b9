"""Fixtures the integration modules share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .test_prefix_index_redis import RedisServer


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """A real redis-server on a free loopback port, one per module."""
    srv = RedisServer().start()
    yield srv
    srv.stop()
