"""The SPLADE postings of migration 0025: written with the memory, gone when it is superseded or forgotten,
scored only inside the caller's org and agent, and filled in by the backfill for memories written before it."""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import asyncpg
import numpy as np
from aiohttp import ClientSession

from ibex_dataplane.embedding import EmbeddingError, SparseVector
from ibex_dataplane.embedding.onnx_graph import Precision
from ibex_dataplane.embedding.splade import shared_encoder
from ibex_dataplane.memory.models import Tenant
from ibex_dataplane.memory.repository import MemoryRepository, merge_legs
from ibex_dataplane.memory.sparse import SparseBackfill
from ibex_dataplane.runtime.embedded import RuntimeInfo
from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.security.principal import HEADER, Principal, http_target
from ibex_dataplane.settings import Settings
from ibex_dataplane.store.migrations import default_migrations_dir, migrate_postgres
from ibex_dataplane.store.postgres import Database, create_pool
from tests.integration.test_migrations import fresh_database
from tests.support.memory import memory_client
from tests.support.proxy import MemoryDeps, RunningProxy, RunningStage, running_memory_stage
from tests.support.tenants import TenantFactory

POSTINGS = "SELECT count(*) FROM memory_sparse_terms WHERE memory_id = $1::uuid"
SCORE = "SELECT id::text, score FROM ibex_memory_sparse_postings($1, $2::integer[], $3::real[], NULL, '{}', 10, 400)"


async def _query(text: str) -> tuple[list[int], list[float]]:
    (vector,) = await shared_encoder().encode([text])
    return vector.tokens.tolist(), vector.weights.tolist()


async def test_postings_follow_the_memory_and_are_scored_against_the_query(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores
) -> None:
    t = await tenants.create()
    agent = t.agents["alpha"]
    async with memory_client(proxy, t) as client:
        wolves = (await client.write({"content": "John signed with the Minnesota Wolves basketball team."})).body
        cake = (await client.write({"content": "Maria baked a lemon cake for her grandmother."})).body
        wolves_id, cake_id = wolves["memory"]["id"], cake["memory"]["id"]
        tokens, weights = await _query("Which basketball team did John join?")
        async with stores.db.tenant(t.org_id, agent, readonly=True) as conn:
            stored = await conn.fetchrow(
                "SELECT cardinality(sparse_tokens) AS n, sparse_tokens, sparse_weights FROM memories WHERE id = $1",
                uuid.UUID(wolves_id),
            )
            postings = await conn.fetchval(POSTINGS, wolves_id)
            scores = dict(tuple(r) for r in await conn.fetch(SCORE, agent, tokens, weights))
        assert stored["n"] > 5 and postings == stored["n"]
        assert all(w > 0 for w in stored["sparse_weights"])
        assert scores[wolves_id] > 2 * scores.get(cake_id, 0.0) and scores[wolves_id] > 1.0

        assert (await client.forget(wolves_id)).status == 204
        async with stores.db.tenant(t.org_id, agent, readonly=True) as conn:
            assert await conn.fetchval(POSTINGS, wolves_id) == 0
            erased = await conn.fetchrow(
                "SELECT sparse_tokens, sparse_weights FROM memories WHERE id = $1", uuid.UUID(wolves_id)
            )
            assert erased["sparse_tokens"] is None and erased["sparse_weights"] is None
            assert wolves_id not in dict(tuple(r) for r in await conn.fetch(SCORE, agent, tokens, weights))
            assert await conn.fetchval(POSTINGS, cake_id) > 0


async def test_deleting_a_memory_deletes_its_postings_of_both_kinds(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores
) -> None:
    """The postings tables keep no foreign key to memories (migration 0040): a statement trigger does the cascade."""
    t = await tenants.create()
    async with memory_client(proxy, t) as client:
        gone = (await client.write({"content": "Priya adopted a grey rescue greyhound named Comet."})).body
        kept = (await client.write({"content": "Tomasz repairs vintage motorcycles in his garage."})).body
    ids = [uuid.UUID(gone["memory"]["id"]), uuid.UUID(kept["memory"]["id"])]
    counts = """
        SELECT (SELECT count(*) FROM memory_terms WHERE memory_id = $1) AS terms,
               (SELECT count(*) FROM memory_sparse_terms WHERE memory_id = $1) AS sparse
    """
    assert stores.admin_pool is not None
    async with stores.admin_pool.acquire() as conn:
        before = [tuple(await conn.fetchrow(counts, i)) for i in ids]
        assert all(terms > 2 and sparse > 5 for terms, sparse in before)
        assert await conn.execute("DELETE FROM memories WHERE id = $1", ids[0]) == "DELETE 1"
        assert tuple(await conn.fetchrow(counts, ids[0])) == (0, 0)
        assert tuple(await conn.fetchrow(counts, ids[1])) == before[1]  # the other memory's postings stay


async def test_a_superseded_memory_keeps_no_postings(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores
) -> None:
    t = await tenants.create()
    async with memory_client(proxy, t) as client:
        paris = await client.write({"content": "The user lives in Paris.", "valid_from": "2020-01-01T00:00:00Z"})
        paris_id = paris.body["memory"]["id"]
        async with stores.db.tenant(t.org_id, t.agents["alpha"], readonly=True) as conn:
            assert await conn.fetchval(POSTINGS, paris_id) > 0
        berlin = await client.write({"content": "The user lives in Berlin.", "valid_from": "2023-06-01T00:00:00Z"})
        assert ("supersedes", paris_id) in {(r["kind"], r["target_id"]) for r in berlin.body["relationships"]}
        async with stores.db.tenant(t.org_id, t.agents["alpha"], readonly=True) as conn:
            assert await conn.fetchval(POSTINGS, paris_id) == 0
            assert await conn.fetchval(POSTINGS, berlin.body["memory"]["id"]) > 0


async def test_the_scoring_function_sees_only_the_callers_org_and_agent(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores
) -> None:
    owner = await tenants.create(agents=("alpha", "beta"))
    stranger = await tenants.create()
    alpha = owner.agents["alpha"]
    async with memory_client(proxy, owner, agent="alpha") as client:
        written = await client.write({"content": "The vault code is kept in the blue kumquat notebook."})
        memory_id = written.body["memory"]["id"]
    tokens, weights = await _query("Where is the vault code kept?")
    async with stores.db.tenant(owner.org_id, alpha, readonly=True) as conn:
        assert memory_id in dict(tuple(r) for r in await conn.fetch(SCORE, alpha, tokens, weights))
    # Another org naming the owner's agent, and another agent of the same org, get nothing through it.
    async with stores.db.tenant(stranger.org_id, stranger.agents["alpha"], readonly=True) as conn:
        assert await conn.fetch(SCORE, alpha, tokens, weights) == []
        assert await conn.fetchval("SELECT count(*) FROM memory_sparse_terms") == 0
    async with stores.db.tenant(stranger.org_id, None, readonly=True) as conn:
        assert await conn.fetch(SCORE, alpha, tokens, weights) == []
    async with stores.db.tenant(owner.org_id, owner.agents["beta"], readonly=True) as conn:
        assert await conn.fetch(SCORE, alpha, tokens, weights) == []
        assert await conn.fetchval("SELECT count(*) FROM memory_sparse_terms") == 0


async def test_memories_written_before_the_migration_get_weights_from_the_backfill(
    runtime_info: RuntimeInfo, tmp_path: Path
) -> None:
    dsn = await fresh_database(runtime_info)
    earlier = tmp_path / "postgres"
    earlier.mkdir()
    for migration in sorted((default_migrations_dir() / "postgres").glob("*.sql")):
        if migration.name < "0025":
            shutil.copy(migration, earlier)
    await migrate_postgres(dsn, earlier)
    org, agent = uuid.uuid4(), uuid.uuid4()
    contents = ["John signed with the Minnesota Wolves basketball team.", "Maria baked a lemon cake."]
    ids = [uuid.uuid4() for _ in contents]
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("INSERT INTO organizations (id, namespace, name) VALUES ($1, 'ns', 'o')", org)
        await conn.execute("INSERT INTO agents (id, org_id, namespace, name) VALUES ($1, $2, 'ns', 'a')", agent, org)
        for memory_id, content in zip(ids, contents, strict=True):
            await conn.execute(
                "INSERT INTO memories (id, org_id, agent_id, content, content_hash, status, source)"
                " VALUES ($1, $2, $3, $4, $5, 'active', 'imported')",
                memory_id, org, agent, content, uuid.uuid4().bytes,
            )  # fmt: skip
        await migrate_postgres(dsn, default_migrations_dir() / "postgres")
        assert await conn.fetchval("SELECT count(*) FROM memory_sparse_terms") == 0
        pool = await create_pool(dsn, min_size=1, max_size=2)
        try:
            repo = MemoryRepository(Database(pool))
            revisions = {r["id"]: r["revision"] for r in await conn.fetch("SELECT id, revision FROM memories")}
            assert len(await repo.sparse_pending(10)) == 2
            assert await SparseBackfill(repo, shared_encoder(), batch=1).run() == 2
            assert await repo.sparse_pending(10) == []
            assert await SparseBackfill(repo, shared_encoder()).run_once() == 0
            tokens, weights = await _query("Which basketball team did John join?")
            async with Database(pool).tenant(org, agent, readonly=True) as scoped:
                scores = dict(tuple(r) for r in await scoped.fetch(SCORE, agent, tokens, weights))
            rows = await repo.search_sparse(
                Tenant(org, agent), vector=_ready(tokens, weights), candidates=5, min_confidence=None, labels=()
            )
        finally:
            await pool.close()
        per_memory = {r["memory_id"]: r["n"] for r in await conn.fetch(
            "SELECT memory_id, count(*) AS n FROM memory_sparse_terms GROUP BY 1")}  # fmt: skip
        after = {r["id"]: r["revision"] for r in await conn.fetch("SELECT id, revision FROM memories")}
    finally:
        await conn.close()
    assert set(per_memory) == set(ids) and min(per_memory.values()) > 3
    assert after == revisions  # weights are not a change of the memory: writers holding a revision are not upset
    assert scores[str(ids[0])] > scores.get(str(ids[1]), 0.0)
    (best, *_) = merge_legs([], [], rows)
    assert best.memory.id == ids[0] and best.sparse_score is not None and best.text_score is None


async def _ready(tokens: list[int], weights: list[float]) -> SparseVector:
    return SparseVector(np.asarray(tokens, np.int32), np.asarray(weights, np.float32))


class _BrokenSparse:
    model_name = "broken"

    async def encode(self, texts: Sequence[str]) -> list[SparseVector]:
        raise EmbeddingError("model file is corrupt")


async def _post(
    stage: RunningStage, http: ClientSession, org_id: uuid.UUID, agent: uuid.UUID, path: str, body: dict[str, object]
) -> tuple[int, dict[str, object]]:
    """A call straight to the memory stage, signed as the proxy signs it."""
    principal = Principal(
        org_id, agent, frozenset({"memory:write", "memory:read"}), "r1", time.time() + 30, http_target("POST", path)
    )
    async with http.post(stage.base_url + path, json=body, headers={HEADER: stage.signer.sign(principal)}) as r:
        return r.status, await r.json()


async def test_a_failing_sparse_model_stores_nothing_and_search_says_degraded(
    settings: Settings, stores: Stores, memory_deps: MemoryDeps, tenants: TenantFactory
) -> None:
    t = await tenants.create()
    agent = t.agents["alpha"]
    stage_cm = running_memory_stage(settings, stores, memory_deps, sparse=_BrokenSparse())
    async with stage_cm as stage, ClientSession() as http:
        status, body = await _post(stage, http, t.org_id, agent, "/v1/memories", {"content": "Never encoded."})
        assert status == 503, body
        status, body = await _post(stage, http, t.org_id, agent, "/v1/memories/search", {"query": "anything"})
        assert status == 503, body
    async with stores.db.tenant(t.org_id, agent, readonly=True) as conn:
        assert await conn.fetchval("SELECT count(*) FROM memories") == 0


async def test_the_sparse_precision_setting_decides_the_stored_vector(
    settings: Settings, stores: Stores, memory_deps: MemoryDeps, tenants: TenantFactory
) -> None:
    t = await tenants.create()
    agent = t.agents["alpha"]
    other: dict[Precision, Precision] = {"float32": "int8", "int8": "float32"}
    for precision in other:
        text = f"Gina opened an online clothing store after losing her job at the bank ({precision})."
        chosen = settings.model_copy(update={"memory_sparse_precision": precision})
        async with running_memory_stage(chosen, stores, memory_deps) as stage, ClientSession() as http:
            status, body = await _post(stage, http, t.org_id, agent, "/v1/memories", {"content": text})
            assert status == 201, body
        memory_id = uuid.UUID(str(body["memory"]["id"]))  # type: ignore[index]
        async with stores.db.tenant(t.org_id, agent, readonly=True) as conn:
            row = await conn.fetchrow("SELECT sparse_tokens, sparse_weights FROM memories WHERE id = $1", memory_id)
        (expected,) = await shared_encoder(precision).encode([text])
        assert row["sparse_tokens"] == expected.tokens.tolist()
        np.testing.assert_allclose(row["sparse_weights"], expected.weights, rtol=1e-6)
        (unchosen,) = await shared_encoder(other[precision]).encode([text])  # close, but not the same arithmetic
        same_terms = row["sparse_tokens"] == unchosen.tokens.tolist()
        assert not same_terms or not np.allclose(row["sparse_weights"], unchosen.weights, rtol=1e-6)
