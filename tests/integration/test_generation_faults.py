"""Faults on every generation route (chat, Responses, Messages, embeddings) against a local OpenAI-wire upstream:
the circuit breaker opens and a probe closes it, a fallback model serves when the primary is down (and the trace
says so), a 4xx never falls back, an upstream 429 is forwarded with its Retry-After, and a stream that stalls
mid-way is cut at the read timeout without leaking tasks or the upstream connection."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
import pytest_asyncio
from aiohttp import ClientSession

from ibex_dataplane.proxy.app import SERVICES
from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.settings import Settings
from tests.support.anthropic_upstream import API_KEY as ANTHROPIC_KEY
from tests.support.anthropic_upstream import AnthropicScript, AnthropicUpstream, running_anthropic_upstream
from tests.support.proxy import RunningProxy, running_proxy
from tests.support.tenants import Tenant, TenantFactory
from tests.support.upstream import API_KEY, Script, Upstream, running_upstream

COOLDOWN = 0.3
ROUTES = ("chat", "responses", "messages", "embeddings")
STREAMING = ("chat", "responses", "messages")


def request_for(route: str, model: str, stream: bool = False) -> tuple[str, dict[str, Any]]:
    """(path, body) of one call on ``route`` in its own wire format."""
    if route == "chat":
        return "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "hi"}],
                                        "stream": stream}  # fmt: skip
    if route == "responses":
        return "/v1/responses", {"model": model, "input": "hi", "stream": stream}
    if route == "messages":
        return "/v1/messages", {"model": model, "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}],
                                "stream": stream}  # fmt: skip
    return "/v1/embeddings", {"model": model, "input": "hi"}


def chat_model(route: str, prefix: str) -> str:
    return f"{prefix}-embed" if route == "embeddings" else f"{prefix}-chat"


def config(upstream: Upstream, anthropic: AnthropicUpstream) -> dict[str, Any]:
    def chat(name: str, provider: str) -> dict[str, Any]:
        return {"name": name, "provider": provider, "context_window": 16384, "max_output_tokens": 8192,
                "input_price_per_mtok": "3", "output_price_per_mtok": "6"}  # fmt: skip

    def embed(name: str, provider: str) -> dict[str, Any]:
        return {"name": name, "provider": provider, "kind": "embedding", "context_window": 8191,
                "max_output_tokens": 1, "input_price_per_mtok": "0.02", "output_price_per_mtok": "0"}  # fmt: skip

    common = {"max_attempts": 1, "breaker_failure_threshold": 2, "breaker_cooldown": COOLDOWN, "read_timeout": 0.5}
    return {
        "models": [chat("brittle-chat", "brittle"), embed("brittle-embed", "brittle"), chat("up-chat", "primary"),
                   embed("up-embed", "primary"), chat("claude-chat", "claude")],
        "providers": {
            "brittle": {"type": "openai_compat", "base_url": upstream.url, "api_key": API_KEY, **common},
            "primary": {"type": "openai_compat", "base_url": upstream.url, "api_key": API_KEY, **common,
                        "breaker_failure_threshold": 1000},
            "claude": {"type": "anthropic", "base_url": anthropic.url, "api_key": ANTHROPIC_KEY, **common,
                       "breaker_failure_threshold": 1000},
        },
        "fallbacks": {"up-chat": ["echo"], "up-embed": ["ibex-minilm"]},
    }  # fmt: skip


@pytest_asyncio.fixture(scope="module")
async def upstream() -> AsyncIterator[Upstream]:
    async with running_upstream() as state:
        yield state


@pytest_asyncio.fixture(scope="module")
async def anthropic_upstream() -> AsyncIterator[AnthropicUpstream]:
    async with running_anthropic_upstream() as state:
        yield state


@pytest_asyncio.fixture
async def gateway(
    settings: Settings, stores: Stores, pepper: bytes, upstream: Upstream, anthropic_upstream: AnthropicUpstream
) -> AsyncIterator[RunningProxy]:
    """A fresh proxy per test: each test starts with closed breakers."""
    upstream.reset()
    anthropic_upstream.reset()
    async with running_proxy(settings, stores, pepper, provider_config=config(upstream, anthropic_upstream)) as p:
        yield p


@pytest_asyncio.fixture
async def tenant(tenants: TenantFactory) -> Tenant:
    return await tenants.create(directive=None, org_spec={"models": {"default": "echo"}})


def headers(t: Tenant) -> dict[str, str]:
    return {"Authorization": f"Bearer {t.keys['alpha']}", "X-IBEX-Agent-ID": str(t.agents["alpha"])}


async def call(
    gateway: RunningProxy, t: Tenant, route: str, model: str, stream: bool = False
) -> tuple[int, dict[str, str], bytes]:
    path, body = request_for(route, model, stream)
    async with ClientSession() as http, http.post(gateway.base_url + path, json=body, headers=headers(t)) as r:
        return r.status, dict(r.headers), await r.read()


@pytest.mark.parametrize("route", ROUTES)
async def test_failures_open_the_breaker_which_fails_fast_until_a_probe_closes_it(
    gateway: RunningProxy, upstream: Upstream, tenant: Tenant, route: str
) -> None:
    model = chat_model(route, "brittle")
    upstream.reset(Script(fail_first=2, fail_status=500))
    for _ in range(2):
        status, _, body = await call(gateway, tenant, route, model)
        assert status == 502 and orjson.loads(body)["error"]["code"] == "PROVIDER_ERROR"
    status, response_headers, body = await call(gateway, tenant, route, model)
    assert status == 503 and orjson.loads(body)["error"]["code"] == "PROVIDER_UNAVAILABLE"
    assert int(response_headers["Retry-After"]) >= 1
    assert len(upstream.bodies) == 2, "an open breaker does not call the upstream"
    async with ClientSession() as http:
        scrape = await (await http.get(gateway.base_url + "/metrics")).text()
    assert 'ibex_proxy_provider_breaker_state{provider="brittle"} 2.0' in scrape
    await asyncio.sleep(COOLDOWN + 0.05)  # the breaker's cool-down is wall-clock time by design
    status, _, _ = await call(gateway, tenant, route, model)  # the half-open probe reaches the upstream
    assert status == 200 and len(upstream.bodies) == 3
    status, _, _ = await call(gateway, tenant, route, model)  # and the breaker is closed again
    assert status == 200 and len(upstream.bodies) == 4


@pytest.mark.parametrize(("route", "stream"), [*((r, False) for r in ROUTES), *((r, True) for r in STREAMING)])
async def test_a_fallback_serves_when_the_primary_is_down_and_the_trace_records_it(
    gateway: RunningProxy, upstream: Upstream, tenant: Tenant, stores: Stores, route: str, stream: bool
) -> None:
    upstream.reset(Script(fail_first=100, fail_status=503))
    status, response_headers, body = await call(gateway, tenant, route, chat_model(route, "up"), stream)
    assert status == 200, body
    fallback = "ibex-minilm" if route == "embeddings" else "echo"
    assert response_headers["X-IBEX-Fallback-Model"] == fallback
    assert len(upstream.bodies) == 1  # the primary was tried once, then its fallback served
    deadline = asyncio.get_running_loop().time() + 15
    rows: list[tuple[Any, ...]] = []
    while not rows and asyncio.get_running_loop().time() < deadline:  # analytics are flushed in batches
        rows = await stores.clickhouse.admin_query(
            "SELECT model, degradations, route FROM llm_traces WHERE org_id = {o:UUID}", o=tenant.org_id
        )
        if not rows:
            await asyncio.sleep(0.1)
    assert len(rows) == 1
    model, degradations, traced_route = rows[0]
    assert model == fallback and "fallback" in degradations
    assert traced_route == {"chat": "chat.completions"}.get(route, route)


@pytest.mark.parametrize("route", ROUTES)
async def test_a_client_error_never_falls_back_and_an_upstream_429_keeps_its_retry_after(
    gateway: RunningProxy, upstream: Upstream, tenant: Tenant, route: str
) -> None:
    model = chat_model(route, "up")
    upstream.reset(Script(fail_first=100, fail_status=400, fail_body={"error": {"message": "no such parameter"}}))
    status, response_headers, body = await call(gateway, tenant, route, model)
    assert status == 400 and "no such parameter" in orjson.loads(body)["error"]["message"]
    assert "X-IBEX-Fallback-Model" not in response_headers
    upstream.reset(Script(fail_first=100, fail_status=429, retry_after="40"))
    brittle = chat_model(route, "brittle")
    status, response_headers, body = await call(gateway, tenant, route, brittle)
    assert status == 429 and orjson.loads(body)["error"]["code"] == "RATE_LIMITED"
    assert response_headers["Retry-After"] == "40"


async def _settle(gateway: RunningProxy, baseline: set[asyncio.Task[Any]]) -> set[asyncio.Task[Any]]:
    """Tasks started since ``baseline`` that are still running once after-response work has drained."""
    await gateway.app[SERVICES].accounting.background.drain()
    deadline = asyncio.get_running_loop().time() + 5
    while True:
        # Periodic loops (analytics flush, outbox poll) wait with wait_for(event.wait(), interval), which makes a
        # fresh waiter task every round: those are not the request's.
        left = {
            t for t in asyncio.all_tasks()
            if not t.done() and getattr(t.get_coro(), "__qualname__", "") != "Event.wait"
        } - baseline - {asyncio.current_task()}  # fmt: skip
        if not left or asyncio.get_running_loop().time() > deadline:
            return left
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("route", STREAMING)
async def test_a_stream_that_stalls_is_cut_at_the_timeout_without_leaking_tasks_or_connections(
    gateway: RunningProxy, upstream: Upstream, tenant: Tenant, route: str
) -> None:
    baseline = {t for t in asyncio.all_tasks() if not t.done()}
    upstream.reset(Script(silent_after_chunks=2))
    status, _, body = await call(gateway, tenant, route, chat_model(route, "up"), stream=True)
    assert status == 200
    text = body.decode()
    assert "Hel" in text  # the first chunks reached the client before the stall
    if route == "chat":
        assert '"code":"PROVIDER_ERROR"' in text and text.endswith("data: [DONE]\n\n")
    else:
        assert text.rstrip().split("\n\n")[-1].startswith("event: error\n")
        assert '"code":"PROVIDER_ERROR"' in text
    await asyncio.wait_for(upstream.disconnected.wait(), timeout=5)  # the upstream connection was dropped
    assert not await _settle(gateway, baseline)


async def test_a_stalled_anthropic_stream_is_cut_the_same_way(
    gateway: RunningProxy, anthropic_upstream: AnthropicUpstream, tenant: Tenant
) -> None:
    baseline = {t for t in asyncio.all_tasks() if not t.done()}
    anthropic_upstream.reset(AnthropicScript(silent_after_events=4))
    status, _, body = await call(gateway, tenant, "chat", "claude-chat", stream=True)
    assert status == 200 and '"code":"PROVIDER_ERROR"' in body.decode()
    await asyncio.wait_for(anthropic_upstream.disconnected.wait(), timeout=5)
    assert not await _settle(gateway, baseline)


@pytest.mark.parametrize("route", ROUTES)
async def test_an_upstream_that_never_answers_is_cut_at_the_timeout_on_every_route(
    gateway: RunningProxy, upstream: Upstream, tenant: Tenant, route: str
) -> None:
    baseline = {t for t in asyncio.all_tasks() if not t.done()}
    upstream.reset(Script(hang=True))
    status, response_headers, body = await call(gateway, tenant, route, chat_model(route, "brittle"))
    assert status == 503 and orjson.loads(body)["error"]["code"] == "PROVIDER_UNAVAILABLE"
    assert int(response_headers["Retry-After"]) >= 1
    await asyncio.wait_for(upstream.disconnected.wait(), timeout=5)  # the hanging request was abandoned
    assert not await _settle(gateway, baseline)
