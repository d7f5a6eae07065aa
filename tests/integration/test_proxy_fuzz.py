"""Fuzzing the protected path: malformed bodies and headers never produce a 5xx, and every error is enveloped."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.proxy import RunningProxy
from tests.support.tenants import TenantFactory

json_scalars = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=30)
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=12,
)
roles = st.sampled_from(["system", "user", "assistant", "tool", "developer", "wizard", "", 3])
messages = st.lists(
    st.fixed_dictionaries({"role": roles}, optional={"content": json_values, "name": json_values,
                                                    "tool_calls": json_values, "tool_call_id": json_values}),
    max_size=3,
)  # fmt: skip
chat_bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["echo", "gpt-4o", "", "nope"]) | json_values,
        "messages": messages | json_values,
        "stream": st.booleans() | json_values,
        "stream_options": json_values,
        "max_tokens": st.integers(-5, 10**7) | json_values,
        "temperature": json_values,
        "tools": json_values,
        "n": json_values,
        "stop": json_values,
    },
)
header_text = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=60)


def post(url: str, data: bytes, headers: dict[str, str]) -> tuple[int, bytes, str]:
    request = urllib.request.Request(url, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, r.read(), r.headers.get("Content-Type", "")
    except urllib.error.HTTPError as e:
        return e.code, e.read(), e.headers.get("Content-Type", "")


def check(status: int, body: bytes, ctype: str) -> None:
    assert status < 500, (status, body[:300])
    if status >= 400:
        payload: Any = json.loads(body)
        assert set(payload["error"]) >= {"code", "message", "request_id"}, payload
    elif "text/event-stream" not in ctype:
        assert json.loads(body)["object"] == "chat.completion"


async def test_fuzzed_bodies_and_headers_never_cause_a_server_error(
    proxy: RunningProxy, tenants: TenantFactory
) -> None:
    t = await tenants.create(agent_spec={"budget": {"monthlyLimitUSD": "100.00"}})
    url = proxy.v1 + "/chat/completions"
    good = {"Authorization": f"Bearer {t.keys['alpha']}", "X-IBEX-Agent-ID": str(t.agents["alpha"]),
            "Content-Type": "application/json"}  # fmt: skip

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=chat_bodies)
    def fuzz_bodies(body: dict[str, Any]) -> None:
        check(*post(url, json.dumps(body).encode(), good))

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(raw=st.binary(max_size=200))
    def fuzz_raw_bytes(raw: bytes) -> None:
        check(*post(url, raw, good))

    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        auth=header_text, agent=header_text, session=header_text, ctype=header_text, request_id=header_text,
        drop=st.sets(st.sampled_from(["Authorization", "X-IBEX-Agent-ID", "Content-Type"])),
    )  # fmt: skip
    def fuzz_headers(auth: str, agent: str, session: str, ctype: str, request_id: str, drop: set[str]) -> None:
        headers = {"Authorization": auth, "X-IBEX-Agent-ID": agent, "X-IBEX-Session-ID": session,
                   "Content-Type": ctype, "X-Request-ID": request_id}  # fmt: skip
        for name in drop:
            headers[name] = good[name]
        body = json.dumps({"model": "echo", "messages": [{"role": "user", "content": "x"}]}).encode()
        check(*post(url, body, headers))

    await asyncio.to_thread(fuzz_bodies)
    await asyncio.to_thread(fuzz_raw_bytes)
    await asyncio.to_thread(fuzz_headers)


memory_bodies = st.fixed_dictionaries(
    {},
    optional={
        "content": st.text(max_size=50) | json_values,
        "labels": st.lists(st.text(max_size=8), max_size=7) | json_values,
        "source": st.sampled_from(["user_provided", "extracted", "imported", "alien"]) | json_values,
        "confidence": json_values,
        "valid_from": st.sampled_from(["2024-01-01T00:00:00Z", "yesterday", ""]) | json_values,
        "valid_until": st.sampled_from(["2023-01-01T00:00:00Z", "2030-01-01T00:00:00+02:00"]) | json_values,
        "query": st.text(max_size=30) | json_values,
        "limit": json_values,
        "items": st.lists(json_values, max_size=3) | json_values,
    },
)


async def test_fuzzed_memory_requests_never_cause_a_server_error(proxy: RunningProxy, tenants: TenantFactory) -> None:
    t = await tenants.create()
    good = {"Authorization": f"Bearer {t.keys['alpha']}", "X-IBEX-Agent-ID": str(t.agents["alpha"]),
            "Content-Type": "application/json"}  # fmt: skip

    def check_any(status: int, body: bytes, ctype: str) -> None:
        assert status < 500, (status, body[:300])
        if status >= 400:
            assert set(json.loads(body)["error"]) >= {"code", "message", "request_id"}

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
    @given(path=st.sampled_from(["/memories", "/memories:batch", "/memories/search"]), body=memory_bodies)
    def fuzz_memory(path: str, body: dict[str, Any]) -> None:
        check_any(*post(proxy.v1 + path, json.dumps(body).encode(), good))

    await asyncio.to_thread(fuzz_memory)
