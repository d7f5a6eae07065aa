"""Budget holds against real Postgres as the RLS-bound data-plane role: hold, refuse, settle, release, sweep.

Every test creates its own org, so the totals it asserts are its own. The sweeper is cross-tenant by design; tests
that sweep only assert on their own holds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, date, datetime, timedelta, timezone
from pathlib import Path
from typing import Any, TypeVar
from uuid import UUID, uuid4

import asyncpg
import pytest
import pytest_asyncio

from ibex_dataplane.runtime import embedded
from ibex_dataplane.runtime.embedded import ADMIN_ROLE, APP_ROLE, EmbeddedPostgres
from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.shared.budget import (
    BudgetExceeded,
    BudgetHold,
    BudgetPolicy,
    BudgetScope,
    BudgetService,
    DuplicateBudgetHold,
    Enforcement,
    month_start,
)
from ibex_dataplane.store.errors import StoreUnavailable
from ibex_dataplane.store.migrations import default_migrations_dir, migrate_postgres
from ibex_dataplane.store.postgres import Database, create_pool
from tests.support.budget import AGENT_SPEC, HARD, ORG_SPEC, D, ledger, rid, totals
from tests.support.tenants import Tenant, TenantFactory

T = TypeVar("T")


class Clock:
    """A settable clock for the service (periods are computed from it)."""

    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


@pytest.fixture
def budgets(stores: Stores) -> BudgetService:
    return BudgetService(stores.db)


@pytest_asyncio.fixture
async def tenant(tenants: TenantFactory) -> Tenant:
    return await tenants.create(org_spec=ORG_SPEC, agent_spec=AGENT_SPEC, directive=None)


async def hold_row(stores: Stores, hold: BudgetHold) -> asyncpg.Record:
    async with stores.db.tenant(hold.org_id) as conn:
        row = await conn.fetchrow("SELECT status, amount_usd, actual_usd FROM budget_holds WHERE id = $1", hold.id)
    assert row is not None
    return row


async def reconcile(stores: Stores, org_id: UUID) -> None:
    """The invariants between the tables: spent == ledger, held == open holds, per scope and period."""
    async with stores.db.tenant(org_id) as conn:
        rows = await conn.fetch(
            "SELECT p.scope_kind, p.scope_id, p.period_start, p.spent_usd, p.held_usd,"
            " (SELECT coalesce(sum(h.actual_usd), 0) FROM budget_holds h WHERE h.status = 'settled'"
            "   AND h.period_start = p.period_start AND (p.scope_kind = 'org' OR h.agent_id = p.scope_id)) AS settled,"
            " (SELECT coalesce(sum(h.amount_usd), 0) FROM budget_holds h WHERE h.status = 'held'"
            "   AND h.period_start = p.period_start AND (p.scope_kind = 'org' OR h.agent_id = p.scope_id)) AS open,"
            " (SELECT coalesce(sum(l.cost_usd), 0) FROM budget_ledger l JOIN budget_holds h"
            "   ON h.org_id = l.org_id AND h.request_id = l.request_id WHERE h.period_start = p.period_start"
            "   AND (p.scope_kind = 'org' OR l.agent_id = p.scope_id)) AS ledgered"
            " FROM budget_periods p WHERE p.org_id = $1",
            org_id,
        )
    assert rows
    for r in rows:
        assert r["spent_usd"] == r["ledgered"] == r["settled"], dict(r)
        assert r["held_usd"] == r["open"], dict(r)


async def eventually(call: Callable[[], Awaitable[T]], attempts: int = 5) -> T:
    """After a restart asyncpg may hand out one pooled connection that died with the old server."""
    for _ in range(attempts - 1):
        try:
            return await call()
        except StoreUnavailable:
            await asyncio.sleep(0.2)
    return await call()


# -- hold --------------------------------------------------------------------------------------------------------


async def test_a_hold_within_the_limits_is_held_on_the_org_and_the_agent(
    stores: Stores, budgets: BudgetService, tenant: Tenant
) -> None:
    org, alpha = tenant.org_id, tenant.agents["alpha"]
    request_id = rid()
    hold = await budgets.hold(org, alpha, request_id, D("0.3"), HARD)
    assert (hold.org_id, hold.agent_id, hold.request_id) == (org, alpha, request_id)
    assert hold.amount_usd == D("0.30") and not hold.over_budget
    assert hold.period_start == month_start(datetime.now(UTC))
    assert await totals(budgets, org, alpha) == {"org": (0, D("0.30")), "agent": (0, D("0.30"))}
    snapshot = await budgets.spend(org, alpha)
    assert snapshot.scope is BudgetScope.AGENT and snapshot.limit_usd == D("0.50")
    assert snapshot.enforcement is Enforcement.HARD_CAP and snapshot.remaining_usd == D("0.20")
    assert (await hold_row(stores, hold))["status"] == "held"


async def test_amounts_round_up_to_the_ledger_precision_and_must_be_valid(
    budgets: BudgetService, tenant: Tenant
) -> None:
    org, alpha = tenant.org_id, tenant.agents["alpha"]
    hold = await budgets.hold(org, alpha, rid(), D("0.000000001"), HARD)
    assert hold.amount_usd == D("0.00000001")  # rounded up, never under-reserved
    for bad in (D("-0.01"), D("NaN"), D("Infinity"), D("1e12")):
        with pytest.raises(ValueError, match="amount_usd must be"):
            await budgets.hold(org, alpha, rid(), bad, HARD)
    with pytest.raises(ValueError, match="needs a request id"):
        await budgets.hold(org, alpha, "", D("0.01"), HARD)


async def test_a_hold_that_would_pass_the_agent_limit_is_refused_and_holds_nothing_on_the_org(
    budgets: BudgetService, tenant: Tenant
) -> None:
    org, alpha = tenant.org_id, tenant.agents["alpha"]
    await budgets.hold(org, alpha, rid(), D("0.40"), HARD)
    await budgets.hold(org, alpha, rid(), D("0.10"), HARD)  # exactly at the limit is allowed
    with pytest.raises(BudgetExceeded) as refused:
        await budgets.hold(org, alpha, rid(), D("0.00000001"), HARD)
    e = refused.value
    assert (e.scope, e.limit, e.spent, e.held, e.requested) == ("agent", D("0.50"), 0, D("0.50"), D("0.00000001"))
    assert "agent budget" in str(e)
    assert await totals(budgets, org, alpha) == {"org": (0, D("0.50")), "agent": (0, D("0.50"))}


async def test_an_org_refusal_holds_nothing_on_the_agent(budgets: BudgetService, tenant: Tenant) -> None:
    org, alpha, beta = tenant.org_id, tenant.agents["alpha"], tenant.agents["beta"]
    await budgets.hold(org, alpha, rid(), D("0.50"), HARD)
    await budgets.hold(org, beta, rid(), D("0.30"), HARD)
    with pytest.raises(BudgetExceeded) as refused:
        await budgets.hold(org, beta, rid(), D("0.20000001"), HARD)  # fits beta (0.50), not the org (1.00)
    e = refused.value
    assert (e.scope, e.limit, e.spent, e.held) == (BudgetScope.ORG, D("1.00"), 0, D("0.80"))
    assert await totals(budgets, org, beta) == {"org": (0, D("0.80")), "agent": (0, D("0.30"))}


async def test_the_newest_policy_applies_to_the_next_hold(budgets: BudgetService, tenant: Tenant) -> None:
    org, alpha = tenant.org_id, tenant.agents["alpha"]
    await budgets.hold(org, alpha, rid(), D("0.50"), HARD)
    raised = BudgetPolicy(org_limit_usd=D("1.00"), agent_limit_usd=D("0.75"), enforcement=Enforcement.HARD_CAP)
    await budgets.hold(org, alpha, rid(), D("0.25"), raised)
    assert (await budgets.spend(org, alpha)).limit_usd == D("0.75")
    lowered = BudgetPolicy(org_limit_usd=D("1.00"), agent_limit_usd=D("0.60"), enforcement=Enforcement.HARD_CAP)
    with pytest.raises(BudgetExceeded):
        await budgets.hold(org, alpha, rid(), D("0.01"), lowered)
    assert (await budgets.spend(org, alpha)).limit_usd == D("0.60")  # a refusal still records the new limit
    unlimited = BudgetPolicy(org_limit_usd=None, agent_limit_usd=None, enforcement=Enforcement.HARD_CAP)
    await budgets.hold(org, alpha, rid(), D("5.00"), unlimited)
    assert await totals(budgets, org, alpha) == {"org": (0, D("5.75")), "agent": (0, D("5.75"))}


async def test_a_request_id_gets_one_hold_per_org(budgets: BudgetService, tenant: Tenant) -> None:
    org, alpha, beta = tenant.org_id, tenant.agents["alpha"], tenant.agents["beta"]
    request_id = rid()
    await budgets.hold(org, alpha, request_id, D("0.10"), HARD)
    with pytest.raises(DuplicateBudgetHold):
        await budgets.hold(org, beta, request_id, D("0.10"), HARD)
    assert await totals(budgets, org, beta) == {"org": (0, D("0.10")), "agent": (0, 0)}
    # Racing holds with one request id: the first wins, the others wait for it and then see it.
    racing = rid()
    outcomes = await asyncio.gather(
        *(budgets.hold(org, (alpha, beta)[i % 2], racing, D("0.01"), HARD) for i in range(6)), return_exceptions=True
    )
    assert sum(isinstance(o, BudgetHold) for o in outcomes) == 1
    assert sum(isinstance(o, DuplicateBudgetHold) for o in outcomes) == 5
    assert (await budgets.spend(org)).held_usd == D("0.11")


# -- settle and release ------------------------------------------------------------------------------------------


async def test_settle_turns_the_hold_into_spend_at_the_actual_cost(
    stores: Stores, budgets: BudgetService, tenant: Tenant
) -> None:
    org, alpha = tenant.org_id, tenant.agents["alpha"]
    hold = await budgets.hold(org, alpha, rid(), D("0.30"), HARD)
    await budgets.settle(hold, D("0.12"), model="echo", prompt_tokens=120, completion_tokens=7)
    assert await totals(budgets, org, alpha) == {"org": (D("0.12"), 0), "agent": (D("0.12"), 0)}
    [entry] = await ledger(stores, org)
    assert (entry["agent_id"], entry["request_id"], entry["model"]) == (alpha, hold.request_id, "echo")
    assert (entry["prompt_tokens"], entry["completion_tokens"], entry["cost_usd"]) == (120, 7, D("0.12"))
    row = await hold_row(stores, hold)
    assert (row["status"], row["actual_usd"]) == ("settled", D("0.12"))
    # Usage above the estimate records the truth, even past a HardCap.
    under = await budgets.hold(org, alpha, rid(), D("0.38"), HARD)
    await budgets.settle(under, D("0.45"), model="echo", prompt_tokens=1, completion_tokens=1)
    assert await totals(budgets, org, alpha) == {"org": (D("0.57"), 0), "agent": (D("0.57"), 0)}
    with pytest.raises(BudgetExceeded):
        await budgets.hold(org, alpha, rid(), D("0"), HARD)
    await reconcile(stores, org)


async def test_settling_twice_counts_the_spend_once(stores: Stores, budgets: BudgetService, tenant: Tenant) -> None:
    org, alpha = tenant.org_id, tenant.agents["alpha"]
    hold = await budgets.hold(org, alpha, rid(), D("0.30"), HARD)
    await budgets.settle(hold, D("0.20"), model="echo", prompt_tokens=10, completion_tokens=10)
    await budgets.settle(hold, D("0.25"), model="echo", prompt_tokens=10, completion_tokens=10)
    await budgets.release(hold)  # a release after the settle changes nothing either
    assert [r["cost_usd"] for r in await ledger(stores, org)] == [D("0.20")]
    assert await totals(budgets, org, alpha) == {"org": (D("0.20"), 0), "agent": (D("0.20"), 0)}
    await reconcile(stores, org)


async def test_release_gives_the_whole_hold_back_once(stores: Stores, budgets: BudgetService, tenant: Tenant) -> None:
    org, alpha = tenant.org_id, tenant.agents["alpha"]
    kept = await budgets.hold(org, alpha, rid(), D("0.10"), HARD)
    hold = await budgets.hold(org, alpha, rid(), D("0.40"), HARD)
    await budgets.release(hold)
    await budgets.release(hold)
    assert (await hold_row(stores, hold))["status"] == "released"
    assert await totals(budgets, org, alpha) == {"org": (0, D("0.10")), "agent": (0, D("0.10"))}
    assert await ledger(stores, org) == []
    await budgets.hold(org, alpha, rid(), D("0.40"), HARD)  # the released amount is available again
    assert (await hold_row(stores, kept))["status"] == "held"
    await reconcile(stores, org)


async def test_a_settle_whose_caller_is_cancelled_still_completes(
    stores: Stores, budgets: BudgetService, tenant: Tenant
) -> None:
    org, alpha = tenant.org_id, tenant.agents["alpha"]
    hold = await budgets.hold(org, alpha, rid(), D("0.30"), HARD)
    caller = asyncio.create_task(budgets.settle(hold, D("0.10"), model="echo", prompt_tokens=1, completion_tokens=1))
    await asyncio.sleep(0)  # let it start its write
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    await budgets.drain()
    assert (await hold_row(stores, hold))["status"] == "settled"
    assert await totals(budgets, org, alpha) == {"org": (D("0.10"), 0), "agent": (D("0.10"), 0)}


# -- sweeper -----------------------------------------------------------------------------------------------------


async def test_the_sweeper_expires_the_holds_of_crashed_requests_in_every_org(
    stores: Stores, budgets: BudgetService, tenants: TenantFactory
) -> None:
    crashing = BudgetService(stores.db, hold_ttl=timedelta(0))
    a = await tenants.create(org_spec=ORG_SPEC, agent_spec=AGENT_SPEC, agents=("alpha",), directive=None)
    b = await tenants.create(org_spec=ORG_SPEC, agent_spec=AGENT_SPEC, agents=("alpha",), directive=None)
    lost_a = await crashing.hold(a.org_id, a.agents["alpha"], rid(), D("0.30"), HARD)
    lost_b = await crashing.hold(b.org_id, b.agents["alpha"], rid(), D("0.25"), HARD)
    live = await budgets.hold(a.org_id, a.agents["alpha"], rid(), D("0.20"), HARD)
    with pytest.raises(BudgetExceeded):
        await budgets.hold(a.org_id, a.agents["alpha"], rid(), D("0.01"), HARD)

    assert await budgets.sweep_expired() >= 2  # other tests' expired holds may be swept too
    assert (await hold_row(stores, lost_a))["status"] == "expired"
    assert (await hold_row(stores, lost_b))["status"] == "expired"
    assert (await hold_row(stores, live))["status"] == "held"
    assert await totals(budgets, a.org_id, a.agents["alpha"]) == {"org": (0, D("0.20")), "agent": (0, D("0.20"))}
    assert await totals(budgets, b.org_id, b.agents["alpha"]) == {"org": (0, 0), "agent": (0, 0)}
    await budgets.hold(a.org_id, a.agents["alpha"], rid(), D("0.30"), HARD)  # the expired amount is free again
    # Sweeping again finds nothing of ours; a release of an expired hold is a no-op.
    await budgets.sweep_expired()
    await crashing.release(lost_a)
    assert await totals(budgets, a.org_id, a.agents["alpha"]) == {"org": (0, D("0.50")), "agent": (0, D("0.50"))}
    await reconcile(stores, a.org_id)


async def test_a_late_settle_after_the_sweep_is_counted_once(
    stores: Stores, budgets: BudgetService, tenant: Tenant
) -> None:
    org, alpha = tenant.org_id, tenant.agents["alpha"]
    crashing = BudgetService(stores.db, hold_ttl=timedelta(0))
    slow = await crashing.hold(org, alpha, rid(), D("0.30"), HARD)
    await budgets.hold(org, alpha, rid(), D("0.10"), HARD)
    await budgets.sweep_expired()
    assert (await hold_row(stores, slow))["status"] == "expired"
    await crashing.settle(slow, D("0.25"), model="echo", prompt_tokens=5, completion_tokens=5)
    await crashing.settle(slow, D("0.25"), model="echo", prompt_tokens=5, completion_tokens=5)
    assert await totals(budgets, org, alpha) == {"org": (D("0.25"), D("0.10")), "agent": (D("0.25"), D("0.10"))}
    assert [r["cost_usd"] for r in await ledger(stores, org)] == [D("0.25")]
    assert (await hold_row(stores, slow))["status"] == "settled"
    await reconcile(stores, org)


async def test_the_data_plane_role_reaches_the_sweeper_but_not_the_rows(stores: Stores, tenant: Tenant) -> None:
    async with stores.db.unscoped() as conn:
        assert await conn.fetchval("SELECT count(*) FROM budget_holds") == 0
        assert isinstance(await conn.fetchval("SELECT ibex_sweep_expired_holds(10)"), int)
        with pytest.raises(asyncpg.InvalidParameterValueError):
            await conn.fetchval("SELECT ibex_sweep_expired_holds(0)")
        # The hold function takes its org from app.org_id only: without one it refuses to run.
        with pytest.raises(asyncpg.InsufficientPrivilegeError, match="outside a tenant transaction"):
            await conn.fetchrow(
                "SELECT * FROM ibex_budget_hold($1, $2, 'x', current_date, 0, NULL, NULL, 'HardCap', '1 minute')",
                uuid4(),
                tenant.agents["alpha"],
            )


# -- policy, periods, isolation ----------------------------------------------------------------------------------


async def test_alert_only_records_going_over_but_never_refuses(
    stores: Stores, tenants: TenantFactory, caplog: pytest.LogCaptureFixture
) -> None:
    t = await tenants.create(
        org_spec={"budget": {"monthlyLimitUSD": "1.00", "enforcement": "AlertOnly"}},
        agent_spec=AGENT_SPEC,
        agents=("alpha",),
        directive=None,
    )
    org, alpha = t.org_id, t.agents["alpha"]
    budgets = BudgetService(stores.db)
    alert = BudgetPolicy(org_limit_usd=D("1.00"), agent_limit_usd=D("0.50"), enforcement=Enforcement.ALERT_ONLY)
    caplog.set_level(logging.WARNING, logger="ibex_dataplane.shared.budget")
    holds = [await budgets.hold(org, alpha, rid(), D("0.40"), alert) for _ in range(4)]
    assert [h.over_budget for h in holds] == [False, True, True, True]
    assert await totals(budgets, org, alpha) == {"org": (0, D("1.60")), "agent": (0, D("1.60"))}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3  # once per over-budget hold
    assert "agent limit" in warnings[0] and "org limit" in warnings[2]
    assert all(h.request_id in w for h, w in zip(holds[1:], warnings, strict=True))
    assert (await budgets.spend(org)).enforcement is Enforcement.ALERT_ONLY
    for h in holds:
        await budgets.settle(h, D("0.40"), model="echo", prompt_tokens=1, completion_tokens=1)
    assert await totals(budgets, org, alpha) == {"org": (D("1.60"), 0), "agent": (D("1.60"), 0)}
    await reconcile(stores, org)


async def test_a_new_month_starts_a_new_period(stores: Stores, tenant: Tenant) -> None:
    org, alpha = tenant.org_id, tenant.agents["alpha"]
    clock = Clock(datetime(2031, 1, 31, 23, 59, 59, 999999, tzinfo=UTC))
    budgets = BudgetService(stores.db, clock=clock)
    january = await budgets.hold(org, alpha, rid(), D("0.50"), HARD)
    assert january.period_start == date(2031, 1, 1)
    with pytest.raises(BudgetExceeded):
        await budgets.hold(org, alpha, rid(), D("0.01"), HARD)

    clock.now = datetime(2031, 2, 1, tzinfo=UTC)
    february = await budgets.hold(org, alpha, rid(), D("0.50"), HARD)
    assert february.period_start == date(2031, 2, 1)
    assert await totals(budgets, org, alpha) == {"org": (0, D("0.50")), "agent": (0, D("0.50"))}
    # January's hold settles into January, whatever month it is now.
    await budgets.settle(january, D("0.10"), model="echo", prompt_tokens=1, completion_tokens=1)
    assert await totals(budgets, org, alpha) == {"org": (0, D("0.50")), "agent": (0, D("0.50"))}
    clock.now = datetime(2031, 1, 15, tzinfo=UTC)
    assert await totals(budgets, org, alpha) == {"org": (D("0.10"), 0), "agent": (D("0.10"), 0)}
    # Months are UTC months: half past midnight on 1 March in UTC+2 is still February.
    clock.now = datetime(2031, 3, 1, 0, 30, tzinfo=timezone(timedelta(hours=2)))
    with pytest.raises(BudgetExceeded):
        await budgets.hold(org, alpha, rid(), D("0.01"), HARD)
    await budgets.settle(february, D("0.50"), model="echo", prompt_tokens=1, completion_tokens=1)
    await reconcile(stores, org)


async def test_another_org_sees_and_touches_none_of_the_budget_rows(
    stores: Stores, budgets: BudgetService, tenants: TenantFactory
) -> None:
    a = await tenants.create(org_spec=ORG_SPEC, agent_spec=AGENT_SPEC, agents=("alpha",), directive=None)
    b = await tenants.create(org_spec=ORG_SPEC, agent_spec=AGENT_SPEC, agents=("alpha",), directive=None)
    settled = await budgets.hold(a.org_id, a.agents["alpha"], rid(), D("0.20"), HARD)
    await budgets.settle(settled, D("0.20"), model="echo", prompt_tokens=1, completion_tokens=1)
    open_hold = await budgets.hold(a.org_id, a.agents["alpha"], rid(), D("0.10"), HARD)

    async with stores.db.tenant(b.org_id) as conn:
        for table in ("budget_periods", "budget_holds", "budget_ledger"):
            assert await conn.fetchval(f"SELECT count(*) FROM {table}") == 0, table
            assert await conn.fetchval(f"SELECT count(*) FROM {table} WHERE org_id = $1", a.org_id) == 0, table
    async with stores.db.tenant(a.org_id) as conn:
        assert await conn.fetchval("SELECT count(*) FROM budget_holds") == 2
    assert (await budgets.spend(b.org_id)).spent_usd == 0
    assert (await budgets.spend(b.org_id, a.agents["alpha"])).held_usd == 0

    # Handing org B's transaction a hold id of org A finds nothing: A's hold stays open and uncounted.
    forged = dataclasses.replace(open_hold, org_id=b.org_id, agent_id=b.agents["alpha"])
    await budgets.settle(forged, D("0.10"), model="echo", prompt_tokens=1, completion_tokens=1)
    await budgets.release(forged)
    assert (await hold_row(stores, open_hold))["status"] == "held"
    assert await totals(budgets, a.org_id, a.agents["alpha"]) == {
        "org": (D("0.20"), D("0.10")),
        "agent": (D("0.20"), D("0.10")),
    }


# -- concurrency -------------------------------------------------------------------------------------------------


async def hold_or_none(budgets: BudgetService, org: UUID, agent: UUID, policy: BudgetPolicy) -> BudgetHold | None:
    try:
        return await budgets.hold(org, agent, rid(), D("0.10"), policy)
    except BudgetExceeded:
        return None


async def test_fifty_concurrent_holds_never_overspend_a_hard_cap(
    stores: Stores, budgets: BudgetService, tenant: Tenant
) -> None:
    org, alpha = tenant.org_id, tenant.agents["alpha"]
    policy = BudgetPolicy(org_limit_usd=None, agent_limit_usd=D("1.00"), enforcement=Enforcement.HARD_CAP)
    results = await asyncio.gather(*(hold_or_none(budgets, org, alpha, policy) for _ in range(50)))
    held = [h for h in results if h is not None]
    assert len(held) == 10
    assert await totals(budgets, org, alpha) == {"org": (0, D("1.00")), "agent": (0, D("1.00"))}
    await asyncio.gather(
        *(budgets.settle(h, h.amount_usd, model="echo", prompt_tokens=1, completion_tokens=1) for h in held)
    )
    assert await totals(budgets, org, alpha) == {"org": (D("1.00"), 0), "agent": (D("1.00"), 0)}
    entries = await ledger(stores, org)
    assert len(entries) == 10 and sum(r["cost_usd"] for r in entries) == D("1.00")
    await reconcile(stores, org)


async def test_two_replicas_together_never_overspend_the_agent_or_the_org(
    stores: Stores, budgets: BudgetService, second_replica: Database, tenant: Tenant
) -> None:
    org, alpha, beta = tenant.org_id, tenant.agents["alpha"], tenant.agents["beta"]
    other = BudgetService(second_replica)
    replicas = [budgets, other]
    # The agent cap first: 50 holds of 0.10 on alpha's 1.00, half through each replica.
    agent_cap = BudgetPolicy(org_limit_usd=D("3.00"), agent_limit_usd=D("1.00"), enforcement=Enforcement.HARD_CAP)
    results = await asyncio.gather(
        *(hold_or_none(replicas[i % 2], org, alpha, agent_cap) for i in range(50)),
    )
    held = [h for h in results if h is not None]
    assert len(held) == 10
    # Then the org cap, 2.00 left of 3.00, contended by both agents and both replicas while alpha's holds settle.
    org_cap = BudgetPolicy(org_limit_usd=D("3.00"), agent_limit_usd=None, enforcement=Enforcement.HARD_CAP)
    settles: list[Awaitable[Any]] = [
        replicas[i % 2].settle(h, h.amount_usd, model="echo", prompt_tokens=1, completion_tokens=1)
        for i, h in enumerate(held)
    ]
    holds = [hold_or_none(replicas[i % 2], org, alpha if i % 3 else beta, org_cap) for i in range(60)]
    more = await asyncio.gather(*holds, *settles, budgets.sweep_expired(), other.sweep_expired())
    assert sum(1 for h in more[:60] if h is not None) == 20
    both = [*held, *(h for h in more[:60] if h is not None)]
    await asyncio.gather(
        *(replicas[i % 2].settle(h, h.amount_usd, model="echo", prompt_tokens=1, completion_tokens=1)
          for i, h in enumerate(both))
    )  # fmt: skip
    assert (await budgets.spend(org)).spent_usd == D("3.00")
    entries = await ledger(stores, org)
    assert len(entries) == 30 and sum(r["cost_usd"] for r in entries) == D("3.00")
    await reconcile(stores, org)


# -- Postgres down -----------------------------------------------------------------------------------------------


@pytest.fixture
def scratch_dir() -> Iterator[Path]:
    """A directory outside pytest's basetemp.

    Every pytest session that starts (another run on the same machine) resets ``/tmp/pytest-of-<user>`` to 0700,
    which locks the unprivileged Postgres user (when run as root) out of a data directory below it mid-initdb.
    """
    path = Path(tempfile.mkdtemp(prefix="ibex-budget-test-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


async def test_budgets_fail_closed_while_postgres_is_down_and_resume_after_a_restart(
    scratch_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A throwaway server of its own: stopping the session's Postgres would break every other test."""
    pg = EmbeddedPostgres(scratch_dir / "pg")
    await asyncio.to_thread(pg.start)
    try:
        await migrate_postgres(pg.dsn(ADMIN_ROLE), default_migrations_dir() / "postgres")
        org, agent = uuid4(), uuid4()
        admin = await asyncpg.connect(pg.dsn(ADMIN_ROLE))
        try:
            await admin.execute("INSERT INTO organizations (id, namespace, name) VALUES ($1, 'down', 'org')", org)
            await admin.execute(
                "INSERT INTO agents (id, org_id, namespace, name) VALUES ($1, $2, 'down', 'agent')", agent, org
            )
        finally:
            await admin.close()
        pool = await create_pool(pg.dsn(APP_ROLE), min_size=1, max_size=2, timeout=2)
        try:
            budgets = BudgetService(Database(pool, acquire_timeout=2))
            hold = await budgets.hold(org, agent, rid(), D("0.10"), HARD)

            await asyncio.to_thread(pg.stop)
            # A settle does not fail: it waits for Postgres and lands once it is back (settlement is durable).
            settling = asyncio.create_task(
                budgets.settle(hold, D("0.05"), model="echo", prompt_tokens=1, completion_tokens=1)
            )
            calls: list[Callable[[], Awaitable[Any]]] = [
                lambda: budgets.hold(org, agent, rid(), D("0.10"), HARD),
                lambda: budgets.release(hold),
                lambda: budgets.spend(org),
                lambda: budgets.sweep_expired(),
            ]
            for call in calls:
                with pytest.raises(StoreUnavailable):
                    await call()

            port = pg.port
            monkeypatch.setattr(embedded, "free_port", lambda: port)  # come back where the pool looks
            await asyncio.to_thread(pg.start)
            again = await eventually(lambda: budgets.hold(org, agent, rid(), D("0.10"), HARD))
            await asyncio.wait_for(settling, timeout=30)
            await budgets.settle(hold, D("0.05"), model="echo", prompt_tokens=1, completion_tokens=1)  # idempotent
            await budgets.release(again)
            snapshot = await budgets.spend(org, agent)
            assert (snapshot.spent_usd, snapshot.held_usd) == (D("0.05"), 0)
        finally:
            await pool.close()
    finally:
        await asyncio.to_thread(pg.stop)
