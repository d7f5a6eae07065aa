"""What the stores say after a fault: memory rows, budget holds, ledger and spend, and the usage facts.

Reads Postgres with the privileged role (a fresh connection each time: the server may just have restarted) and
the usage facts through each replica's ``GET /v1/usage`` (each replica keeps its analytics in its own chdb).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from decimal import Decimal
from uuid import UUID

import aiohttp
import asyncpg

from tests.chaos.load import Org, Write


@dataclass
class Books:
    """One organization's accounting for the current month."""

    holds: Counter[str] = field(default_factory=Counter)  # status -> count, holds of one request
    leases: Counter[str] = field(default_factory=Counter)  # status -> count, budget leases (docs/budget-leases.md)
    held_open_usd: Decimal = Decimal(0)  # amounts of holds and leases still 'held'
    max_hold_usd: Decimal = Decimal(0)
    ledger_rows: int = 0
    ledger_drawn: int = 0  # ledger rows of requests drawn from a lease (no hold row of their own)
    ledger_usd: Decimal = Decimal(0)
    ledger_duplicates: int = 0
    spent_usd: Decimal = Decimal(0)  # org scope
    held_usd: Decimal = Decimal(0)  # org scope
    agents_spent_usd: Decimal = Decimal(0)  # sum over the agent scopes
    agent_limits: dict[UUID, tuple[Decimal | None, Decimal, Decimal]] = field(default_factory=dict)
    agent_max_hold_usd: dict[UUID, Decimal] = field(default_factory=dict)  # one request's largest reservation


async def books(admin_dsn: str, org: Org) -> Books:
    conn = await asyncpg.connect(admin_dsn, timeout=10)
    try:
        b = Books()
        for row in await conn.fetch(
            "SELECT request_id LIKE 'lease\\_%' AS lease, status, count(*) AS n, coalesce(sum(amount_usd), 0) AS"
            " amount, coalesce(max(amount_usd), 0) AS biggest FROM budget_holds WHERE org_id = $1 GROUP BY 1, 2",
            org.org_id,
        ):  # fmt: skip
            (b.leases if row["lease"] else b.holds)[row["status"]] = row["n"]
            if not row["lease"]:
                b.max_hold_usd = max(b.max_hold_usd, row["biggest"])
            if row["status"] == "held":
                b.held_open_usd += row["amount"]
        for row in await conn.fetch(  # one request's largest reservation: leases cover many
            "SELECT agent_id, max(amount_usd) AS biggest FROM budget_holds WHERE org_id = $1"
            " AND request_id NOT LIKE 'lease\\_%' GROUP BY agent_id",
            org.org_id,
        ):
            b.agent_max_hold_usd[row["agent_id"]] = row["biggest"]
        ledger = await conn.fetchrow(
            "SELECT count(*) AS n, count(DISTINCT request_id) AS ids, coalesce(sum(cost_usd), 0) AS total"
            " FROM budget_ledger WHERE org_id = $1", org.org_id,
        )  # fmt: skip
        assert ledger is not None
        b.ledger_rows, b.ledger_usd = ledger["n"], ledger["total"]
        b.ledger_duplicates = ledger["n"] - ledger["ids"]
        b.ledger_drawn = await conn.fetchval(
            "SELECT count(*) FROM budget_ledger l WHERE l.org_id = $1 AND NOT EXISTS"
            " (SELECT 1 FROM budget_holds h WHERE h.org_id = l.org_id AND h.request_id = l.request_id)", org.org_id,
        )  # fmt: skip
        for row in await conn.fetch(
            "SELECT scope_kind, scope_id, limit_usd, spent_usd, held_usd FROM budget_periods"
            " WHERE org_id = $1 AND period_start = date_trunc('month', now() AT TIME ZONE 'UTC')::date", org.org_id,
        ):  # fmt: skip
            if row["scope_kind"] == "org":
                b.spent_usd, b.held_usd = row["spent_usd"], row["held_usd"]
            else:
                b.agents_spent_usd += row["spent_usd"]
                b.agent_limits[row["scope_id"]] = (row["limit_usd"], row["spent_usd"], row["held_usd"])
        return b
    finally:
        await conn.close()


@dataclass
class MemoryAudit:
    lost: list[str]  # contents of 2xx writes with no row, or whose row differs from the answer
    duplicates: list[str]  # contents stored more than once
    unacknowledged: int  # writes that never got a 2xx (the client gave up)


async def memory_audit(admin_dsn: str, orgs: list[Org], writes: list[Write]) -> MemoryAudit:
    conn = await asyncpg.connect(admin_dsn, timeout=10)
    try:
        rows = await conn.fetch(
            "SELECT id::text AS id, org_id, content, status FROM memories WHERE org_id = ANY($1::uuid[])",
            [o.org_id for o in orgs],
        )
    finally:
        await conn.close()
    by_content: dict[str, list[asyncpg.Record]] = {}
    for row in rows:
        by_content.setdefault(row["content"], []).append(row)
    lost, duplicates = [], []
    for write in writes:
        stored = by_content.get(write.content, [])
        if len(stored) > 1:
            duplicates.append(write.content)
        if write.done:
            ids = {r["id"] for r in stored if r["org_id"] == write.org.org_id and r["status"] != "forgotten"}
            if not ids or not set(write.ids) <= ids:
                lost.append(write.content)
    return MemoryAudit(lost, duplicates, sum(1 for w in writes if not w.done))


async def usage_facts(urls: list[str], org: Org) -> tuple[int, Decimal]:
    """Requests and cost of the org's usage facts, summed over every replica's analytics."""
    requests, cost = 0, Decimal(0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        for url in urls:
            async with http.get(url + "/v1/usage", params={"group_by": "agent"}, headers=org.headers("mem")) as r:
                assert r.status == 200, (url, r.status, await r.text())
                for row in (await r.json())["data"]:
                    requests += row["requests"]
                    cost += Decimal(row["cost_usd"])
    return requests, cost


async def metric(http: aiohttp.ClientSession, url: str, name: str, labels: str = "") -> float:
    """One counter of a replica's /metrics (0 when absent)."""
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (not labels or labels in line) and not line.startswith(name + "_created"):
            total += float(line.rsplit(" ", 1)[1])
    return total
