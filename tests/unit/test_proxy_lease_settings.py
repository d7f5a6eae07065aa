"""The budget lease and rate-limit grant settings reach the proxy's budget service and rate limiter
(docs/budget-leases.md)."""

from __future__ import annotations

import pytest

from ibex_dataplane.proxy.app import grant_settings, lease_settings
from ibex_dataplane.settings import Settings


def test_the_defaults_lease_between_32_and_512_requests_for_five_seconds() -> None:
    leases = lease_settings(Settings())
    assert leases is not None
    assert (leases.requests, leases.most, leases.seconds, leases.pace_seconds) == (32, 512, 5.0, 0.5)


def test_the_environment_sets_the_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IBEX_BUDGET_LEASE_REQUESTS", "8")
    monkeypatch.setenv("IBEX_BUDGET_LEASE_MAX_REQUESTS", "100")
    monkeypatch.setenv("IBEX_BUDGET_LEASE_SECONDS", "2")
    leases = lease_settings(Settings())
    assert leases is not None and (leases.requests, leases.most, leases.seconds) == (8, 100, 2.0)


def test_a_maximum_below_the_least_keeps_leases_at_one_size_and_zero_turns_them_off() -> None:
    leases = lease_settings(Settings(budget_lease_requests=64, budget_lease_max_requests=16))
    assert leases is not None and (leases.requests, leases.most) == (64, 64)
    assert lease_settings(Settings(budget_lease_requests=0)) is None


def test_rate_grants_count_between_32_and_512_requests_by_default_and_the_environment_sets_the_bounds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    grants = grant_settings(Settings())
    assert grants is not None
    assert (grants.requests, grants.most, grants.seconds, grants.pace_seconds) == (32, 512, 1.0, 0.5)
    monkeypatch.setenv("IBEX_RATE_GRANT_REQUESTS", "8")
    monkeypatch.setenv("IBEX_RATE_GRANT_MAX_REQUESTS", "100")
    grants = grant_settings(Settings())
    assert grants is not None and (grants.requests, grants.most) == (8, 100)
    assert grant_settings(Settings(rate_grant_requests=64, rate_grant_max_requests=16)).most == 64  # type: ignore[union-attr]
    assert grant_settings(Settings(rate_grant_requests=1)) is None
