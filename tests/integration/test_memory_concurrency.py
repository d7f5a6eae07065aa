"""Concurrency: the dedup invariant under parallel writes, and forget against racing writes and stale revisions."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from ibex_dataplane.memory.models import Supersession, Tenant
from ibex_dataplane.memory.repository import MemoryRepository
from ibex_dataplane.runtime.stores import Stores
from tests.support.memory import memory_client
from tests.support.proxy import RunningProxy
from tests.support.tenants import TenantFactory


async def test_the_same_content_written_20_times_in_parallel_leaves_one_active_row(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores
) -> None:
    t = await tenants.create()
    async with memory_client(proxy, t) as client:
        replies = await asyncio.gather(*(client.write({"content": "Exactly one of me survives."}) for _ in range(20)))
        batch_replies = await asyncio.gather(
            *(client.batch([{"content": "Batched twin."}, {"content": "batched TWIN."}]) for _ in range(5))
        )
    assert {r.status for r in replies} <= {200, 201}
    assert [r.status for r in replies].count(201) == 1
    assert len({r.body["memory"]["id"] for r in replies}) == 1
    twin_ids = {item["memory"]["id"] for r in batch_replies for item in r.body["results"]}
    assert len(twin_ids) == 1
    async with stores.db.tenant(t.org_id, t.agents["alpha"]) as conn:
        assert await conn.fetchval("SELECT count(*) FROM memories WHERE status = 'active'") == 2


async def test_forget_racing_a_write_leaves_the_memory_forgotten(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores
) -> None:
    t = await tenants.create()
    content = "The vault combination changes weekly."
    async with memory_client(proxy, t) as client:
        for _ in range(5):
            mid = (await client.write({"content": content})).body["memory"]["id"]
            forget, write, feedback = await asyncio.gather(
                client.forget(mid), client.write({"content": content}), client.feedback(mid, True)
            )
            assert forget.status == 204
            assert write.status in (200, 201)
            assert feedback.status in (200, 404)
            assert (await client.get(mid)).status == 404
            async with stores.db.tenant(t.org_id, t.agents["alpha"]) as conn:
                row = await conn.fetchrow("SELECT status, content, embedding FROM memories WHERE id = $1::uuid", mid)
                assert dict(row) == {"status": "forgotten", "content": None, "embedding": None}
            if write.status == 201:  # the write came after the forget: a new memory, never the old one
                assert write.body["memory"]["id"] != mid
            found = await client.search(content)
            assert mid not in {h["memory"]["id"] for h in found.body["results"]}
            for r in (await client.list()).body["data"]:
                await client.forget(r["id"])


async def test_a_write_holding_an_older_revision_cannot_resurrect_a_forgotten_memory(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores
) -> None:
    t = await tenants.create()
    tenant = Tenant(t.org_id, t.agents["alpha"])
    repo = MemoryRepository(stores.db)
    async with memory_client(proxy, t) as client:
        created = (await client.write({"content": "Stale writers lose."})).body["memory"]
        await client.forget(created["id"])
    # A refinery that read revision 1 before the forget tries to supersede it: the fence refuses.
    async with repo.transaction(tenant) as conn:
        assert not await repo.supersede(conn, tenant, Supersession(created["id"], 1, None))
    # Even raw SQL as the data plane cannot bring it back: forgotten is terminal.
    with pytest.raises(asyncpg.ObjectNotInPrerequisiteStateError):
        async with stores.db.tenant(t.org_id, t.agents["alpha"]) as conn:
            await conn.execute(
                "UPDATE memories SET status = 'active', content = 'back' WHERE id = $1::uuid", created["id"]
            )
    with pytest.raises(asyncpg.ObjectNotInPrerequisiteStateError):
        async with stores.db.tenant(t.org_id, t.agents["alpha"]) as conn:
            await conn.execute("UPDATE memories SET confidence = 0.5 WHERE id = $1::uuid", created["id"])
    async with stores.db.tenant(t.org_id, t.agents["alpha"]) as conn:
        row = await conn.fetchrow("SELECT status, content, revision FROM memories WHERE id = $1::uuid", created["id"])
    assert (row["status"], row["content"], row["revision"]) == ("forgotten", None, 2)
