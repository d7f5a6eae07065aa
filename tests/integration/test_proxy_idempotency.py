"""Idempotency-Key on non-streaming chat: same key and body replay; another body is 409; nothing is charged twice."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import ClientSession

from ibex_dataplane.runtime.stores import Stores
from tests.support.proxy import RunningProxy
from tests.support.tenants import Tenant, TenantFactory


async def post(
    proxy: RunningProxy, t: Tenant, body: dict[str, Any], key: str | None
) -> tuple[int, Any, dict[str, str]]:
    headers = {"Authorization": f"Bearer {t.keys['alpha']}", "X-IBEX-Agent-ID": str(t.agents["alpha"])}
    if key is not None:
        headers["Idempotency-Key"] = key
    async with ClientSession() as http, http.post(proxy.v1 + "/chat/completions", json=body, headers=headers) as r:
        return r.status, await r.json(), dict(r.headers)


async def ledger_rows(stores: Stores, t: Tenant) -> int:
    assert stores.admin_pool is not None
    async with stores.admin_pool.acquire() as conn:
        n: int = await conn.fetchval("SELECT count(*) FROM budget_ledger WHERE org_id = $1", t.org_id)
        return n


async def test_same_key_and_body_replays_without_calling_or_charging_again(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores
) -> None:
    t = await tenants.create(directive=None)
    body = {"model": "echo", "messages": [{"role": "user", "content": "only once"}]}
    first = await post(proxy, t, body, "order-1")
    second = await post(proxy, t, {"messages": body["messages"], "model": "echo"}, "order-1")  # same JSON, reordered
    assert first[0] == second[0] == 200
    assert second[1] == first[1]  # the very same completion, id included
    assert second[2]["X-Idempotency-Replayed"] == "true"
    assert "X-Idempotency-Replayed" not in first[2]
    await asyncio.sleep(0.5)  # settlement runs after the answer
    assert await ledger_rows(stores, t) == 1


async def test_same_key_with_another_body_is_a_conflict(proxy: RunningProxy, tenants: TenantFactory) -> None:
    t = await tenants.create(directive=None)
    assert (await post(proxy, t, {"model": "echo", "messages": [{"role": "user", "content": "a"}]}, "k"))[0] == 200
    status, body, _ = await post(proxy, t, {"model": "echo", "messages": [{"role": "user", "content": "b"}]}, "k")
    assert (status, body["error"]["code"]) == (409, "IDEMPOTENCY_CONFLICT")


async def test_keys_are_scoped_to_the_agent_and_a_bad_key_is_rejected(
    proxy: RunningProxy, tenants: TenantFactory
) -> None:
    a = await tenants.create(directive=None)
    b = await tenants.create(directive=None)
    body = {"model": "echo", "messages": [{"role": "user", "content": "shared key"}]}
    assert (await post(proxy, a, body, "same"))[0] == 200
    status, _, headers = await post(proxy, b, body, "same")
    assert status == 200
    assert "X-Idempotency-Replayed" not in headers  # another tenant's key space
    status, err, _ = await post(proxy, a, body, "bad key with spaces")
    assert (status, err["error"]["code"]) == (400, "VALIDATION_ERROR")


async def test_a_failed_gate_frees_the_key_for_a_retry(proxy: RunningProxy, tenants: TenantFactory) -> None:
    t = await tenants.create(directive=None, agent_spec={"budget": {"monthlyLimitUSD": "0.000001"}})
    body = {"model": "echo", "messages": [{"role": "user", "content": "too expensive"}]}
    assert (await post(proxy, t, body, "retry-me"))[0] == 402
    await asyncio.sleep(0.2)  # the claim is abandoned after the response
    status, err, _ = await post(proxy, t, body, "retry-me")
    assert (status, err["error"]["code"]) == (402, "BUDGET_EXCEEDED")  # evaluated again, not "in progress"
