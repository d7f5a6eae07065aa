"""Budgets through the proxy: concurrent requests never spend past a HardCap, and the ledger reconciles."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from decimal import Decimal

from aiohttp import ClientSession

from ibex_dataplane.providers.catalog import ModelCatalog
from ibex_dataplane.providers.tokens import TokenizerFamily, estimate_chat_tokens
from ibex_dataplane.runtime.stores import Stores
from tests.support.proxy import RunningProxy
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
