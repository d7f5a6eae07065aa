"""``POST /v1/responses`` and ``GET /v1/responses/{id}`` through the official openai SDK."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import pytest_asyncio
from openai import AsyncOpenAI

from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.settings import Settings
from tests.integration.test_context import FACT, memory_blocks, write
from tests.integration.test_proxy_upstream import settled
from tests.support.proxy import RunningProxy, running_proxy
from tests.support.tenants import Tenant, TenantFactory
from tests.support.upstream import API_KEY, TOOL_ARGUMENTS, Upstream, running_upstream

WEATHER: Any = {
    "type": "function", "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}  # fmt: skip


def ai(proxy: RunningProxy, tenant: Tenant, agent: str = "alpha", **headers: str) -> AsyncOpenAI:
    return AsyncOpenAI(
        base_url=proxy.v1, api_key=tenant.keys[agent], max_retries=0,
        default_headers={"X-IBEX-Agent-ID": str(tenant.agents[agent]), **headers},
    )  # fmt: skip


def seen(text: str) -> list[dict[str, Any]]:
    parsed = json.loads(text)
    assert isinstance(parsed, list)
    return parsed


async def test_a_response_carries_instructions_and_input_to_the_model_after_the_directive(
    proxy: RunningProxy, tenants: TenantFactory
) -> None:
    t = await tenants.create(directive="Be kind.")
    async with ai(proxy, t) as client:
        raw = await client.responses.with_raw_response.create(model="echo", instructions="Answer briefly.", input="Hi")
        response = raw.parse()
    assert response.object == "response" and response.status == "completed" and response.id.startswith("resp_")
    got = seen(response.output_text)
    assert got[0]["role"] == "system" and "Be kind. (alpha)" in got[0]["content"]
    assert {"role": "system", "content": "Answer briefly."} in got or "Answer briefly." in got[0]["content"]
    assert got[-1] == {"role": "user", "content": "Hi"}
    assert response.usage is not None and response.usage.input_tokens > 0 and response.usage.output_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert raw.headers["X-IBEX-Session-ID"].startswith("sess_")


async def test_item_list_input_becomes_the_conversation_the_model_sees(
    proxy: RunningProxy, tenants: TenantFactory
) -> None:
    t = await tenants.create(directive=None)
    items: Any = [
        {"role": "user", "content": [{"type": "input_text", "text": "Look"},
                                     {"type": "input_image", "image_url": "https://example.test/cat.png"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": TOOL_ARGUMENTS},
        {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "It is 18C."}]},
        {"role": "user", "content": "Thanks"},
    ]  # fmt: skip
    async with ai(proxy, t, **{"X-IBEX-Skip-Memory": "1"}) as client:
        response = await client.responses.create(model="echo", input=items, tools=[WEATHER])
    got = seen(response.output_text)
    assert got[0]["content"][1] == {"type": "image_url", "image_url": {"url": "https://example.test/cat.png"}}
    assert got[1]["role"] == "assistant" and got[1]["tool_calls"][0]["id"] == "call_1"
    assert got[2] == {"role": "tool", "tool_call_id": "call_1", "content": "18C"}
    assert got[3] == {"role": "assistant", "content": "It is 18C."} and got[4] == {"role": "user", "content": "Thanks"}


async def test_a_streamed_response_matches_the_stored_one_and_only_its_agent_can_read_it(
    proxy: RunningProxy, tenants: TenantFactory
) -> None:
    t, other = await tenants.create(directive=None), await tenants.create(directive=None)
    async with ai(proxy, t, **{"X-IBEX-Skip-Memory": "1"}) as client:
        async with client.responses.stream(model="echo", input="stream me") as stream:
            deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
            final = await stream.get_final_response()
        assert len(deltas) > 1 and "".join(deltas) == final.output_text
        assert final.status == "completed" and final.usage is not None and final.usage.output_tokens > 0
        stored = await client.responses.retrieve(final.id)
        assert stored.id == final.id and stored.output_text == final.output_text
        plain = await client.responses.create(model="echo", input="stream me")
        assert plain.output_text == final.output_text
        assert (await client.responses.retrieve(plain.id)).output_text == plain.output_text
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve("resp_" + "0" * 48)
        unstored = await client.responses.create(model="echo", input="forget me", store=False)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(unstored.id)
    async with ai(proxy, t, agent="beta") as client:  # the same org, another agent
        with pytest.raises(openai.NotFoundError) as hidden:
            await client.responses.retrieve(final.id)
    assert hidden.value.body["code"] == "NOT_FOUND"  # type: ignore[index]
    async with ai(proxy, other) as client:  # another org
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(final.id)


async def test_an_idempotency_key_replays_the_same_response_without_a_second_charge(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores
) -> None:
    t = await tenants.create(directive=None, agent_spec={"budget": {"monthlyLimitUSD": "5.00"}})
    async with ai(proxy, t, **{"Idempotency-Key": "resp-once", "X-IBEX-Skip-Memory": "1"}) as client:
        first = await client.responses.create(model="echo", input="only once")
        again = await client.responses.with_raw_response.create(model="echo", input="only once")
        with pytest.raises(openai.ConflictError) as conflict:
            await client.responses.create(model="echo", input="another body")
    assert again.headers["X-Idempotency-Replayed"] == "true" and again.parse().id == first.id
    assert conflict.value.body["code"] == "IDEMPOTENCY_CONFLICT"  # type: ignore[index]
    rows, total, held = await settled(stores, t.org_id)
    assert rows == 1 and total > 0 and held == 0  # one answer, charged once


async def test_max_output_tokens_makes_the_response_incomplete(proxy: RunningProxy, tenants: TenantFactory) -> None:
    t = await tenants.create(directive=None)
    async with ai(proxy, t) as client:
        response = await client.responses.create(model="echo", input="a long question " * 20, max_output_tokens=16)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens <= 16


async def test_bad_responses_bodies_get_the_envelope_not_a_500(proxy: RunningProxy, tenants: TenantFactory) -> None:
    t = await tenants.create(directive=None)
    async with ai(proxy, t) as client:
        cases: list[dict[str, Any]] = [
            {"input": []},
            {"input": [{"type": "file_search_call", "id": "x"}]},
            {"input": "hi", "tools": [{"type": "web_search"}]},
            {"input": "hi", "max_output_tokens": 0},
            {"input": "hi", "previous_response_id": "resp_abc"},
            {"input": [{"role": "wizard", "content": "x"}]},
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
        ]
        for extra in cases:
            with pytest.raises(openai.BadRequestError) as bad:
                await client.responses.create(model="echo", **extra)
            body = bad.value.body
            assert isinstance(body, dict) and body["code"] == "VALIDATION_ERROR", extra
            assert body["field_errors"] and body["request_id"], extra


async def test_memory_context_reaches_the_responses_api_as_it_reaches_chat(
    proxy: RunningProxy, tenants: TenantFactory
) -> None:
    t = await tenants.create(directive="Be brief.")
    memory_id = await write(proxy, t, FACT)
    async with ai(proxy, t) as client:
        raw = await client.responses.with_raw_response.create(model="echo", input="Which tea does the customer like?")
    assert [(b[1], b[2]) for b in memory_blocks(seen(raw.parse().output_text))] == [(memory_id, FACT)]
    assert raw.headers["X-IBEX-Memories-Injected"] == "1"


# -- tools against an OpenAI-compatible upstream that has no Responses API -----------------------------------------


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
        "providers": {"local": {"type": "openai_compat", "base_url": upstream.url, "api_key": API_KEY}},
    }  # fmt: skip
    async with running_proxy(settings, stores, pepper, provider_config=config) as running:
        yield running


@pytest.mark.parametrize("stream", [False, True])
async def test_a_function_tool_round_trip_through_the_responses_api(
    gateway: RunningProxy, upstream: Upstream, tenants: TenantFactory, stream: bool
) -> None:
    t = await tenants.create(directive=None, org_spec={"models": {"allow": ["up-*"], "default": "up-model"}})
    upstream.reset()
    conversation: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    async with ai(gateway, t) as client:
        if stream:
            async with client.responses.stream(model="up-model", input=conversation, tools=[WEATHER]) as s:
                kinds = [event.type async for event in s]
                first = await s.get_final_response()
            assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
        else:
            first = await client.responses.create(model="up-model", input=conversation, tools=[WEATHER])
        calls = [item for item in first.output if item.type == "function_call"]
        assert len(calls) == 1
        call = calls[0]
        assert call.type == "function_call" and call.name == "get_weather"
        assert json.loads(call.arguments) == json.loads(TOOL_ARGUMENTS)
        conversation += [
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "18C and sunny"},
        ]
        second = await client.responses.create(model="up-model", input=conversation, tools=[WEATHER])
    assert second.output_text == "The tool said: 18C and sunny"
    sent = upstream.bodies[-1]
    assert sent["tools"] == [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    assert sent["messages"][-1] == {"role": "tool", "tool_call_id": call.call_id, "content": "18C and sunny"}
