"""The read fence of the two postings functions (migration 0033): each scored memory is one primary-key probe, so
a search statement's work follows what the query matches, not how many memories the agent holds.

Measured in buffers (``EXPLAIN (ANALYZE, BUFFERS)``), not in time: the same query over an agent of 40 memories and
one of 1,200, where the query matches the same 6 memories in both (measured: 16 and 23 buffers for the sparse
function, 27 and 37 for the text one). The plan that walked every active memory of the
agent once per scored row read 107 and 2,594, and 47 and 953."""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import Any

import asyncpg

from ibex_dataplane.runtime.stores import Stores
from tests.support.tenants import TenantFactory

SPARSE = "ibex_memory_sparse_postings($1, $2::integer[], $3::real[], NULL, '{}', 10, 400)"
TEXT = "ibex_memory_text_bm25_given_n($1, $2, NULL, '{}', 10, 400, 10)"  # idf's N given: the fence alone
MATCHED = 6
RARE_TOKEN = 29999


async def _fill(conn: asyncpg.Connection, org: uuid.UUID, agent: uuid.UUID, filler: int) -> None:
    """``filler`` memories the query does not match, then ``MATCHED`` that it does."""
    rows: list[tuple[Any, ...]] = []
    for i in range(filler + MATCHED):
        matched = i >= filler
        content = f"zebra crossing number {i}" if matched else f"garden note {i} about tomatoes and basil"
        tokens = [RARE_TOKEN, 1000 + i % 7] if matched else [2000 + i % 50, 3000 + i % 11]
        rows.append((uuid.uuid4(), org, agent, content, hashlib.sha256(content.encode()).digest(), tokens, [1.0, 0.5]))
    await conn.executemany(
        "INSERT INTO memories (id, org_id, agent_id, content, content_hash, status, source, confidence, metadata,"
        " sparse_tokens, sparse_weights)"
        " VALUES ($1, $2, $3, $4, $5, 'active', 'imported', 0.9, '{}'::jsonb, $6::integer[], $7::real[])",
        rows,
    )


async def _buffers(conn: asyncpg.Connection, function: str, *args: Any) -> tuple[int, int]:
    """Shared buffers the call touched, and the rows it returned (the second call: the first one also reads the
    catalog to plan the function's body)."""
    for _ in range(2):
        plan = json.loads(
            await conn.fetchval(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) SELECT * FROM {function}", *args)
        )[0]["Plan"]
    return int(plan["Shared Hit Blocks"]) + int(plan["Shared Read Blocks"]), int(plan["Actual Rows"])


async def test_the_fence_costs_per_scored_memory_not_per_memory_of_the_agent(
    tenants: TenantFactory, stores: Stores
) -> None:
    small, large = await tenants.create(agents=("alpha",)), await tenants.create(agents=("alpha",))
    costs: dict[str, list[int]] = {"sparse": [], "text": []}
    for tenant, filler in ((small, 40), (large, 1200)):
        agent = tenant.agents["alpha"]
        async with stores.db.tenant(tenant.org_id, agent) as conn:
            await _fill(conn, tenant.org_id, agent, filler)
        async with stores.db.tenant(tenant.org_id, agent, readonly=True) as conn:
            sparse, found = await _buffers(conn, SPARSE, agent, [RARE_TOKEN], [1.0])
            assert found == MATCHED
            text, found = await _buffers(conn, TEXT, agent, "zebra")
            assert found == MATCHED
        costs["sparse"].append(sparse)
        costs["text"].append(text)
    for leg, (at_40, at_1200) in costs.items():
        # Thirty times the memories, the same matches: at most a few more index pages, never a walk of the agent.
        assert at_1200 <= at_40 + 40, (leg, costs)
