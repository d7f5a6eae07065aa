"""Stores that go away mid-test: the gates fail closed with 503 (never 500, never a hang) and service resumes.

Runs against private embedded stores so stopping them cannot disturb the rest of the suite.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
from aiohttp import ClientSession, ClientTimeout

from ibex_dataplane.runtime.embedded import EmbeddedRuntime, RuntimeInfo
from ibex_dataplane.runtime.stores import Stores, StoreUrls, migrations_dir
from ibex_dataplane.settings import Settings
from ibex_dataplane.store.migrations import migrate_postgres
from ibex_operator.reconcile import Reconciler
from ibex_operator.repository import TenantConfigRepository
from ibex_operator.secrets import FileSecretSink
from tests.support.proxy import RunningProxy, running_proxy
from tests.support.tenants import Tenant, TenantFactory


@dataclass
class World:
    runtime: EmbeddedRuntime
    proxy: RunningProxy
    tenant: Tenant
    stores: Stores


@pytest_asyncio.fixture
async def world(settings: Settings, pepper: bytes, stores: Stores, runtime_info: RuntimeInfo) -> AsyncIterator[World]:
    root = Path(tempfile.mkdtemp(prefix="ibex-outage-"))
    runtime = EmbeddedRuntime(root)
    await asyncio.to_thread(runtime.start)
    try:
        # chdb opens one data path at a time: share the session's (already migrated) analytics engine.
        urls = dataclasses.replace(StoreUrls.from_runtime(runtime.info), clickhouse_url=runtime_info.clickhouse_url)
        assert urls.postgres_admin_dsn is not None
        await migrate_postgres(urls.postgres_admin_dsn, migrations_dir(settings) / "postgres")
        private = await Stores.open(urls, settings, admin=True, clickhouse=stores.clickhouse)
        try:
            assert private.admin_pool is not None
            sink = FileSecretSink(root / "secrets.json")
            reconciler = Reconciler(TenantConfigRepository(private.admin_pool, private.redis), sink, pepper)
            tenant = await TenantFactory(reconciler, sink).create(agents=("solo",))
            async with running_proxy(settings, private, pepper) as proxy:
                yield World(runtime, proxy, tenant, private)
        finally:
            await private.close()
    finally:
        await asyncio.to_thread(runtime.stop)
        shutil.rmtree(root, ignore_errors=True)


async def chat(world: World) -> tuple[int, str | None, float]:
    headers = {
        "Authorization": f"Bearer {world.tenant.keys['solo']}",
        "X-IBEX-Agent-ID": str(world.tenant.agents["solo"]),
    }
    body = {"model": "echo", "messages": [{"role": "user", "content": "are you there?"}]}
    started = time.monotonic()
    async with (
        ClientSession(timeout=ClientTimeout(total=20)) as http,
        http.post(world.proxy.v1 + "/chat/completions", json=body, headers=headers) as r,
    ):
        payload = await r.json(content_type=None)
    code = payload.get("error", {}).get("code") if r.status != 200 else None
    return r.status, code, time.monotonic() - started


async def wait_for_200(world: World, within: float = 15.0) -> None:
    deadline = time.monotonic() + within
    while True:
        status, code, _ = await chat(world)
        if status == 200:
            return
        assert status == 503, (status, code)
        assert time.monotonic() < deadline, "service did not resume after the store came back"
        await asyncio.sleep(0.2)


@pytest.mark.parametrize("store", ["valkey", "postgres"])
async def test_a_store_outage_fails_closed_and_recovers(world: World, store: str) -> None:
    server = getattr(world.runtime, store)
    assert (await chat(world))[0] == 200
    port = server.port
    await asyncio.to_thread(server.stop)
    for _ in range(3):
        status, code, elapsed = await chat(world)
        assert (status, code) == (503, "SERVICE_DEGRADED")
        assert elapsed < 5
    await asyncio.to_thread(server.start, port)
    await wait_for_200(world)


async def test_a_settlement_interrupted_by_a_postgres_restart_lands_once_when_it_is_back(world: World) -> None:
    from decimal import Decimal

    from ibex_dataplane.shared.budget import BudgetPolicy, BudgetService, Enforcement

    budgets = BudgetService(world.stores.db)
    org, agent = world.tenant.org_id, world.tenant.agents["solo"]
    policy = BudgetPolicy(org_limit_usd=Decimal("1"), agent_limit_usd=None, enforcement=Enforcement.HARD_CAP)
    hold = await budgets.hold(org, agent, "req-settle-restart", Decimal("0.01"), policy)
    port = world.runtime.postgres.port
    await asyncio.to_thread(world.runtime.postgres.stop)
    settling = asyncio.create_task(
        budgets.settle(hold, Decimal("0.004"), model="echo", prompt_tokens=10, completion_tokens=5)
    )
    deadline = time.monotonic() + 15
    while budgets.retrying == 0:  # the first attempt failed and the settle is waiting to retry
        assert not settling.done(), settling
        assert time.monotonic() < deadline, "settle never retried"
        await asyncio.sleep(0.02)
    await asyncio.to_thread(world.runtime.postgres.start, port)
    await asyncio.wait_for(settling, timeout=30)
    await budgets.settle(hold, Decimal("0.004"), model="echo", prompt_tokens=10, completion_tokens=5)  # idempotent
    spend = await budgets.spend(org)
    assert (spend.spent_usd, spend.held_usd) == (Decimal("0.004"), Decimal(0))
    assert world.stores.admin_pool is not None
    async with world.stores.admin_pool.acquire() as conn:
        rows = await conn.fetch("SELECT cost_usd FROM budget_ledger WHERE org_id = $1", org)
    assert [r["cost_usd"] for r in rows] == [Decimal("0.004")]
