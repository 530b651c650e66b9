"""Shared fixtures.  The Triton interpreter must be chosen before triton is
imported anywhere in the process, so it is set here when there is no GPU."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "0" if os.path.exists("/dev/nvidia0") else "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def model_dir():  # type: ignore[no-untyped-def]
    from engine.models.loader import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def tokenizer(model_dir):  # type: ignore[no-untyped-def]
    from engine.models.loader import load_tokenizer

    return load_tokenizer(model_dir)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The timing-sensitive tests (tests/timing_sensitive.py) are marked
    `serial`: make test runs them alone, after the rest has run on two workers."""
    from tests.timing_sensitive import is_serial

    for item in items:
        if is_serial(item.nodeid):
            item.add_marker(pytest.mark.serial)
