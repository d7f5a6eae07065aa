"""The five idempotency outcomes of architecture section 9.2, over HTTP, against the real Postgres ledger."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest_asyncio
from aiohttp import ClientSession

from ibex_dataplane.runtime.embedded import EmbeddedRuntime
from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.security.principal import HEADER, Principal, http_target
from ibex_dataplane.settings import Settings
from ibex_dataplane.shared.idempotency import Claim, IdempotencyLedger, StoredResponse, fingerprint
from ibex_dataplane.store.postgres import Database, create_pool
from tests.support.memory import memory_client
from tests.support.proxy import MemoryDeps, RunningProxy, RunningStage, running_memory_stage
from tests.support.tenants import Tenant, TenantFactory


@pytest_asyncio.fixture
async def dead_db(embedded: EmbeddedRuntime) -> AsyncIterator[Database]:
    """A Database whose pool is closed: every call fails the way an unreachable Postgres does."""
    pool = await create_pool(embedded.info.postgres_app_dsn, min_size=0, max_size=1)
    await pool.close()
    yield Database(pool)


async def count(stores: Stores, t: Tenant, sql: str) -> int:
    async with stores.db.tenant(t.org_id, t.agents["alpha"]) as conn:
        value: int = await conn.fetchval(sql)
        return value


async def post_direct(
    stage: RunningStage, t: Tenant, body: Any, key: str, seen: dict[str, str] | None = None
) -> tuple[int, dict[str, Any]]:
    """Write straight to the stage; ``seen`` receives the response headers."""
    principal = Principal(
        t.org_id,
        t.agents["alpha"],
        frozenset({"memory:write"}),
        "req-direct",
        time.time() + 30,
        http_target("POST", "/v1/memories"),
    )
    headers = {HEADER: stage.signer.sign(principal), "Idempotency-Key": key}
    async with ClientSession() as http, http.post(stage.base_url + "/v1/memories", json=body, headers=headers) as r:
        if seen is not None:
            seen.update(r.headers)
        return r.status, await r.json()


async def test_same_key_same_body_replays_the_stored_response(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores
) -> None:
    t = await tenants.create()
    async with memory_client(proxy, t) as client:
        body = {"content": "Replay me exactly once.", "labels": ["a"]}
        first = await client.write(body, headers={"Idempotency-Key": "k-1"})
        assert first.status == 201 and "X-Idempotency-Replayed" not in first.headers
        # Same body with keys in another order is the same request.
        again = await client.write({"labels": ["a"], "content": "Replay me exactly once."},
                                   headers={"X-Idempotency-Key": "k-1"})  # fmt: skip
        assert again.status == 201
        assert again.headers["X-Idempotency-Replayed"] == "true"
        assert again.raw == first.raw
    assert await count(stores, t, "SELECT count(*) FROM memories") == 1


async def test_same_key_different_body_is_409_conflict(proxy: RunningProxy, tenants: TenantFactory) -> None:
    t = await tenants.create()
    async with memory_client(proxy, t) as client:
        assert (await client.write({"content": "one"}, headers={"Idempotency-Key": "k"})).status == 201
        other = await client.write({"content": "two"}, headers={"Idempotency-Key": "k"})
        assert other.status == 409 and other.error_code() == "IDEMPOTENCY_CONFLICT"
        # Keys are scoped by agent: beta may use the same key for its own request.
        beta = client.as_(t.keys["beta"], str(t.agents["beta"]))
        assert (await beta.write({"content": "two"}, headers={"Idempotency-Key": "k"})).status == 201


async def test_a_claim_still_running_is_409_in_progress_with_retry_after(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores
) -> None:
    t = await tenants.create()
    body = {"content": "Slow write in flight."}
    ledger = IdempotencyLedger(stores.db)
    claim = await ledger.claim(
        t.org_id, t.agents["alpha"], "k-busy", "POST /v1/memories", fingerprint("POST /v1/memories", orjson.dumps(body))
    )
    assert isinstance(claim, Claim)
    async with memory_client(proxy, t) as client:
        busy = await client.write(body, headers={"Idempotency-Key": "k-busy"})
        assert busy.status == 409 and busy.error_code() == "IDEMPOTENCY_IN_PROGRESS"
        assert int(busy.headers["Retry-After"]) >= 1
        await ledger.complete(claim, StoredResponse(201, b'{"memory": null}'))
        done = await client.write(body, headers={"Idempotency-Key": "k-busy"})
        assert done.status == 201 and done.raw == b'{"memory": null}'
    assert await count(stores, t, "SELECT count(*) FROM memories") == 0


async def test_an_unreachable_ledger_is_503_and_nothing_is_written(
    settings: Settings, stores: Stores, memory_deps: MemoryDeps, tenants: TenantFactory, dead_db: Database
) -> None:
    t = await tenants.create()
    seen: dict[str, str] = {}
    async with running_memory_stage(settings, stores, memory_deps, ledger=IdempotencyLedger(dead_db)) as stage:
        status, body = await post_direct(stage, t, {"content": "Never written."}, "k-down", seen)
    assert (status, body["error"]["code"]) == (503, "IDEMPOTENCY_UNAVAILABLE")
    assert int(seen["Retry-After"]) >= 1  # every 503 says when to come back
    assert await count(stores, t, "SELECT count(*) FROM memories") == 0


async def test_a_claim_that_cannot_be_finalized_is_503_never_success(
    settings: Settings, stores: Stores, memory_deps: MemoryDeps, tenants: TenantFactory, dead_db: Database
) -> None:
    class FinalizeFails(IdempotencyLedger):
        async def complete(self, claim: Claim, response: StoredResponse) -> None:
            await IdempotencyLedger(dead_db).complete(claim, response)

    t = await tenants.create()
    body = {"content": "Committed, but the claim stays open."}
    async with running_memory_stage(settings, stores, memory_deps, ledger=FinalizeFails(stores.db)) as broken:
        status, reply = await post_direct(broken, t, body, "k-final")
    assert (status, reply["error"]["code"]) == (503, "IDEMPOTENCY_UNAVAILABLE")
    assert await count(stores, t, "SELECT count(*) FROM memories") == 1  # the row did commit
    async with running_memory_stage(settings, stores, memory_deps) as healthy:
        status, reply = await post_direct(healthy, t, body, "k-final")
        assert (status, reply["error"]["code"]) == (409, "IDEMPOTENCY_IN_PROGRESS")
        async with stores.db.tenant(t.org_id, t.agents["alpha"]) as conn:
            await conn.execute("UPDATE idempotency_keys SET locked_until = now() - interval '1 second'")
        # Once the dead claim's lock lapses, a retry takes it over and finds the committed row.
        status, reply = await post_direct(healthy, t, body, "k-final")
        assert status == 200 and reply["deduplicated"] == "exact"
    assert await count(stores, t, "SELECT count(*) FROM memories") == 1


async def test_twenty_parallel_retries_of_one_key_write_once(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores
) -> None:
    t = await tenants.create()
    async with memory_client(proxy, t) as client:
        replies = await asyncio.gather(
            *(client.write({"content": "Parallel retry."}, headers={"Idempotency-Key": "k-par"}) for _ in range(20))
        )
    statuses = sorted(r.status for r in replies)
    assert set(statuses) <= {201, 409}, statuses
    assert statuses.count(201) >= 1
    assert all(r.error_code() == "IDEMPOTENCY_IN_PROGRESS" for r in replies if r.status == 409)
    assert await count(stores, t, "SELECT count(*) FROM memories") == 1


async def test_the_ledger_row_is_invisible_without_the_org(stores: Stores, tenants: TenantFactory) -> None:
    t = await tenants.create()
    ledger = IdempotencyLedger(stores.db)
    await ledger.claim(t.org_id, t.agents["alpha"], "k-rls", "POST /v1/memories", b"x" * 32)
    async with stores.db.unscoped() as conn:
        assert await conn.fetchval("SELECT count(*) FROM idempotency_keys") == 0
