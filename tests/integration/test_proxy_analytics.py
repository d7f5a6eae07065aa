"""Every request leaves an analytics trace (never content); usage is reported per org and never across orgs."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import ClientSession

from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.store.clickhouse import org_query
from tests.support.proxy import RunningProxy
from tests.support.tenants import TenantFactory

SECRET_WORDS = "the launch code is tangerine-42"


async def get(proxy: RunningProxy, token: str, path: str) -> tuple[int, dict[str, Any]]:
    async with (
        ClientSession() as http,
        http.get(proxy.base_url + path, headers={"Authorization": f"Bearer {token}"}) as r,
    ):
        return r.status, await r.json()


async def test_traces_and_usage_are_recorded_per_org(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores
) -> None:
    a = await tenants.create(org_spec={"models": {"allow": ["echo"], "default": "echo"}})
    b = await tenants.create()
    headers = {"Authorization": f"Bearer {a.keys['alpha']}", "X-IBEX-Agent-ID": str(a.agents["alpha"])}
    async with ClientSession() as http:
        ok = {"model": "echo", "messages": [{"role": "user", "content": SECRET_WORDS}]}
        async with http.post(proxy.v1 + "/chat/completions", json=ok, headers=headers) as r:
            assert r.status == 200
        denied = {"model": "gpt-4o", "messages": [{"role": "user", "content": SECRET_WORDS}]}
        async with http.post(proxy.v1 + "/chat/completions", json=denied, headers=headers) as r:
            assert r.status == 403

    deadline = time.monotonic() + 10
    while True:
        status, report = await get(proxy, a.keys["alpha"], "/v1/usage?group_by=agent")
        assert status == 200
        if report["data"] or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    assert [row["key"] for row in report["data"]] == [str(a.agents["alpha"])]
    assert report["data"][0]["agent_name"] == f"alpha-{a.name.removeprefix('org-')}"  # the name people read
    assert report["data"][0]["requests"] == 1
    assert float(report["data"][0]["cost_usd"]) > 0

    traces = await stores.clickhouse.query(
        org_query(
            "SELECT status_code, error_code, model FROM llm_traces WHERE org_id = {org_id:UUID} ORDER BY ts",
            a.org_id,
        )
    )
    assert traces == [(200, "", "echo"), (403, "MODEL_NOT_ALLOWED", "gpt-4o")]
    everything = await stores.clickhouse.admin_query("SELECT * FROM llm_traces")
    assert all(SECRET_WORDS not in str(row) for row in everything), "message content reached analytics"

    status, other = await get(proxy, b.keys["alpha"], "/v1/usage?group_by=model")
    assert status == 200
    assert other["data"] == []


async def test_usage_needs_its_scope_and_valid_parameters(proxy: RunningProxy, tenants: TenantFactory) -> None:
    t = await tenants.create(scopes=("chat",))
    status, body = await get(proxy, t.keys["alpha"], "/v1/usage")
    assert (status, body["error"]["code"]) == (403, "INSUFFICIENT_PERMISSIONS")
    u = await tenants.create()
    status, body = await get(proxy, u.keys["alpha"], "/v1/usage?group_by=planet&from=yesterday")
    assert (status, body["error"]["code"]) == (400, "VALIDATION_ERROR")
    assert {f["field"] for f in body["error"]["field_errors"]} == {"group_by", "from"}
