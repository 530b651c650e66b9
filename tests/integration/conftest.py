"""Fixtures the integration modules share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from . import forkserver
from .test_prefix_index_redis import RedisServer


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Start the service processes' fork server now: it loads torch while the
    first tests run (tests/integration/forkserver.py)."""
    forkserver.client()


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """A real redis-server on a free loopback port, one per module."""
    srv = RedisServer().start()
    yield srv
    srv.stop()
