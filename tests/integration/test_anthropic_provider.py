"""Chat completions and Messages to an Anthropic upstream: a local server speaking Anthropic's real wire format."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import openai
import pytest
import pytest_asyncio
from anthropic import AsyncAnthropic
from openai import AsyncOpenAI

from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.settings import Settings
from tests.integration.test_context import FACT, memory_blocks, write
from tests.support.anthropic_upstream import (
    API_KEY,
    PIECES,
    TOOL_INPUT,
    USAGE,
    AnthropicScript,
    AnthropicUpstream,
    running_anthropic_upstream,
)
from tests.support.proxy import MemoryDeps, RunningProxy, running_proxy
from tests.support.tenants import Tenant, TenantFactory

MAX_OUTPUT = 1024
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather of a city",
                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
}  # fmt: skip
PROMPT_TOKENS = USAGE["input_tokens"] + USAGE["cache_creation_input_tokens"] + USAGE["cache_read_input_tokens"]


@pytest_asyncio.fixture(scope="module")
async def upstream() -> AsyncIterator[AnthropicUpstream]:
    async with running_anthropic_upstream() as state:
        yield state


@pytest_asyncio.fixture(scope="module")
async def gateway(
    settings: Settings, stores: Stores, pepper: bytes, upstream: AnthropicUpstream
) -> AsyncIterator[RunningProxy]:
    config = {
        "models": [
            {"name": "claude-up", "provider": "claude", "context_window": 200000, "max_output_tokens": MAX_OUTPUT,
             "tokenizer_family": "anthropic", "input_price_per_mtok": "3", "output_price_per_mtok": "15"}
        ],
        "providers": {
            "claude": {"type": "anthropic", "base_url": upstream.url, "api_key": API_KEY, "max_attempts": 2,
                       "backoff_base": 0.01, "breaker_failure_threshold": 1000}
        },
    }  # fmt: skip
    async with running_proxy(settings, stores, pepper, provider_config=config) as proxy:
        yield proxy


@pytest_asyncio.fixture
async def tenant(tenants: TenantFactory, upstream: AnthropicUpstream) -> Tenant:
    upstream.reset()
    return await tenants.create(
        directive="Stay on topic.", org_spec={"models": {"allow": ["claude-*", "echo*"], "default": "claude-up"}}
    )


def gpt(gateway: RunningProxy, t: Tenant) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=gateway.v1, api_key=t.keys["alpha"], max_retries=0,
                       default_headers={"X-IBEX-Agent-ID": str(t.agents["alpha"])})  # fmt: skip


def claude(gateway: RunningProxy, t: Tenant) -> AsyncAnthropic:
    return AsyncAnthropic(base_url=gateway.base_url, api_key=t.keys["alpha"], max_retries=0,
                          default_headers={"X-IBEX-Agent-ID": str(t.agents["alpha"])})  # fmt: skip


async def test_chat_to_an_anthropic_upstream_folds_system_merges_turns_and_maps_usage(
    gateway: RunningProxy, upstream: AnthropicUpstream, tenant: Tenant
) -> None:
    async with gpt(gateway, tenant) as ai:
        reply = await ai.chat.completions.create(
            model="claude-up",
            messages=[{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
                      {"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image_url",
                       "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}],
        )  # fmt: skip
    assert reply.choices[0].message.content == "".join(PIECES)
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (PROMPT_TOKENS, USAGE["output_tokens"])
    assert reply.usage.prompt_tokens_details is not None
    assert reply.usage.prompt_tokens_details.cached_tokens == USAGE["cache_read_input_tokens"]
    sent = upstream.bodies[-1]
    assert sent["system"] == "Stay on topic. (alpha)\n\nBe terse."  # directive and the client's system, folded
    assert sent["max_tokens"] == MAX_OUTPUT  # required by the API: the catalog's max output
    assert [m["role"] for m in sent["messages"]] == ["user"]  # two user turns merged: roles must alternate
    assert sent["messages"][0]["content"][-1] == {
        "type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}  # fmt: skip
    assert upstream.headers[-1]["x-api-key"] == API_KEY and tenant.keys["alpha"] not in str(upstream.headers[-1])


async def test_chat_streams_from_an_anthropic_upstream_with_usage(gateway: RunningProxy, tenant: Tenant) -> None:
    async with gpt(gateway, tenant) as ai:
        stream = await ai.chat.completions.create(
            model="claude-up", messages=[{"role": "user", "content": "hi"}], stream=True,
            stream_options={"include_usage": True}, max_tokens=50,
        )  # fmt: skip
        pieces, usage, finish = [], None, None
        async for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
    assert "".join(pieces) == "".join(PIECES)
    assert finish == "stop"
    assert usage is not None and usage.prompt_tokens == PROMPT_TOKENS and usage.completion_tokens == 5


async def test_streams_from_an_anthropic_upstream_reuse_one_connection(
    gateway: RunningProxy, tenant: Tenant, upstream: AnthropicUpstream
) -> None:
    async with gpt(gateway, tenant) as ai:
        for _ in range(3):
            stream = await ai.chat.completions.create(
                model="claude-up", messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=50
            )
            pieces = [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
            assert "".join(pieces) == "".join(PIECES)
    assert len(upstream.peers) == 3 and None not in upstream.peers
    assert len(set(upstream.peers)) == 1, "each stream read to its end leaves its connection for the next"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_chat_tool_round_trip_through_an_anthropic_upstream(
    gateway: RunningProxy, upstream: AnthropicUpstream, tenant: Tenant, stream: bool
) -> None:
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    async with gpt(gateway, tenant) as ai:
        if stream:
            async with ai.chat.completions.stream(model="claude-up", messages=messages, tools=[WEATHER]) as s:
                first = (await s.get_final_completion()).choices[0]
        else:
            first = (await ai.chat.completions.create(model="claude-up", messages=messages, tools=[WEATHER])).choices[0]
        assert first.finish_reason == "tool_calls"
        calls = first.message.tool_calls
        assert calls is not None and len(calls) == 1
        call = calls[0]
        assert call.type == "function"
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == TOOL_INPUT
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
            {"role": "tool", "tool_call_id": call.id, "content": "18C and sunny"},
        ]
        second = await ai.chat.completions.create(model="claude-up", messages=messages, tools=[WEATHER])
    assert second.choices[0].message.content == "The tool said: 18C and sunny"
    sent = upstream.bodies[-1]["messages"]
    use = {"type": "tool_use", "id": call.id, "name": "get_weather", "input": TOOL_INPUT}
    assert sent[1] == {"role": "assistant", "content": [use]}
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "18C and sunny"}
    assert sent[2] == {"role": "user", "content": [result]}
    assert upstream.bodies[-1]["tools"][0]["input_schema"] == WEATHER["function"]["parameters"]  # type: ignore[index]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_messages_tool_round_trip_with_the_anthropic_sdk(
    gateway: RunningProxy, tenant: Tenant, stream: bool
) -> None:
    tools: Any = [{"name": "get_weather", "description": "Weather of a city",
                   "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]  # fmt: skip
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    async with claude(gateway, tenant) as client:
        if stream:
            async with client.messages.stream(model="claude-up", max_tokens=200, messages=messages, tools=tools) as s:
                first = await s.get_final_message()
        else:
            first = await client.messages.create(model="claude-up", max_tokens=200, messages=messages, tools=tools)
        assert first.stop_reason == "tool_use"
        use = next(b for b in first.content if b.type == "tool_use")
        assert use.type == "tool_use" and use.name == "get_weather" and use.input == TOOL_INPUT
        messages += [
            {"role": "assistant", "content": [b.model_dump() for b in first.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18C"}]},
        ]
        second = await client.messages.create(model="claude-up", max_tokens=200, messages=messages, tools=tools)
    assert second.stop_reason == "end_turn"
    assert second.content[0].type == "text" and second.content[0].text == "The tool said: 18C"
    assert second.usage.cache_read_input_tokens == USAGE["cache_read_input_tokens"]
    assert second.usage.input_tokens == PROMPT_TOKENS - USAGE["cache_read_input_tokens"]


async def test_anthropic_errors_map_to_the_envelope_and_429_keeps_retry_after(
    gateway: RunningProxy, upstream: AnthropicUpstream, tenant: Tenant
) -> None:
    async with gpt(gateway, tenant) as ai:
        with pytest.raises(openai.BadRequestError) as bad:  # the fake refuses a first turn that is not the user's
            await ai.chat.completions.create(model="claude-up", messages=[{"role": "assistant", "content": "x"}])
        assert bad.value.body["code"] == "VALIDATION_ERROR"  # type: ignore[index]
        assert "first message" in bad.value.body["message"]  # type: ignore[index]
        upstream.reset(AnthropicScript(fail_first=10, fail_status=429, retry_after="30"))
        with pytest.raises(openai.RateLimitError) as limited:
            await ai.chat.completions.create(model="claude-up", messages=[{"role": "user", "content": "hi"}])
        assert limited.value.body["code"] == "RATE_LIMITED"  # type: ignore[index]
        assert limited.value.response.headers["Retry-After"] == "30"
        assert len(upstream.bodies) == 1  # a Retry-After longer than max_retry_after is not waited for
        upstream.reset(AnthropicScript(fail_first=10, fail_status=529))
        with pytest.raises(openai.APIStatusError) as overloaded:
            await ai.chat.completions.create(model="claude-up", messages=[{"role": "user", "content": "hi"}])
        assert overloaded.value.status_code == 503
        assert overloaded.value.body["code"] == "PROVIDER_UNAVAILABLE"  # type: ignore[index]
        assert len(upstream.bodies) == 2  # retried once (max_attempts 2), before any byte
    async with claude(gateway, tenant) as client:
        upstream.reset(AnthropicScript(fail_first=10, fail_status=429, retry_after="30"))
        with pytest.raises(anthropic.RateLimitError) as sdk_limited:
            await client.messages.create(model="claude-up", max_tokens=10, messages=[{"role": "user", "content": "x"}])
        assert sdk_limited.value.response.headers["retry-after"] == "30"


# -- memory context reaches Anthropic-routed calls -------------------------------------------------------------


@pytest_asyncio.fixture(scope="module")
async def remembering_gateway(
    settings: Settings, stores: Stores, pepper: bytes, memory_deps: MemoryDeps, upstream: AnthropicUpstream
) -> AsyncIterator[RunningProxy]:
    """The built-in Claude models routed to the local Anthropic upstream, with the memory and context stages."""
    config = {"providers": {"anthropic": {"type": "anthropic", "base_url": upstream.url, "api_key": API_KEY}}}
    async with running_proxy(settings, stores, pepper, provider_config=config, memory=memory_deps) as proxy:
        yield proxy


@pytest.mark.parametrize("route", ["chat", "responses", "messages"])
async def test_memory_context_reaches_an_anthropic_upstream_as_it_reaches_chat(
    remembering_gateway: RunningProxy, upstream: AnthropicUpstream, tenants: TenantFactory, route: str
) -> None:
    t = await tenants.create(directive="Be brief.", org_spec={"models": {"allow": ["claude-*"], "default": "echo"}})
    memory_id = await write(remembering_gateway, t, FACT)
    upstream.reset()
    question = "Which tea does the customer like best?"
    if route == "chat":
        async with gpt(remembering_gateway, t) as ai:
            await ai.chat.completions.create(model="claude-haiku-4-5", messages=[{"role": "user", "content": question}])
    elif route == "responses":
        async with gpt(remembering_gateway, t) as ai:
            await ai.responses.create(model="claude-haiku-4-5", input=question)
    else:
        async with claude(remembering_gateway, t) as client:
            await client.messages.create(
                model="claude-haiku-4-5", max_tokens=256, messages=[{"role": "user", "content": question}]
            )
    sent = upstream.bodies[-1]
    assert sent["system"].startswith("Be brief. (alpha)")  # the directive first, as for chat
    assert [(b[1], b[2]) for b in memory_blocks([{"content": sent["system"]}])] == [(memory_id, FACT)]
    assert sent["messages"] == [{"role": "user", "content": [{"type": "text", "text": question}]}]
