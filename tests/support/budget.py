"""What the budget tests share: the tenant's limits, request ids, and reads of the totals and the ledger."""

from __future__ import annotations

from decimal import Decimal
from uuid import UUID, uuid4

import asyncpg

from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.shared.budget import BudgetPolicy, BudgetService, Enforcement

D = Decimal

HARD = BudgetPolicy(org_limit_usd=D("1.00"), agent_limit_usd=D("0.50"), enforcement=Enforcement.HARD_CAP)
ORG_SPEC = {"budget": {"monthlyLimitUSD": "1.00", "enforcement": "HardCap"}}
AGENT_SPEC = {"budget": {"monthlyLimitUSD": "0.50"}}


def rid() -> str:
    return f"req_{uuid4().hex}"


async def totals(budgets: BudgetService, org_id: UUID, agent_id: UUID) -> dict[str, tuple[Decimal, Decimal]]:
    """(spent, held) of the org and of the agent for the current period."""
    org = await budgets.spend(org_id)
    agent = await budgets.spend(org_id, agent_id)
    return {"org": (org.spent_usd, org.held_usd), "agent": (agent.spent_usd, agent.held_usd)}


async def ledger(stores: Stores, org_id: UUID) -> list[asyncpg.Record]:
    async with stores.db.tenant(org_id) as conn:
        return list(
            await conn.fetch(
                "SELECT agent_id, request_id, model, prompt_tokens, completion_tokens, cost_usd FROM budget_ledger"
                " WHERE org_id = $1 ORDER BY id",
                org_id,
            )
        )
