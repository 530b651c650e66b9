"""Admission control: bounded waiting room, per-tenant limits, tickets that
always give their place back."""

from __future__ import annotations

import pytest

from services.frontend.admission import Admission, Limits
from services.frontend.errors import APIError


def test_waiting_requests_limit_and_release_at_first_token() -> None:
    adm = Admission(Limits(max_waiting_requests=2))
    a, b = adm.admit(10, None), adm.admit(10, None)
    with pytest.raises(APIError) as e:
        adm.admit(10, None)
    assert e.value.status == 429 and e.value.retry_after == 1.0 and "waiting" in e.value.message
    a.started()  # its first token: no longer waiting, but still running
    c = adm.admit(10, None)
    assert adm.waiting == 2 and adm.rejected == {"waiting_requests": 1}
    for t in (a, b, c, a, b):  # idempotent
        t.release()
    assert adm.waiting == 0 and adm.waiting_tokens == 0


def test_prompt_token_budget_admits_one_oversized_request_alone() -> None:
    adm = Admission(Limits(max_waiting_prompt_tokens=100))
    big = adm.admit(500, None)  # alone it goes through: nothing else would ever admit it
    with pytest.raises(APIError):
        adm.admit(1, None)
    big.started()
    adm.admit(60, None)
    with pytest.raises(APIError):
        adm.admit(60, None)


def test_per_tenant_concurrency() -> None:
    adm = Admission(Limits(max_requests_per_tenant=1))
    a = adm.admit(1, "alice")
    a.started()  # running still counts against the tenant
    with pytest.raises(APIError) as e:
        adm.admit(1, "alice")
    assert "API key or user" in e.value.message
    adm.admit(1, "bob")
    adm.admit(1, None)  # anonymous requests have no tenant limit
    a.release()
    adm.admit(1, "alice")
    assert "alice" in adm.per_tenant


def test_no_limits_by_zero() -> None:
    adm = Admission(Limits(0, 0, 0))
    tickets = [adm.admit(10_000, "t") for _ in range(1000)]
    for t in tickets:
        t.release()
    assert adm.waiting == 0 and not adm.per_tenant


def test_a_request_waits_as_its_choices() -> None:
    """10 prompts x n=2: twenty worker streams, twenty places in the waiting room."""
    adm = Admission(Limits(max_waiting_requests=25))
    big = adm.admit(100, None, requests=20)
    assert adm.waiting == 20
    with pytest.raises(APIError):
        adm.admit(10, None, requests=6)
    small = adm.admit(10, None, requests=5)
    big.started()
    assert adm.waiting == 5
    small.release()
    big.release()
    assert adm.waiting == 0 and adm.waiting_tokens == 0
