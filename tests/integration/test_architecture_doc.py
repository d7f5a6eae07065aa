"""docs/architecture.md against the running code: the gate order, the refinery's stage order, and the failure
posture of analytics (a ClickHouse outage drops rows and counts them, it never refuses a request)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import socket
import time

import pytest
from aiohttp import ClientSession

from ibex_dataplane.proxy.app import GENERATION, METRICS
from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.settings import Settings
from ibex_dataplane.store.clickhouse import ClickHouse
from tests.support.docs import table_column
from tests.support.proxy import RunningProxy, running_proxy
from tests.support.tenants import TenantFactory


def test_the_chat_gates_run_in_the_documented_order(proxy: RunningProxy) -> None:
    documented = table_column("architecture.md", "The protected path")
    assert len(documented) == 12
    assert proxy.app[GENERATION].gate_names == documented


async def test_a_write_runs_the_documented_refinery_stages_in_order(
    proxy: RunningProxy, tenants: TenantFactory, caplog: pytest.LogCaptureFixture
) -> None:
    t = await tenants.create()
    headers = {"Authorization": f"Bearer {t.keys['alpha']}", "X-IBEX-Agent-ID": str(t.agents["alpha"])}
    with caplog.at_level(logging.INFO, logger="ibex_dataplane.memory.refinery"):
        async with ClientSession() as http, http.post(
            proxy.v1 + "/memories", json={"content": "The office opens at nine."}, headers=headers
        ) as r:  # fmt: skip
            assert r.status == 201, await r.text()
            request_id = r.headers["X-Request-ID"]
    # Only this request's line: the shared memory stage may be refining other tests' captures meanwhile.
    (line,) = [
        m for m in (r.getMessage() for r in caplog.records) if m.startswith(f"refinery request_id={request_id} ")
    ]
    ran = re.findall(r" ([a-z_]+)\[", line)
    assert ran == table_column("architecture.md", "Writing a memory")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_clickhouse_outage_drops_analytics_but_never_a_request(
    settings: Settings, stores: Stores, pepper: bytes, tenants: TenantFactory
) -> None:
    dead = ClickHouse(f"http://127.0.0.1:{closed_port()}/")
    broken = dataclasses.replace(stores, clickhouse=dead)
    t = await tenants.create()
    headers = {"Authorization": f"Bearer {t.keys['alpha']}", "X-IBEX-Agent-ID": str(t.agents["alpha"])}
    body = {"model": "echo", "messages": [{"role": "user", "content": "still there?"}]}
    try:
        fast = settings.model_copy(update={"analytics_flush_seconds": 0.05})
        async with running_proxy(fast, broken, pepper) as proxy, ClientSession() as http:
            for _ in range(3):
                async with http.post(proxy.v1 + "/chat/completions", json=body, headers=headers) as r:
                    assert r.status == 200, await r.text()
            dropped = proxy.app[METRICS].registry
            deadline = time.monotonic() + 15
            while (dropped.get_sample_value(
                "ibex_proxy_analytics_dropped_total", {"reason": "clickhouse_unavailable"}
            ) or 0) < 3:  # fmt: skip
                assert time.monotonic() < deadline, "the rows were neither written nor counted as dropped"
                await asyncio.sleep(0.05)  # polling for the flush; the count is what is asserted
            async with http.get(proxy.base_url + "/readyz") as r:
                ready = await r.json()
            # Analytics only degrade: the proxy stays ready and says so, as troubleshooting.md says.
            assert r.status == 200 and ready["status"] == "ready" and ready["degraded"] == ["clickhouse"]
            assert ready["checks"]["clickhouse"].startswith("error")
    finally:
        await dead.close()


async def test_a_refusal_after_the_budget_hold_releases_it(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores
) -> None:
    """A malformed session id is refused by the gate after `budget_hold`: the hold it placed is given back."""
    from decimal import Decimal

    from ibex_dataplane.shared.budget import BudgetService

    t = await tenants.create(org_spec={"models": {"default": "echo"}, "budget": {"monthlyLimitUSD": "5.00"}})
    headers = {"Authorization": f"Bearer {t.keys['alpha']}", "X-IBEX-Agent-ID": str(t.agents["alpha"]),
               "X-IBEX-Session-ID": "not a valid id!"}  # fmt: skip
    body = {"model": "echo", "messages": [{"role": "user", "content": "hello"}]}
    async with ClientSession() as http:
        for _ in range(3):
            async with http.post(proxy.v1 + "/chat/completions", json=body, headers=headers) as r:
                assert r.status == 400 and (await r.json())["error"]["field_errors"][0]["field"].startswith("header")
    assert stores.admin_pool is not None
    deadline = time.monotonic() + 10
    while True:  # releases run after the answer
        async with stores.admin_pool.acquire() as conn:
            rows = await conn.fetch(
                "SELECT status, count(*) AS n FROM budget_holds WHERE org_id = $1 GROUP BY status", t.org_id
            )
        holds = {r["status"]: r["n"] for r in rows}
        if set(holds) == {"released"} or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    # Each refused request had a hold and gave it back: the first its own; the others drew from a budget lease
    # (docs/budget-leases.md), which went back whole once it aged.
    assert set(holds) == {"released"} and 2 <= sum(holds.values()) <= 3
    snapshot = await BudgetService(stores.db).spend(t.org_id)
    assert (snapshot.held_usd, snapshot.spent_usd, snapshot.limit_usd) == (0, 0, Decimal("5.00"))
