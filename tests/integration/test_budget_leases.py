"""Budget leases against real Postgres (docs/budget-leases.md): draws, settles by request id, returns, refusals
near a limit, late settles, policy changes, two replicas, and another org's lease.

Each test has its own org. The lease clock is a settable one and leases live 60 s, so no timer fires in a test:
aging is the clock moving, and shutdown (``drain``) returns what is left.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from decimal import Decimal
from uuid import UUID, uuid4

import asyncpg
import pytest
import pytest_asyncio

from ibex_dataplane.proxy.sessions import SessionService, Turn
from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.shared.budget import (
    BudgetExceeded,
    BudgetHold,
    BudgetPolicy,
    BudgetService,
    Enforcement,
    LeaseSettings,
)
from ibex_dataplane.shared.budget_repository import HoldStatus
from ibex_dataplane.store.postgres import Database
from tests.support.budget import AGENT_SPEC, HARD, ORG_SPEC, D, ledger, rid, totals
from tests.support.clocks import HandClock
from tests.support.tenants import Tenant, TenantFactory
from tests.support.waiting import until

CENT = D("0.01")
ROOMY = BudgetPolicy(org_limit_usd=D("5.00"), agent_limit_usd=D("5.00"), enforcement=Enforcement.HARD_CAP)


@pytest.fixture
def tick() -> HandClock:
    """The leases' monotonic clock."""
    return HandClock(1000.0)


def leasing(db: Database, tick: HandClock, requests: int = 10, **kw: object) -> BudgetService:
    return BudgetService(db, leases=LeaseSettings(requests, seconds=60), lease_clock=tick, **kw)  # type: ignore[arg-type]


@pytest_asyncio.fixture
async def tenant(tenants: TenantFactory) -> Tenant:
    return await tenants.create(org_spec=ORG_SPEC, agent_spec=AGENT_SPEC, directive=None)


async def holds(stores: Stores, org_id: UUID) -> list[asyncpg.Record]:
    async with stores.db.tenant(org_id) as conn:
        return list(
            await conn.fetch(
                "SELECT id, request_id, status, amount_usd, actual_usd FROM budget_holds WHERE org_id = $1"
                " ORDER BY created_at, request_id",
                org_id,
            )
        )


async def books_balance(stores: Stores, budgets: BudgetService, org_id: UUID, agent_id: UUID) -> None:
    """The invariants with leases: spent is the ledger, held the amounts of the 'held' rows (a lease's amount
    shrinking as its draws settle), for the org and the agent."""
    rows = await holds(stores, org_id)
    entries = await ledger(stores, org_id)
    open_usd = sum((r["amount_usd"] for r in rows if r["status"] == "held"), D(0))
    spent_usd = sum((r["cost_usd"] for r in entries), D(0))
    assert await totals(budgets, org_id, agent_id) == {"org": (spent_usd, open_usd), "agent": (spent_usd, open_usd)}


async def status_becomes(stores: Stores, org_id: UUID, hold_id: UUID, status: str) -> None:
    """A lease goes back in the background once its last draw is done."""

    async def check() -> bool:
        return any(r["id"] == hold_id and r["status"] == status for r in await holds(stores, org_id))

    await until(check, f"hold {hold_id} to be {status}")


async def settle(budgets: BudgetService, hold: BudgetHold, actual: Decimal) -> None:
    await budgets.settle(hold, actual, model="echo", prompt_tokens=3, completion_tokens=2)


async def test_a_busy_agent_draws_from_one_lease_and_each_request_is_settled_by_its_own_id(
    stores: Stores, tenant: Tenant, tick: HandClock
) -> None:
    org, alpha = tenant.org_id, tenant.agents["alpha"]
    budgets = leasing(stores.db, tick)
    first = await budgets.hold(org, alpha, rid(), CENT, HARD)
    drawn = [await budgets.hold(org, alpha, rid(), CENT, HARD) for _ in range(5)]
    assert not first.lease and all(h.lease for h in drawn)
    assert {h.id for h in drawn} == {drawn[0].id} and budgets.open_leases == 1
    rows = await holds(stores, org)
    assert [(r["status"], r["amount_usd"]) for r in rows] == [("held", CENT), ("held", D("0.10"))]
    assert rows[1]["request_id"].startswith("lease_")
    # Five draws took nothing from Postgres: the lease's ten cents are held, and the first request's own cent.
    assert await totals(budgets, org, alpha) == {"org": (0, D("0.11")), "agent": (0, D("0.11"))}

    for h in [first, *drawn]:
        await settle(budgets, h, D("0.004"))
    entries = await ledger(stores, org)
    assert [e["request_id"] for e in entries] == [h.request_id for h in [first, *drawn]]
    assert all(e["cost_usd"] == D("0.004") for e in entries)
    lease = (await holds(stores, org))[1]
    assert (lease["status"], lease["amount_usd"], lease["actual_usd"]) == ("held", D("0.05"), D("0.020"))
    await books_balance(stores, budgets, org, alpha)

    await budgets.drain()  # shutdown: the lease's remainder goes back
    assert budgets.open_leases == 0
    assert (await holds(stores, org))[1]["status"] == "released"
    assert await totals(budgets, org, alpha) == {"org": (D("0.024"), 0), "agent": (D("0.024"), 0)}
    await books_balance(stores, budgets, org, alpha)


async def test_a_draw_settled_twice_counts_once_and_a_failed_one_costs_nothing(
    stores: Stores, tenant: Tenant, tick: HandClock
) -> None:
    org, alpha = tenant.org_id, tenant.agents["alpha"]
    budgets = leasing(stores.db, tick)
    await budgets.hold(org, alpha, rid(), CENT, HARD)
    twice, failed = [await budgets.hold(org, alpha, rid(), CENT, HARD) for _ in range(2)]
    await settle(budgets, twice, D("0.007"))
    await settle(budgets, twice, D("0.009"))
    await budgets.release(failed)  # nothing served: no ledger row, its cent stays in the lease until it goes back
    assert [(e["request_id"], e["cost_usd"]) for e in await ledger(stores, org)] == [(twice.request_id, D("0.007"))]
    await books_balance(stores, budgets, org, alpha)
    await budgets.drain()
    await books_balance(stores, budgets, org, alpha)
    assert (await budgets.spend(org, alpha)).held_usd == CENT  # only the first request's own hold, never settled


async def test_a_batch_settles_each_draw_once_and_moves_the_lease_by_its_sums(
    stores: Stores, tenant: Tenant, tick: HandClock
) -> None:
    """The proxy's batch statement (migration 0036): draws as sets beside an ordinary hold, the same request twice
    in one batch, a lease of no one, and the whole batch again."""
    org, alpha = tenant.org_id, tenant.agents["alpha"]
    budgets = leasing(stores.db, tick)
    alone = await budgets.hold(org, alpha, rid(), CENT, HARD)
    drawn = [await budgets.hold(org, alpha, rid(), CENT, HARD) for _ in range(4)]
    assert not alone.lease and all(h.lease for h in drawn) and len({h.id for h in drawn}) == 1
    lease_before = {r["id"]: r["amount_usd"] for r in await holds(stores, org)}[drawn[0].id]
    forged = BudgetHold(uuid4(), org, alpha, rid(), CENT, drawn[0].period_start, False, lease=True)
    answered = [alone, *drawn, drawn[1], forged]
    batch = [
        (budgets.settlement(h, D("0.004") + D("0.001") * i, model="echo", prompt_tokens=3, completion_tokens=2),
         Turn(f"s{i}", h.request_id, [f"m{i}"], f"c{i}", 3, 2, 1.5))
        for i, h in enumerate(answered)
    ]  # fmt: skip
    sessions = SessionService(stores.db)
    written = await sessions.settle_and_record_turns(org, alpha, batch)
    assert [w.hold_before for w in written] == [HoldStatus.HELD] * 5 + [HoldStatus.SETTLED, None]
    assert all(w.turn == 1 and w.checkpoint_error is None for w in written)
    entries = await ledger(stores, org)
    assert sorted((e["request_id"], e["cost_usd"]) for e in entries) == sorted(
        (h.request_id, D("0.004") + D("0.001") * i) for i, h in enumerate(answered[:5])
    )
    lease_after = {r["id"]: (r["amount_usd"], r["actual_usd"]) for r in await holds(stores, org)}[drawn[0].id]
    assert lease_after == (lease_before - 4 * CENT, D("0.005") + D("0.006") + D("0.007") + D("0.008"))
    await books_balance(stores, budgets, org, alpha)
    spent = sum((e["cost_usd"] for e in entries), D(0))
    assert (await budgets.spend(org, alpha)).spent_usd == spent == D("0.030")
    again = await sessions.settle_and_record_turns(org, alpha, batch)
    assert [w.hold_before for w in again] == [HoldStatus.SETTLED] * 6 + [None]
    assert len(await ledger(stores, org)) == 5
    await books_balance(stores, budgets, org, alpha)
    assert (await budgets.spend(org, alpha)).spent_usd == spent


async def test_a_batch_with_an_invalid_draw_writes_nothing(stores: Stores, tenant: Tenant, tick: HandClock) -> None:
    org, alpha = tenant.org_id, tenant.agents["alpha"]
    budgets = leasing(stores.db, tick)
    await budgets.hold(org, alpha, rid(), CENT, HARD)
    good, bad = [await budgets.hold(org, alpha, rid(), CENT, HARD) for _ in range(2)]
    named_like_a_lease = BudgetHold(bad.id, org, alpha, "lease_" + uuid4().hex, CENT, bad.period_start, False,
                                    lease=True)  # fmt: skip
    batch = [
        (budgets.settlement(h, D("0.004"), model="echo", prompt_tokens=3, completion_tokens=2),
         Turn(f"s{i}", h.request_id, ["m"], "c", 3, 2, 1.5))
        for i, h in enumerate([good, named_like_a_lease])
    ]  # fmt: skip
    with pytest.raises(asyncpg.InvalidParameterValueError):
        await SessionService(stores.db).settle_and_record_turns(org, alpha, batch)
    assert await ledger(stores, org) == []
    await books_balance(stores, budgets, org, alpha)


async def test_a_lease_that_aged_goes_back_after_its_last_draw_is_settled(
    stores: Stores, tenant: Tenant, tick: HandClock
) -> None:
    org, alpha = tenant.org_id, tenant.agents["alpha"]
    budgets = leasing(stores.db, tick)
    await budgets.hold(org, alpha, rid(), CENT, ROOMY)
    old = await budgets.hold(org, alpha, rid(), CENT, ROOMY)
    tick.now += 61  # the lease is too old to draw from: the next request starts a new one
    tick_hold = await budgets.hold(org, alpha, rid(), CENT, ROOMY)
    assert tick_hold.lease is False  # the agent was idle a minute: held alone, no lease yet
    new = await budgets.hold(org, alpha, rid(), CENT, ROOMY)
    assert new.lease and new.id != old.id
    assert (await holds(stores, org))[1]["status"] == "held"  # one draw of the old lease is still out
    await settle(budgets, old, D("0.005"))
    await status_becomes(stores, org, old.id, "released")
    assert {r["id"]: r["status"] for r in await holds(stores, org)}[new.id] == "held"
    await books_balance(stores, budgets, org, alpha)


async def test_near_the_limit_a_lease_is_refused_and_the_last_of_the_budget_goes_request_by_request(
    stores: Stores, tenant: Tenant, tick: HandClock
) -> None:
    org, alpha = tenant.org_id, tenant.agents["alpha"]
    budgets = leasing(stores.db, tick)
    # A lease of 10 x 0.05 plus three times that in reserve does not fit the agent's 0.50: every hold is alone,
    # and exactly ten fit.
    held = [await budgets.hold(org, alpha, rid(), D("0.05"), HARD) for _ in range(10)]
    assert not any(h.lease for h in held)
    with pytest.raises(BudgetExceeded):
        await budgets.hold(org, alpha, rid(), D("0.05"), HARD)
    assert len(await holds(stores, org)) == 10 and budgets.open_leases == 0
    await books_balance(stores, budgets, org, alpha)


async def test_a_lease_takes_at_most_a_quarter_of_what_is_left(stores: Stores, tenant: Tenant, tick: HandClock) -> None:
    org, alpha = tenant.org_id, tenant.agents["alpha"]
    budgets = leasing(stores.db, tick)
    # 0.50 left on the agent: a lease of 0.10 (10 x 0.01) needs 0.40 free with its reserve, so it fits once.
    await budgets.hold(org, alpha, rid(), CENT, HARD)
    drawn = [await budgets.hold(org, alpha, rid(), CENT, HARD) for _ in range(10)]
    assert all(h.lease for h in drawn) and len({h.id for h in drawn}) == 1
    # The lease is spent; 0.39 is free, less than a second lease needs: requests are held alone again.
    alone = await budgets.hold(org, alpha, rid(), CENT, HARD)
    assert not alone.lease
    assert len(await holds(stores, org)) == 3
    await books_balance(stores, budgets, org, alpha)


async def test_a_new_policy_is_not_drawn_under_an_old_lease(stores: Stores, tenant: Tenant, tick: HandClock) -> None:
    org, alpha = tenant.org_id, tenant.agents["alpha"]
    budgets = leasing(stores.db, tick)
    await budgets.hold(org, alpha, rid(), CENT, HARD)
    under_old = await budgets.hold(org, alpha, rid(), CENT, HARD)
    lowered = BudgetPolicy(org_limit_usd=D("1.00"), agent_limit_usd=D("0.12"), enforcement=Enforcement.HARD_CAP)
    # The old lease is retired; a new lease (0.10 + 0.30 reserve) does not fit 0.12: this request is held alone
    # under the new limit, and so is the next, until the agent's 0.12 is used up.
    a = await budgets.hold(org, alpha, rid(), CENT, lowered)
    assert not a.lease
    with pytest.raises(BudgetExceeded):
        await budgets.hold(org, alpha, rid(), CENT, lowered)  # 0.01 + 0.10 (old lease) + 0.01 already held
    await settle(budgets, under_old, CENT)  # the old lease's only draw: it goes back, its 0.09 with it
    await status_becomes(stores, org, under_old.id, "released")
    await budgets.hold(org, alpha, rid(), CENT, lowered)
    await books_balance(stores, budgets, org, alpha)


async def test_alert_only_leases_only_within_the_limits(stores: Stores, tenant: Tenant, tick: HandClock) -> None:
    org, alpha = tenant.org_id, tenant.agents["alpha"]
    budgets = leasing(stores.db, tick)
    alert = BudgetPolicy(org_limit_usd=D("1.00"), agent_limit_usd=D("0.05"), enforcement=Enforcement.ALERT_ONLY)
    held = [await budgets.hold(org, alpha, rid(), CENT, alert) for _ in range(8)]
    assert not any(h.lease for h in held)  # no lease fits 0.05: each hold alone, and those over it are recorded
    assert [h.over_budget for h in held] == [False] * 5 + [True] * 3


async def test_a_settle_after_the_lease_expired_is_counted_once(
    stores: Stores, tenant: Tenant, tick: HandClock
) -> None:
    org, alpha = tenant.org_id, tenant.agents["alpha"]
    crashing = leasing(stores.db, tick, hold_ttl=timedelta(0))  # its lease expires at once, as if its process died
    await crashing.hold(org, alpha, rid(), CENT, HARD)
    late = await crashing.hold(org, alpha, rid(), CENT, HARD)
    assert late.lease
    await crashing.sweep_expired()
    assert all(r["status"] == "expired" for r in await holds(stores, org))
    assert await totals(crashing, org, alpha) == {"org": (0, 0), "agent": (0, 0)}
    await settle(crashing, late, D("0.006"))
    await settle(crashing, late, D("0.006"))
    assert await totals(crashing, org, alpha) == {"org": (D("0.006"), 0), "agent": (D("0.006"), 0)}
    await books_balance(stores, crashing, org, alpha)


async def test_another_orgs_lease_is_neither_drawn_nor_settled(
    stores: Stores, tenants: TenantFactory, tick: HandClock
) -> None:
    a = await tenants.create(org_spec=ORG_SPEC, agent_spec=AGENT_SPEC, agents=("alpha",), directive=None)
    b = await tenants.create(org_spec=ORG_SPEC, agent_spec=AGENT_SPEC, agents=("alpha",), directive=None)
    budgets = leasing(stores.db, tick)
    await budgets.hold(a.org_id, a.agents["alpha"], rid(), CENT, HARD)
    drawn = await budgets.hold(a.org_id, a.agents["alpha"], rid(), CENT, HARD)
    # b's first two requests do not draw from a's lease: b's first is held alone, its second leases for b.
    b1 = await budgets.hold(b.org_id, b.agents["alpha"], rid(), CENT, HARD)
    b2 = await budgets.hold(b.org_id, b.agents["alpha"], rid(), CENT, HARD)
    assert not b1.lease and b2.lease and b2.id != drawn.id
    # A settle naming a's lease under b's org finds nothing and writes nothing anywhere.
    forged = BudgetHold(drawn.id, b.org_id, b.agents["alpha"], rid(), CENT, drawn.period_start, False, lease=True)
    await settle(budgets, forged, D("0.50"))
    assert await ledger(stores, a.org_id) == [] and await ledger(stores, b.org_id) == []
    await books_balance(stores, budgets, a.org_id, a.agents["alpha"])
    await books_balance(stores, budgets, b.org_id, b.agents["alpha"])


async def test_two_leasing_replicas_together_never_overspend(
    stores: Stores, second_replica: Database, tenant: Tenant, tick: HandClock
) -> None:
    org, alpha = tenant.org_id, tenant.agents["alpha"]
    replicas = [leasing(stores.db, tick, requests=8), leasing(second_replica, tick, requests=8)]

    async def one(i: int) -> BudgetHold | None:
        try:
            return await replicas[i % 2].hold(org, alpha, rid(), CENT, HARD)
        except BudgetExceeded:
            return None

    admitted = [h for h in await asyncio.gather(*(one(i) for i in range(120))) if h is not None]
    assert any(h.lease for h in admitted)
    assert sum(h.amount_usd for h in admitted) <= D("0.50")  # the agent's cap, leases or not
    assert (await totals(replicas[0], org, alpha))["agent"][1] <= D("0.50")
    await asyncio.gather(*(settle(replicas[i % 2], h, h.amount_usd) for i, h in enumerate(admitted)))
    for replica in replicas:
        await replica.drain()
    assert await totals(replicas[0], org, alpha) == {
        "org": (CENT * len(admitted), D(0)),
        "agent": (CENT * len(admitted), D(0)),
    }
    assert len(await ledger(stores, org)) == len(admitted)
    # With every lease back, the rest of the cap is still there, request by request.
    rest = [await one(0) for _ in range(60)]
    assert len(admitted) + sum(h is not None for h in rest) == 50


async def lease_rows(stores: Stores, org_id: UUID) -> list[asyncpg.Record]:
    return [r for r in await holds(stores, org_id) if r["request_id"].startswith("lease_")]


async def test_a_steady_stream_keeps_one_lease_ahead_and_no_more(
    stores: Stores, tenant: Tenant, tick: HandClock
) -> None:
    org, alpha = tenant.org_id, tenant.agents["alpha"]
    budgets = leasing(stores.db, tick)
    open_counts = []
    for _ in range(100):
        hold = await budgets.hold(org, alpha, rid(), D("0.001"), ROOMY)
        await settle(budgets, hold, D("0.001"))
        open_counts.append(budgets.open_leases)
    # Leases of ten: about one per ten requests, the next one placed when the current one runs low.
    assert max(open_counts) <= 2
    assert 9 <= len(await lease_rows(stores, org)) <= 11
    await budgets.drain()
    await books_balance(stores, budgets, org, alpha)
    assert await totals(budgets, org, alpha) == {"org": (D("0.100"), 0), "agent": (D("0.100"), 0)}


def paced(db: Database, tick: HandClock) -> BudgetService:
    """Leases of 10 to 40 requests, sized on what the agent drew in the last half second."""
    return BudgetService(db, leases=LeaseSettings(10, seconds=60, most=40, pace_seconds=0.5), lease_clock=tick)


async def serve_every_millisecond(
    budgets: BudgetService, tick: HandClock, tenant: Tenant, n: int, held: Decimal, cost: Decimal
) -> list[BudgetHold]:
    """``n`` requests of one agent a millisecond apart, each held for ``held`` and settled at ``cost``."""
    served = []
    for _ in range(n):
        tick.now += 0.001
        hold = await budgets.hold(tenant.org_id, tenant.agents["alpha"], rid(), held, ROOMY)
        served.append(hold)
        await settle(budgets, hold, cost)
    return served


async def test_a_fast_stream_takes_fewer_larger_leases_and_pays_the_same(
    stores: Stores, tenant: Tenant, tick: HandClock
) -> None:
    org, alpha = tenant.org_id, tenant.agents["alpha"]
    budgets = paced(stores.db, tick)
    # A thousand requests a second: half a second of them is more than the most, 40.
    drawn = sum(h.lease for h in await serve_every_millisecond(budgets, tick, tenant, 100, D("0.001"), D("0.001")))
    # The first lease covers 10, the next ones 40: four leases where leases of ten take ten
    # (test_a_steady_stream_keeps_one_lease_ahead_and_no_more).
    assert 3 <= len(await lease_rows(stores, org)) <= 5 and drawn == 99
    await budgets.drain()
    await books_balance(stores, budgets, org, alpha)
    assert await totals(budgets, org, alpha) == {"org": (D("0.100"), 0), "agent": (D("0.100"), 0)}


async def test_a_refused_large_lease_leaves_the_agent_leasing_small(
    stores: Stores, tenant: Tenant, tick: HandClock
) -> None:
    org, alpha = tenant.org_id, tenant.agents["alpha"]
    budgets = paced(stores.db, tick)
    # 5.00 on the agent: a lease of 10 x 0.05 fits with its reserve (2.00), one of 40 x 0.05 (8.00) never does.
    held = await serve_every_millisecond(budgets, tick, tenant, 45, D("0.05"), CENT)
    # The refusal of the large lease did not stop the agent's leases: every hold of the last 20 was drawn from one
    # of ten (a refused lease of ten would have sent every later request to Postgres alone for 60 s).
    assert all(h.lease for h in held[-20:])
    assert len(await lease_rows(stores, org)) >= 4
    await budgets.drain()
    await books_balance(stores, budgets, org, alpha)
    assert await totals(budgets, org, alpha) == {"org": (D("0.45"), 0), "agent": (D("0.45"), 0)}
