"""Every SQL statement on the budget tables (budget_periods, budget_holds, budget_ledger).

Called only by :class:`ibex_dataplane.shared.budget.BudgetService`. The accounting itself lives in the SQL functions
of ``migrations/postgres/0002_budget.sql`` so that each hold, settle and release is one statement (one round trip)
inside a :meth:`Database.tenant` transaction, which is what binds it to the org through row-level security. The
sweeper is the one cross-tenant call: it goes through ``Database.unscoped`` to a SECURITY DEFINER function.

This module also owns the translation of asyncpg's errors: anything meaning "Postgres is not there" becomes
:class:`StoreUnavailable` (budgets fail closed, the proxy answers 503).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import date, timedelta
from decimal import Decimal
from enum import StrEnum
from uuid import UUID

import asyncpg

from ibex_dataplane.store.postgres import Database, postgres_errors

# "Not reachable" also covers a server shutting down under us (57P01 ...) and statement timeouts (57014).

# The hot path uses the one-statement *_as entry points of migration 0009 (through Database.call_as): the tenant
# is set inside the statement, so the hot budget rows stay locked for one round trip instead of until a COMMIT.
_HOLD = (
    "SELECT outcome, scope, scope_limit, scope_spent, scope_held"
    " FROM ibex_budget_hold_as($1::uuid, $2::uuid, $3::uuid, $4::text, $5::date, $6::numeric, $7::numeric,"
    " $8::numeric, $9::text, $10::interval)"
)
_SETTLE = (
    "SELECT ibex_budget_settle_as($1::uuid, $2::uuid, $3::uuid, $4::numeric, $5::text, $6::integer, $7::integer)"
    " AS status"
)
_LEASE = (
    "SELECT ibex_budget_lease_as($1::uuid, $2::uuid, $3::uuid, $4::date, $5::numeric, $6::numeric, $7::numeric,"
    " $8::numeric, $9::text, $10::interval) AS outcome"
)
_SETTLE_DRAW = (
    "SELECT ibex_budget_settle_draw_as($1::uuid, $2::uuid, $3::uuid, $4::text, $5::numeric, $6::numeric, $7::text,"
    " $8::integer, $9::integer) AS status"
)
_RELEASE = "SELECT ibex_budget_release_as($1::uuid, $2::uuid, $3::uuid) AS status"
_SWEEP = "SELECT ibex_sweep_expired_holds($1::integer)"
_PERIOD = (
    "SELECT limit_usd, enforcement, spent_usd, held_usd FROM budget_periods"
    " WHERE org_id = $1 AND scope_id = $2 AND period_start = $3"
)


class HoldOutcome(StrEnum):
    """What ``ibex_budget_hold`` did."""

    HELD = "held"
    OVER_BUDGET = "over_budget"  # AlertOnly: held although a scope went over its limit
    REFUSED = "refused"  # HardCap: nothing held anywhere
    DUPLICATE = "duplicate"  # the org already has a hold for this request id: nothing held


class HoldStatus(StrEnum):
    """``budget_holds.status``."""

    HELD = "held"
    SETTLED = "settled"
    RELEASED = "released"
    EXPIRED = "expired"


class DuplicateBudgetHold(Exception):
    """The org already has a budget hold for this request id (ids key the ledger, so they may not repeat)."""

    def __init__(self, request_id: str) -> None:
        super().__init__("a budget hold for this request id already exists")
        self.request_id = request_id


@dataclass(frozen=True)
class HoldResult:
    """The outcome of a hold and, unless it was plainly held, the first scope over its limit (org before agent)."""

    outcome: HoldOutcome
    scope: str | None
    limit_usd: Decimal | None
    spent_usd: Decimal | None
    held_usd: Decimal | None


@dataclass(frozen=True)
class PeriodRow:
    """One scope's running totals for one month."""

    limit_usd: Decimal | None
    enforcement: str
    spent_usd: Decimal
    held_usd: Decimal


class BudgetRepository:
    """Budget statements over the data plane's RLS-bound :class:`Database`."""

    def __init__(self, db: Database) -> None:
        self._db = db

    @asynccontextmanager
    async def _tenant(
        self, org_id: UUID, agent_id: UUID | None = None, *, readonly: bool = False
    ) -> AsyncIterator[asyncpg.Connection]:
        # Database.tenant wraps failures to connect and to begin; a connection lost mid-statement surfaces here.
        with postgres_errors():
            async with self._db.tenant(org_id, agent_id, readonly=readonly) as conn:
                yield conn

    async def _call_as(self, org_id: UUID, agent_id: UUID, sql: str, *args: object) -> asyncpg.Record | None:
        with postgres_errors():
            return await self._db.call_as(org_id, agent_id, sql, *args)

    async def place_hold(
        self,
        org_id: UUID,
        agent_id: UUID,
        *,
        hold_id: UUID,
        request_id: str,
        period_start: date,
        amount_usd: Decimal,
        org_limit_usd: Decimal | None,
        agent_limit_usd: Decimal | None,
        enforcement: str,
        ttl: timedelta,
    ) -> HoldResult:
        """Check every limit, then hold on both the org and the agent or on neither (see ibex_budget_hold)."""
        row = await self._call_as(
            org_id, agent_id, _HOLD, hold_id, request_id, period_start, amount_usd, org_limit_usd, agent_limit_usd,
            enforcement, ttl,
        )  # fmt: skip
        assert row is not None  # a function call always returns one row
        return HoldResult(
            HoldOutcome(row["outcome"]), row["scope"], row["scope_limit"], row["scope_spent"], row["scope_held"]
        )

    async def settle_hold(
        self,
        org_id: UUID,
        agent_id: UUID,
        hold_id: UUID,
        *,
        actual_usd: Decimal,
        model: str,
        prompt_tokens: int,
        completion_tokens: int,
    ) -> HoldStatus | None:
        """Settle to the actual cost; returns the status the hold had before (None: not found in this org)."""
        row = await self._call_as(
            org_id, agent_id, _SETTLE, hold_id, actual_usd, model, prompt_tokens, completion_tokens
        )
        status = row["status"] if row is not None else None
        return HoldStatus(status) if status is not None else None

    async def place_lease(
        self,
        org_id: UUID,
        agent_id: UUID,
        *,
        lease_id: UUID,
        period_start: date,
        amount_usd: Decimal,
        reserve_usd: Decimal,
        org_limit_usd: Decimal | None,
        agent_limit_usd: Decimal | None,
        enforcement: str,
        ttl: timedelta,
    ) -> bool:
        """Hold ``amount_usd`` as a lease (migration 0035) if every limited scope keeps ``reserve_usd`` free
        beside it; False when refused (nothing held)."""
        row = await self._call_as(
            org_id, agent_id, _LEASE, lease_id, period_start, amount_usd, reserve_usd, org_limit_usd,
            agent_limit_usd, enforcement, ttl,
        )  # fmt: skip
        assert row is not None
        return bool(row["outcome"] == "held")

    async def settle_draw(
        self,
        org_id: UUID,
        agent_id: UUID,
        lease_id: UUID,
        *,
        request_id: str,
        drawn_usd: Decimal,
        actual_usd: Decimal,
        model: str,
        prompt_tokens: int,
        completion_tokens: int,
    ) -> HoldStatus | None:
        """Settle one request drawn from a lease, by its request id; returns the lease's status before ('settled'
        when this request was settled already; None: no such lease in this org)."""
        row = await self._call_as(
            org_id, agent_id, _SETTLE_DRAW, lease_id, request_id, drawn_usd, actual_usd, model, prompt_tokens,
            completion_tokens,
        )  # fmt: skip
        status = row["status"] if row is not None else None
        return HoldStatus(status) if status is not None else None

    async def release_hold(self, org_id: UUID, agent_id: UUID, hold_id: UUID) -> HoldStatus | None:
        """Release a still-held hold; returns the status it had before (None: not found in this org)."""
        row = await self._call_as(org_id, agent_id, _RELEASE, hold_id)
        status = row["status"] if row is not None else None
        return HoldStatus(status) if status is not None else None

    async def read_period(self, org_id: UUID, scope_id: UUID, period_start: date) -> PeriodRow | None:
        """One scope's row for one month, or None before its first hold."""
        async with self._tenant(org_id, readonly=True) as conn:
            row = await conn.fetchrow(_PERIOD, org_id, scope_id, period_start)
        if row is None:
            return None
        return PeriodRow(row["limit_usd"], row["enforcement"], row["spent_usd"], row["held_usd"])

    async def sweep_expired(self, limit: int) -> int:
        """Expire up to ``limit`` overdue holds across every org in one transaction; returns how many."""
        with postgres_errors():
            async with self._db.unscoped() as conn:
                swept = await conn.fetchval(_SWEEP, limit)
        return int(swept)
