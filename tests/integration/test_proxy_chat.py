"""Chat through the proxy with the official openai SDK, against the built-in echo model."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from tests.support.proxy import RunningProxy
from tests.support.tenants import Tenant, TenantFactory


def client(proxy: RunningProxy, token: str, agent: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=proxy.v1, api_key=token, default_headers={"X-IBEX-Agent-ID": agent}, max_retries=0)


async def test_chat_returns_what_the_model_saw_with_the_directive_first(
    proxy: RunningProxy, tenants: TenantFactory
) -> None:
    t: Tenant = await tenants.create(directive="Be kind.", agent_spec={"limits": {"requestsPerMinute": 100}})
    async with client(proxy, t.keys["alpha"], str(t.agents["alpha"])) as ai:
        raw = await ai.chat.completions.with_raw_response.create(
            model="echo", messages=[{"role": "user", "content": "Hello there"}]
        )
        reply = raw.parse()
    seen = json.loads(reply.choices[0].message.content or "")
    assert seen == [{"role": "system", "content": "Be kind. (alpha)"}, {"role": "user", "content": "Hello there"}]
    assert reply.usage is not None and reply.usage.prompt_tokens > 0
    assert raw.headers["X-Request-ID"]
    assert raw.headers["X-IBEX-Session-ID"].startswith("sess_")
    assert raw.headers["X-RateLimit-Limit"] == "100"
    assert raw.headers["X-RateLimit-Remaining"] == "99"


async def test_agent_can_be_named_instead_of_identified(proxy: RunningProxy, tenants: TenantFactory) -> None:
    t = await tenants.create(agents=("named",), directive=None)
    name = f"named-{t.name.removeprefix('org-')}"
    async with client(proxy, t.keys["named"], name) as ai:
        reply = await ai.chat.completions.create(model="echo", messages=[{"role": "user", "content": "hi"}])
    assert json.loads(reply.choices[0].message.content or "") == [{"role": "user", "content": "hi"}]


async def test_streaming_concatenates_to_the_same_answer_and_reports_usage_when_asked(
    proxy: RunningProxy, tenants: TenantFactory
) -> None:
    t = await tenants.create(directive=None)
    messages = [{"role": "user", "content": "stream me"}]
    async with client(proxy, t.keys["alpha"], str(t.agents["alpha"])) as ai:
        stream = await ai.chat.completions.create(
            model="echo", messages=messages, stream=True, stream_options={"include_usage": True}
        )
        parts, usage = [], None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        plain = await ai.chat.completions.create(model="echo", messages=messages, stream=True)
        plain_usage = [c.usage async for c in plain if c.usage is not None]
    assert json.loads("".join(parts)) == messages
    assert usage is not None and usage.completion_tokens > 0
    assert plain_usage == []


async def test_the_sync_sdk_works_too(proxy: RunningProxy, tenants: TenantFactory) -> None:
    t = await tenants.create(directive=None)

    def call() -> str:
        with OpenAI(
            base_url=proxy.v1, api_key=t.keys["beta"], default_headers={"X-IBEX-Agent-ID": str(t.agents["beta"])},
            max_retries=0,
        ) as ai:  # fmt: skip
            r = ai.chat.completions.create(model="echo", messages=[{"role": "user", "content": "sync"}], max_tokens=5)
            return r.choices[0].finish_reason

    assert await asyncio.to_thread(call) == "length"


async def test_sdk_surfaces_gateway_errors_as_api_errors(proxy: RunningProxy, tenants: TenantFactory) -> None:
    t = await tenants.create()
    async with client(proxy, t.keys["alpha"], str(t.agents["beta"])) as ai:
        with pytest.raises(openai.PermissionDeniedError) as err:
            await ai.chat.completions.create(model="echo", messages=[{"role": "user", "content": "x"}])
    assert err.value.body is not None
    assert err.value.body["code"] == "AGENT_NOT_AUTHORIZED"  # type: ignore[index]


async def test_models_lists_what_the_org_may_use(proxy: RunningProxy, tenants: TenantFactory) -> None:
    t = await tenants.create(org_spec={"models": {"allow": ["echo*"], "default": "echo"}})
    async with client(proxy, t.keys["alpha"], str(t.agents["alpha"])) as ai:
        models = [m.id async for m in ai.models.list()]
    assert models == ["echo"]


async def test_a_model_whose_provider_is_not_configured_is_not_listed_and_is_a_clear_client_error(
    proxy: RunningProxy, tenants: TenantFactory
) -> None:
    t = await tenants.create(org_spec={"models": {"allow": ["gpt-4o*", "echo*"], "default": "echo"}})
    async with client(proxy, t.keys["alpha"], str(t.agents["alpha"])) as ai:
        listed = {m.id for m in (await ai.models.list()).data}
        with pytest.raises(openai.BadRequestError) as refused:
            await ai.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert "echo" in listed and "gpt-4o" not in listed
    error = refused.value.body
    assert isinstance(error, dict) and error["code"] == "VALIDATION_ERROR"
    message = error["message"]
    assert "provider 'openai', which is not configured" in message and "IBEX_PROVIDERS_FILE" in message
