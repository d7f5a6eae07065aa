"""``POST /v1/messages`` through the official anthropic SDK: the Anthropic wire format on the shared pipeline."""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

import anthropic
import pytest
from anthropic import AsyncAnthropic

from ibex_dataplane.runtime.stores import Stores
from tests.integration.test_context import FACT, memory_blocks, write
from tests.integration.test_proxy_upstream import settled
from tests.support.proxy import RunningProxy
from tests.support.tenants import Tenant, TenantFactory


def claude(proxy: RunningProxy, tenant: Tenant, agent: str = "alpha", **headers: str) -> AsyncAnthropic:
    """The anthropic SDK as a user points it at the gateway: base_url and the IBEX key as its api_key."""
    return AsyncAnthropic(
        base_url=proxy.base_url, api_key=tenant.keys[agent], max_retries=0,
        default_headers={"X-IBEX-Agent-ID": str(tenant.agents[agent]), **headers},
    )  # fmt: skip


def seen_by_echo(text: str) -> list[dict[str, Any]]:
    parsed = json.loads(text)
    assert isinstance(parsed, list)
    return parsed


async def test_a_message_reaches_the_model_with_system_folded_and_the_directive_first(
    proxy: RunningProxy, tenants: TenantFactory
) -> None:
    t = await tenants.create(directive="Be brief.")
    async with claude(proxy, t) as client:
        raw = await client.messages.with_raw_response.create(
            model="echo", max_tokens=1024, system="Answer in French.",
            messages=[{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Bonjour"},
                      {"role": "user", "content": [{"type": "text", "text": "How are you?"}]}],
        )  # fmt: skip
        message = await raw.parse()
    assert message.type == "message" and message.role == "assistant" and message.stop_reason == "end_turn"
    assert message.content[0].type == "text"
    seen = seen_by_echo(message.content[0].text)
    assert seen[0]["role"] == "system" and "Be brief. (alpha)" in seen[0]["content"]
    assert "Answer in French." in json.dumps(seen[:2])
    assert [m["role"] for m in seen if m["role"] != "system"] == ["user", "assistant", "user"]
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0
    assert raw.headers["X-IBEX-Session-ID"].startswith("sess_")


async def test_a_streamed_message_accumulates_to_the_same_text_with_usage(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores
) -> None:
    t = await tenants.create(directive=None, agent_spec={"budget": {"monthlyLimitUSD": "5.00"}})
    async with claude(proxy, t, **{"X-IBEX-Skip-Memory": "1"}) as client:
        async with client.messages.stream(
            model="echo", max_tokens=1024, messages=[{"role": "user", "content": "stream me"}]
        ) as stream:
            pieces = [text async for text in stream.text_stream]
            final = await stream.get_final_message()
        rows, streamed_cost, held = await settled(stores, t.org_id)
        assert rows == 1 and held == 0  # the stream was settled, not released
        assert streamed_cost == (final.usage.input_tokens * 1 + final.usage.output_tokens * 2) / Decimal(10**6)
        plain = await client.messages.create(
            model="echo", max_tokens=1024, messages=[{"role": "user", "content": "stream me"}]
        )
    assert len(pieces) > 1
    assert final.content[0].type == "text" and plain.content[0].type == "text"
    assert "".join(pieces) == final.content[0].text == plain.content[0].text
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == plain.usage.output_tokens > 0


async def test_max_tokens_cuts_the_answer_with_the_max_tokens_stop_reason(
    proxy: RunningProxy, tenants: TenantFactory
) -> None:
    t = await tenants.create(directive=None)
    async with claude(proxy, t) as client:
        message = await client.messages.create(
            model="echo", max_tokens=3, messages=[{"role": "user", "content": "a long question " * 20}]
        )
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens <= 3


async def test_bad_messages_bodies_get_the_envelope_with_field_errors(
    proxy: RunningProxy, tenants: TenantFactory
) -> None:
    t = await tenants.create(directive=None)
    async with claude(proxy, t) as client:
        with pytest.raises(anthropic.BadRequestError) as missing:
            await client.messages.create(
                model="echo",
                max_tokens=0,
                messages=[{"role": "system", "content": "x"}],  # type: ignore[typeddict-item]
            )
        with pytest.raises(anthropic.BadRequestError) as block:
            await client.messages.create(
                model="echo", max_tokens=10,
                messages=[{"role": "user", "content": [{"type": "video", "url": "x"}]}],  # type: ignore[list-item]
            )  # fmt: skip
    body = missing.value.body
    assert isinstance(body, dict) and body["error"]["code"] == "VALIDATION_ERROR"
    fields = {e["field"] for e in body["error"]["field_errors"]}
    assert {"max_tokens", "messages[0].role"} <= fields
    assert body["error"]["request_id"]
    other = block.value.body
    assert isinstance(other, dict) and other["error"]["field_errors"][0]["field"] == "messages[0].content[0]"


async def test_another_orgs_key_cannot_act_as_the_agent_on_messages(
    proxy: RunningProxy, tenants: TenantFactory
) -> None:
    mine, theirs = await tenants.create(directive=None), await tenants.create(directive=None)
    async with AsyncAnthropic(
        base_url=proxy.base_url, api_key=theirs.keys["alpha"], max_retries=0,
        default_headers={"X-IBEX-Agent-ID": str(mine.agents["alpha"])},
    ) as client:  # fmt: skip
        with pytest.raises(anthropic.PermissionDeniedError) as denied:
            await client.messages.create(model="echo", max_tokens=10, messages=[{"role": "user", "content": "hi"}])
    assert denied.value.body["error"]["code"] == "AGENT_NOT_AUTHORIZED"  # type: ignore[index]
    async with AsyncAnthropic(base_url=proxy.base_url, api_key="ibex_sk_nope_nope", max_retries=0) as client:
        with pytest.raises(anthropic.AuthenticationError):
            await client.messages.create(model="echo", max_tokens=10, messages=[{"role": "user", "content": "hi"}])


async def test_memory_context_reaches_a_messages_call_as_it_reaches_chat(
    proxy: RunningProxy, tenants: TenantFactory
) -> None:
    t = await tenants.create(directive="Be brief.")
    memory_id = await write(proxy, t, FACT)
    async with claude(proxy, t) as client:
        raw = await client.messages.with_raw_response.create(
            model="echo", max_tokens=2048, messages=[{"role": "user", "content": "Which tea does the customer like?"}]
        )
        message = await raw.parse()
    assert message.content[0].type == "text"
    seen = seen_by_echo(message.content[0].text)
    assert [(b[1], b[2]) for b in memory_blocks(seen)] == [(memory_id, FACT)]
    assert raw.headers["X-IBEX-Memories-Injected"] == "1"
    theirs = await tenants.create(directive=None)
    async with claude(proxy, theirs) as client:
        message = await client.messages.create(
            model="echo", max_tokens=2048, messages=[{"role": "user", "content": "Which tea does the customer like?"}]
        )
    assert message.content[0].type == "text" and memory_blocks(seen_by_echo(message.content[0].text)) == []
