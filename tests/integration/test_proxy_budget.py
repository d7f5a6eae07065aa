"""Budgets through the proxy: concurrent requests never spend past a HardCap, and the ledger reconciles."""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
from decimal import Decimal

from aiohttp import ClientSession

from ibex_dataplane.providers.catalog import ModelCatalog
from ibex_dataplane.providers.tokens import TokenizerFamily, estimate_chat_tokens
from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.settings import Settings
from tests.support.proxy import RunningProxy, running_proxy
from tests.support.tenants import TenantFactory

MESSAGES = [{"role": "user", "content": "what does this cost?"}]


async def test_fifty_concurrent_requests_against_a_budget_for_ten(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores
) -> None:
    # max_tokens=1 makes every hold equal to the cost it settles to, so exactly ten fit (with memory off: holds of
    # memory-enabled agents also cover the context the stage may add, see test_context).
    prompt = estimate_chat_tokens(MESSAGES, TokenizerFamily.GENERIC).tokens
    per_call = ModelCatalog.builtin().worst_case_cost("echo", prompt, 1)
    limit = per_call * 10
    spec = {"budget": {"monthlyLimitUSD": format(limit, "f")}, "memory": {"enabled": False}}
    t = await tenants.create(agents=("spender",), directive=None, agent_spec=spec)
    headers = {"Authorization": f"Bearer {t.keys['spender']}", "X-IBEX-Agent-ID": str(t.agents["spender"])}
    body = {"model": "echo", "messages": MESSAGES, "max_tokens": 1}

    async def one(http: ClientSession) -> int:
        async with http.post(proxy.v1 + "/chat/completions", json=body, headers=headers) as r:
            await r.read()
            return r.status

    async with ClientSession() as http:
        statuses = Counter(await asyncio.gather(*(one(http) for _ in range(50))))
    assert statuses == {200: 10, 402: 40}

    assert stores.admin_pool is not None
    deadline = time.monotonic() + 10
    while True:  # settling runs after the responses
        async with stores.admin_pool.acquire() as conn:
            ledger = await conn.fetchrow(
                "SELECT count(*) AS n, coalesce(sum(cost_usd), 0) AS total FROM budget_ledger WHERE org_id = $1",
                t.org_id,
            )
            period = await conn.fetchrow(
                "SELECT spent_usd, held_usd, limit_usd FROM budget_periods WHERE org_id = $1 AND scope_id = $2",
                t.org_id, t.agents["spender"],
            )  # fmt: skip
        assert ledger is not None and period is not None
        if ledger["n"] == 10 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    assert ledger["n"] == 10
    assert Decimal(ledger["total"]) == period["spent_usd"] == limit
    assert period["held_usd"] == 0
    assert period["spent_usd"] + period["held_usd"] <= period["limit_usd"]


async def test_a_hard_cap_holds_with_a_directive_the_proxy_injects(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores
) -> None:
    """The provider is billed for the prompt with the agent's directive in it, so the hold must cover the directive
    too; otherwise every settle exceeds its hold and a HardCap is overspent by a directive per request."""
    directive = "Answer formally and cite the policy section."  # about as long as the prompt
    prompt = estimate_chat_tokens(MESSAGES, TokenizerFamily.GENERIC).tokens
    limit = ModelCatalog.builtin().worst_case_cost("echo", prompt, 1) * 10  # ten calls if the directive were free
    spec = {"budget": {"monthlyLimitUSD": format(limit, "f")}, "memory": {"enabled": False}}
    t = await tenants.create(agents=("spender",), directive=directive, agent_spec=spec)
    headers = {"Authorization": f"Bearer {t.keys['spender']}", "X-IBEX-Agent-ID": str(t.agents["spender"])}
    body = {"model": "echo", "messages": MESSAGES, "max_tokens": 1}

    async def one(http: ClientSession) -> int:
        async with http.post(proxy.v1 + "/chat/completions", json=body, headers=headers) as r:
            await r.read()
            return r.status

    async with ClientSession() as http:
        statuses = Counter(await asyncio.gather(*(one(http) for _ in range(30))))
    assert set(statuses) == {200, 402} and 0 < statuses[200] < 10, statuses  # each call costs the directive too

    assert stores.admin_pool is not None
    deadline = time.monotonic() + 10
    while True:  # settling runs after the responses
        async with stores.admin_pool.acquire() as conn:
            period = await conn.fetchrow(
                "SELECT spent_usd, held_usd, limit_usd FROM budget_periods WHERE org_id = $1 AND scope_id = $2",
                t.org_id, t.agents["spender"],
            )  # fmt: skip
        assert period is not None
        if period["held_usd"] == 0 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    assert period["held_usd"] == 0
    assert period["spent_usd"] <= period["limit_usd"]


async def test_with_leases_a_busy_agent_draws_and_every_answer_is_in_the_ledger_once(
    settings: Settings, stores: Stores, pepper: bytes, tenants: TenantFactory
) -> None:
    """`IBEX_BUDGET_LEASE_REQUESTS` on (docs/budget-leases.md): sequential requests of one agent draw from a lease
    instead of holding one each, every answer is settled by its own request id, and at shutdown the lease's
    remainder goes back, so the books close with nothing held."""
    spec = {"budget": {"monthlyLimitUSD": "5.00"}, "memory": {"enabled": False}}
    t = await tenants.create(agents=("spender",), directive=None, agent_spec=spec)
    headers = {"Authorization": f"Bearer {t.keys['spender']}", "X-IBEX-Agent-ID": str(t.agents["spender"])}
    body = {"model": "echo", "messages": MESSAGES, "max_tokens": 1}
    leasing = settings.model_copy(update={"budget_lease_requests": 8})
    async with running_proxy(leasing, stores, pepper) as proxy, ClientSession() as http:
        for _ in range(20):
            async with http.post(proxy.v1 + "/chat/completions", json=body, headers=headers) as r:
                assert r.status == 200, await r.text()
        async with http.get(proxy.base_url + "/metrics") as r:
            metrics = await r.text()
    holds = {
        m.group(1): float(m.group(2))
        for m in re.finditer(r'ibex_proxy_budget_holds_total\{outcome="(\w+)"\} (\S+)', metrics)
    }
    # The first request is held alone; the second places a lease; the rest draw, with a new lease every 8 or so.
    assert holds["drawn"] >= 17 and holds["placed"] == 1 and holds["drawn"] + holds["placed"] == 20
    assert stores.admin_pool is not None
    async with stores.admin_pool.acquire() as conn:  # the proxy has stopped: every settle and return is written
        entries = await conn.fetch("SELECT request_id, cost_usd FROM budget_ledger WHERE org_id = $1", t.org_id)
        leases = await conn.fetch(
            "SELECT status FROM budget_holds WHERE org_id = $1 AND request_id LIKE 'lease\\_%'", t.org_id
        )
        period = await conn.fetchrow(
            "SELECT spent_usd, held_usd FROM budget_periods WHERE org_id = $1 AND scope_id = $2",
            t.org_id, t.agents["spender"],
        )  # fmt: skip
    assert period is not None
    assert len(entries) == 20 and len({e["request_id"] for e in entries}) == 20
    assert 2 <= len(leases) <= 4 and {r["status"] for r in leases} == {"released"}
    assert period["spent_usd"] == sum(e["cost_usd"] for e in entries) and period["held_usd"] == 0
