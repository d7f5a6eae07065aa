"""The legs of a current search as one round trip each (migration 0039).

Each ``*_as`` function returns exactly the rows its leg's statement returns inside an explicit tenant transaction
with the planner settings; it gives nothing when called for another organization or another agent; and what it
sets (the tenant scope, the planner settings) ends with its statement, so the pooled connection goes back clean.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

import asyncpg
import numpy as np

from ibex_dataplane.embedding import SparseVector
from ibex_dataplane.memory import repository
from ibex_dataplane.memory.models import Tenant
from ibex_dataplane.memory.repository import MemoryRepository
from ibex_dataplane.runtime.embedded import RuntimeInfo
from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.store.postgres import Database, close_pool, create_pool
from tests.support.tenants import TenantFactory

DIM = 384
WORDS = ("lighthouse", "keeper", "seashells", "lamp", "harbour", "storm", "ferry", "gull")


def _unit(seed: int) -> np.ndarray[Any, Any]:
    v = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
    return v / np.linalg.norm(v)


async def _fill(conn: asyncpg.Connection, org: uuid.UUID, agent: uuid.UUID, n: int) -> None:
    rows = []
    for i in range(n):
        content = f"note {i}: the {WORDS[i % 8]} and the {WORDS[(i * 3 + 1) % 8]} at dusk"
        tokens = sorted({1000 + i % 13, 2000 + i % 5, 3000})
        rows.append(
            (uuid.uuid4(), org, agent, content, hashlib.sha256(content.encode()).digest(), 0.5 + (i % 5) / 10,
             _unit(i), tokens, [1.0 + (i % 3) / 4] * len(tokens))
        )  # fmt: skip
    await conn.executemany(
        "INSERT INTO memories (id, org_id, agent_id, content, content_hash, status, source, confidence, metadata,"
        " embedding, sparse_tokens, sparse_weights)"
        " VALUES ($1, $2, $3, $4, $5, 'active', 'imported', $6, '{}'::jsonb, $7, $8::integer[], $9::real[])",
        rows,
    )
    labelled = await conn.fetch("SELECT id FROM memories WHERE agent_id = $1 ORDER BY id LIMIT 10", agent)
    await conn.executemany(
        "INSERT INTO memory_labels (memory_id, label, org_id, agent_id) VALUES ($1, 'harbour', $2, $3)",
        [(r["id"], org, agent) for r in labelled],
    )


def _rows(records: list[asyncpg.Record]) -> list[tuple[Any, ...]]:
    return sorted((tuple(r) for r in records), key=lambda r: str(r[3]))


async def test_each_leg_returns_what_its_statement_returned_in_a_transaction(
    tenants: TenantFactory, stores: Stores
) -> None:
    t = await tenants.create(agents=("alpha",))
    org, agent = t.org_id, t.agents["alpha"]
    async with stores.db.tenant(org, agent) as conn:
        await _fill(conn, org, agent, 120)
    repo = MemoryRepository(stores.db)
    query = _unit(7)
    tokens, weights = [1003, 2001, 3000], [0.8, 0.5, 0.2]
    for min_confidence, labels in ((None, []), (0.7, []), (None, ["harbour"])):
        legacy_vector = repository._vector_sql("= 'active'")
        legacy_text = repository._text_sql(
            "= 'active'", "ibex_memory_text_bm25_given_n($2, $4, $6::real, $7::text[], $5, $8, $9)"
        )
        legacy_sparse = f"""
            WITH fts AS MATERIALIZED (
                SELECT t.id, NULL::float8 AS similarity, t.score AS text_score, t.terms AS text_terms
                  FROM ibex_memory_sparse_postings($2, $4::integer[], $5::real[], $7::real, $8::text[], $6, $9) t
            )
            {repository._hydrated("fts", repository._filters("= 'active'", "$7", "$8"))}
        """
        async with stores.db.tenant(org, agent, readonly=True) as conn:
            await repo._ann_settings(conn)
            vector = await conn.fetch(legacy_vector, org, agent, None, query, 40, 0.0, min_confidence, labels)
            text = await conn.fetch(
                legacy_text, org, agent, None, "who keeps the lighthouse lamp", 60, min_confidence, labels, 400, 120
            )
            sparse = await conn.fetch(legacy_sparse, org, agent, None, tokens, weights, 60, min_confidence, labels, 400)
        as_vector = await stores.db.call_as_rows(
            org, agent, repository._VECTOR_AS, 100, query, 40, 0.0, min_confidence, labels
        )
        as_text = await stores.db.call_as_rows(
            org, agent, repository._TEXT_AS, 100, "who keeps the lighthouse lamp", 60, min_confidence, labels, 400, 120
        )
        as_sparse = await stores.db.call_as_rows(
            org, agent, repository._SPARSE_AS, 100, tokens, weights, 60, min_confidence, labels, 400
        )
        assert vector and text and sparse  # the corpus matches every leg: the comparison is not of empty sets
        assert _rows(as_vector) == _rows(vector)
        assert _rows(as_text) == _rows(text)
        assert _rows(as_sparse) == _rows(sparse)
        assert [list(r.keys()) for r in as_vector[:1]] == [
            list(r.keys()) for r in vector[:1]
        ]  # the same columns, in order


async def test_the_legs_give_nothing_to_another_org_or_another_agent(tenants: TenantFactory, stores: Stores) -> None:
    t = await tenants.create(agents=("alpha", "beta"))
    other = await tenants.create(agents=("alpha",))
    org, agent = t.org_id, t.agents["alpha"]
    async with stores.db.tenant(org, agent) as conn:
        await _fill(conn, org, agent, 30)
    repo = MemoryRepository(stores.db)
    mine = Tenant(org, agent)
    assert await _all_legs(repo, mine)  # the owner finds them

    for org_id, agent_id in ((other.org_id, agent), (org, t.agents["beta"]), (other.org_id, other.agents["alpha"])):
        assert await _all_legs(repo, Tenant(org_id, agent_id)) == []
        # and straight at the functions: another org's scope with this org's agent id
        assert (
            await stores.db.call_as_rows(org_id, agent_id, repository._VECTOR_AS, 100, _unit(7), 40, -1.0, None, [])
            == []
        )
        assert await stores.db.call_as_rows(
            org_id, agent_id, repository._SPARSE_AS, 100, [3000], [1.0], 60, None, [], 400
        ) == []  # fmt: skip


async def _all_legs(repo: MemoryRepository, tenant: Tenant) -> list[uuid.UUID]:
    async def ready(value: Any) -> Any:
        return value

    vector = await repo.search_vector(
        tenant, vector=ready(_unit(7)), at=None, candidates=40, min_similarity=-1.0, min_confidence=None, labels=[]
    )
    text = await repo.search_text(
        tenant, text="the lighthouse keeper", at=None, candidates=60, min_confidence=None, labels=[]
    )
    sparse_query = SparseVector(np.array([3000], dtype=np.int32), np.array([1.0], dtype=np.float32))
    sparse = await repo.search_sparse(tenant, vector=ready(sparse_query), candidates=60, min_confidence=None, labels=[])
    return [r["id"] for r in (*vector, *text, *sparse)]


async def test_nothing_a_leg_sets_outlives_its_statement(
    tenants: TenantFactory, stores: Stores, runtime_info: RuntimeInfo
) -> None:
    t = await tenants.create(agents=("alpha",))
    org, agent = t.org_id, t.agents["alpha"]
    async with stores.db.tenant(org, agent) as conn:
        await _fill(conn, org, agent, 10)
    pool = await create_pool(runtime_info.postgres_app_dsn, min_size=1, max_size=1)  # one connection: the same one
    try:
        async with pool.acquire() as conn:
            rows = await conn.fetch(repository._VECTOR_AS, org, agent, 100, _unit(7), 40, -1.0, None, [])
            assert len(rows) == 10
            after = await conn.fetchrow(_SETTINGS)
            # A custom setting once set in a session stays defined, empty; pgvector's ef_search is back at its default.
            assert after["org"] == "" and after["agent"] == ""
            assert (after["seqscan"], after["sort"], after["plans"], after["ef"]) == ("on", "on", "auto", "40")
            assert await conn.fetchval("SELECT count(*) FROM memories") == 0  # row-level security: no scope, no rows
    finally:
        await close_pool(pool)


class _EfSeen(Database):
    """A Database that notes the HNSW ef_search each tenant transaction ran with, just before it commits."""

    seen: list[str]

    @asynccontextmanager
    async def tenant(
        self, org_id: uuid.UUID, agent_id: uuid.UUID | None = None, *, readonly: bool = False
    ) -> AsyncIterator[asyncpg.Connection]:
        async with super().tenant(org_id, agent_id, readonly=readonly) as conn:
            yield conn
            self.seen.append(await conn.fetchval("SELECT current_setting('hnsw.ef_search')"))


async def test_the_write_path_s_neighbour_lookup_has_its_own_ef_search(tenants: TenantFactory, stores: Stores) -> None:
    t = await tenants.create(agents=("alpha",))
    org, agent = t.org_id, t.agents["alpha"]
    async with stores.db.tenant(org, agent) as conn:
        await _fill(conn, org, agent, 10)
    db = _EfSeen(stores.db.pool)
    db.seen = []
    repo = MemoryRepository(db, ef_search=77, neighbour_ef_search=23)
    tenant = Tenant(org, agent)
    found = await repo.neighbours(tenant, np.stack([_unit(7), _unit(8)]), k=5, min_similarity=-1.0)
    assert [len(f) for f in found] == [5, 5] and db.seen == ["23"]

    async def ready(value: Any) -> Any:
        return value

    history = await repo.search_vector(  # a read of a past instant: search's own ef_search, in its transaction
        tenant, vector=ready(_unit(7)), at=datetime.now(UTC), candidates=40, min_similarity=-1.0,
        min_confidence=None, labels=[],
    )  # fmt: skip
    assert len(history) == 10 and db.seen == ["23", "77"]
    db.seen = []
    await MemoryRepository(db).neighbours(tenant, np.stack([_unit(7)]), k=5, min_similarity=-1.0)
    assert db.seen == [str(repository.NEIGHBOUR_EF_SEARCH)]  # by default, not search's 100


_SETTINGS = """
SELECT current_setting('app.org_id', true) AS org, current_setting('app.agent_id', true) AS agent,
       current_setting('enable_seqscan') AS seqscan, current_setting('enable_sort') AS sort,
       current_setting('plan_cache_mode') AS plans, current_setting('hnsw.ef_search', true) AS ef
"""
