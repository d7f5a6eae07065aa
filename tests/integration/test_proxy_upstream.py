"""The proxy in front of a local OpenAI-compatible upstream: pass-through, streaming, errors, disconnects."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path

import openai
import pytest
import pytest_asyncio
from aiohttp import ClientSession
from openai import AsyncOpenAI

from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.settings import Settings
from tests.support.proxy import RunningProxy, running_proxy
from tests.support.tenants import Tenant, TenantFactory
from tests.support.upstream import API_KEY, PIECES, Script, Upstream, running_upstream


@pytest_asyncio.fixture(scope="module")
async def upstream() -> AsyncIterator[Upstream]:
    async with running_upstream() as state:
        yield state


@pytest_asyncio.fixture(scope="module")
async def gateway(settings: Settings, stores: Stores, pepper: bytes, upstream: Upstream) -> AsyncIterator[RunningProxy]:
    config = {
        "models": [
            {"name": "up-model", "provider": "local", "context_window": 8192, "max_output_tokens": 1024,
             "input_price_per_mtok": "1", "output_price_per_mtok": "2"}
        ],
        "providers": {
            "local": {"type": "openai_compat", "base_url": upstream.url, "api_key": API_KEY, "max_attempts": 2,
                      "backoff_base": 0.01, "breaker_failure_threshold": 1000}
        },
    }  # fmt: skip
    async with running_proxy(settings, stores, pepper, provider_config=config) as proxy:
        yield proxy


@pytest_asyncio.fixture
async def tenant(tenants: TenantFactory, upstream: Upstream) -> Tenant:
    upstream.reset()
    return await tenants.create(directive="Stay on topic.")


def sdk(gateway: RunningProxy, t: Tenant) -> AsyncOpenAI:
    return AsyncOpenAI(
        base_url=gateway.v1, api_key=t.keys["alpha"], max_retries=0,
        default_headers={"X-IBEX-Agent-ID": str(t.agents["alpha"])},
    )  # fmt: skip


async def test_json_chat_passes_unknown_fields_and_injects_the_directive(
    gateway: RunningProxy, upstream: Upstream, tenant: Tenant
) -> None:
    async with sdk(gateway, tenant) as ai:
        reply = await ai.chat.completions.create(
            model="up-model", messages=[{"role": "user", "content": "hi"}], extra_body={"vendor_knob": 3}
        )
    assert reply.choices[0].message.content == "".join(PIECES)
    sent = upstream.bodies[-1]
    assert sent["vendor_knob"] == 3
    assert sent["messages"][0] == {"role": "system", "content": "Stay on topic. (alpha)"}
    assert upstream.headers[-1]["Authorization"] == f"Bearer {API_KEY}"  # our key never reaches the upstream
    assert tenant.keys["alpha"] not in str(upstream.headers[-1])


async def test_a_cookie_one_tenants_upstream_answer_set_never_rides_on_another_tenants_call(
    settings: Settings, stores: Stores, pepper: bytes, upstream: Upstream, tenants: TenantFactory
) -> None:
    """The provider client is shared by every tenant of the process, so it keeps no cookies: a provider (or a sticky
    load balancer in front of it) that sets one for org A must not see it again on org B's request. (By a host
    name: a cookie jar keeps no cookies of a bare IP address at all.)"""
    by_name = upstream.url.replace("127.0.0.1", "localhost")
    config = {
        "models": [{"name": "up-model", "provider": "local", "context_window": 8192, "max_output_tokens": 1024,
                    "input_price_per_mtok": "1", "output_price_per_mtok": "2"}],
        "providers": {"local": {"type": "openai_compat", "base_url": by_name, "api_key": API_KEY}},
    }  # fmt: skip
    a = await tenants.create(directive=None)
    b = await tenants.create(directive=None)
    upstream.reset(Script(set_cookie="affinity=org-a-secret; Path=/"))
    async with running_proxy(settings, stores, pepper, provider_config=config) as proxy:
        for t in (a, b):
            async with sdk(proxy, t) as ai:
                await ai.chat.completions.create(model="up-model", messages=[{"role": "user", "content": "hi"}])
    assert len(upstream.headers) == 2
    assert "Cookie" not in upstream.headers[1] and "org-a-secret" not in str(upstream.headers[1])


async def test_streaming_passes_chunks_through(gateway: RunningProxy, tenant: Tenant) -> None:
    async with sdk(gateway, tenant) as ai:
        stream = await ai.chat.completions.create(
            model="up-model", messages=[{"role": "user", "content": "hi"}], stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        pieces, usage = [], None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
            usage = chunk.usage or usage
    assert "".join(pieces) == "".join(PIECES)
    assert usage is not None and usage.total_tokens == 15


async def test_upstream_errors_map_to_the_envelope(gateway: RunningProxy, upstream: Upstream, tenant: Tenant) -> None:
    upstream.reset(Script(fail_first=10, fail_status=400, fail_body={"error": {"message": "bad param", "type": "x"}}))
    async with sdk(gateway, tenant) as ai:
        with pytest.raises(openai.BadRequestError) as bad:
            await ai.chat.completions.create(model="up-model", messages=[{"role": "user", "content": "hi"}])
    assert bad.value.body["code"] == "VALIDATION_ERROR"  # type: ignore[index]
    assert "bad param" in bad.value.body["message"]  # type: ignore[index]
    upstream.reset(Script(fail_first=10, fail_status=503))
    async with sdk(gateway, tenant) as ai:
        with pytest.raises(openai.APIStatusError) as unavailable:
            await ai.chat.completions.create(model="up-model", messages=[{"role": "user", "content": "hi"}])
    assert unavailable.value.status_code == 503
    assert unavailable.value.body["code"] == "PROVIDER_UNAVAILABLE"  # type: ignore[index]
    assert int(unavailable.value.response.headers["Retry-After"]) >= 1  # every 503 says when to come back


async def test_a_client_disconnect_mid_stream_cancels_the_upstream_call(
    gateway: RunningProxy, upstream: Upstream, tenant: Tenant
) -> None:
    upstream.reset(Script(endless=True))
    headers = {"Authorization": f"Bearer {tenant.keys['alpha']}", "X-IBEX-Agent-ID": str(tenant.agents["alpha"])}
    body = {"model": "up-model", "messages": [{"role": "user", "content": "go on forever"}], "stream": True}
    async with ClientSession() as http:
        response = await http.post(gateway.v1 + "/chat/completions", json=body, headers=headers)
        assert response.status == 200
        await response.content.readline()  # the stream is flowing
        response.close()  # the client goes away
    await asyncio.wait_for(upstream.disconnected.wait(), timeout=5)


async def settled(stores: Stores, org_id: object) -> tuple[int, Decimal, Decimal]:
    """(ledger rows, their total cost, what is still held) of an org, once settlement has run."""
    assert stores.admin_pool is not None
    deadline = asyncio.get_running_loop().time() + 10
    while True:  # settlement runs after the response
        async with stores.admin_pool.acquire() as conn:
            ledger = await conn.fetchrow(
                "SELECT count(*) AS n, coalesce(sum(cost_usd), 0) AS total FROM budget_ledger WHERE org_id = $1",
                org_id,
            )
            held = await conn.fetchval(
                "SELECT coalesce(sum(held_usd), 0) FROM budget_periods WHERE org_id = $1", org_id
            )
        assert ledger is not None
        if (ledger["n"] and held == 0) or asyncio.get_running_loop().time() > deadline:
            return ledger["n"], Decimal(ledger["total"]), Decimal(held)
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("cut", ["client-disconnects", "upstream-dies"])
async def test_a_stream_cut_short_is_billed_for_what_was_forwarded(
    gateway: RunningProxy, upstream: Upstream, tenants: TenantFactory, stores: Stores, cut: str
) -> None:
    t = await tenants.create(directive=None, agent_spec={"budget": {"monthlyLimitUSD": "5.00"}})
    upstream.reset(
        Script(endless=True) if cut == "client-disconnects" else Script(drop_after_chunks=3, omit_usage=True)
    )
    headers = {"Authorization": f"Bearer {t.keys['alpha']}", "X-IBEX-Agent-ID": str(t.agents["alpha"])}
    body = {"model": "up-model", "messages": [{"role": "user", "content": "tell me a long story"}], "stream": True}
    async with ClientSession() as http:
        response = await http.post(gateway.v1 + "/chat/completions", json=body, headers=headers)
        assert response.status == 200
        if cut == "client-disconnects":
            for _ in range(5):
                await response.content.readline()  # part of the answer reached the client
            response.close()
        else:
            await response.read()
            response.close()
    rows, total, held = await settled(stores, t.org_id)
    assert rows == 1 and held == 0
    assert total > 0  # the prompt and the streamed tokens were charged, not released
    deadline = asyncio.get_running_loop().time() + 15
    facts: list[tuple[object, ...]] = []
    while not facts and asyncio.get_running_loop().time() < deadline:  # analytics are flushed in batches
        facts = await stores.clickhouse.admin_query(
            "SELECT cost_usd, completion_tokens FROM usage_facts WHERE org_id = {o:UUID}", o=t.org_id
        )
        if not facts:
            await asyncio.sleep(0.1)
    assert len(facts) == 1 and Decimal(str(facts[0][0])) == total  # usage facts agree with the ledger


async def test_a_providers_file_can_name_the_upstream_key_by_environment_variable(
    settings: Settings, stores: Stores, pepper: bytes, upstream: Upstream, tenant: Tenant, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """The file holds no secret; the key comes from the environment (in Kubernetes: a Secret) and reaches the
    upstream as its bearer token."""
    monkeypatch.setenv("IBEX_TEST_UPSTREAM_KEY", API_KEY)
    path = tmp_path / "providers.json"
    path.write_text(json.dumps({
        "models": [{"name": "env-model", "provider": "by-env", "context_window": 8192, "max_output_tokens": 1024,
                    "input_price_per_mtok": "1", "output_price_per_mtok": "2"}],
        "providers": {"by-env": {"type": "openai_compat", "base_url": upstream.url,
                                 "api_key_env": "IBEX_TEST_UPSTREAM_KEY"}},
    }))  # fmt: skip
    assert API_KEY not in path.read_text()
    async with (
        running_proxy(settings.model_copy(update={"providers_file": path}), stores, pepper) as proxy,
        sdk(proxy, tenant) as ai,
    ):
        reply = await ai.chat.completions.create(model="env-model", messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content == "".join(PIECES)
    assert upstream.headers[-1]["Authorization"] == f"Bearer {API_KEY}"
