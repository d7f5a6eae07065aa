"""Fuzzing the protected path: malformed bodies and headers never produce a 5xx, and every error is enveloped."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.proxy import RunningProxy
from tests.support.tenants import TenantFactory

# Strings as clients can really send them: any code point, NUL and lone surrogates included (json.dumps escapes a
# lone surrogate as \udXXX, which is not valid UTF-16 text), plus the classic troublemakers.
nasty_text = st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x10FFFF), max_size=30) | st.sampled_from(
    ["\x00", "a\x00b", "\ud800", "x\udfffy", "\u2028", "\ufeff", "%00", "../../etc"]
)
json_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | nasty_text
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(nasty_text, children, max_size=4),
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
        "content": nasty_text | json_values,
        "labels": st.lists(nasty_text, max_size=7) | json_values,
        "metadata": json_values,
        "session_id": json_values,
        "observed_at": json_values,
        "source": st.sampled_from(["user_provided", "extracted", "imported", "alien"]) | json_values,
        "confidence": json_values,
        "valid_from": st.sampled_from(["2024-01-01T00:00:00Z", "yesterday", ""]) | json_values,
        "valid_until": st.sampled_from(["2023-01-01T00:00:00Z", "2030-01-01T00:00:00+02:00"]) | json_values,
        "query": nasty_text | json_values,
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

    # Paths and query strings too: any segment, percent-encoded, on every route that takes one.
    segments = nasty_text.map(lambda t: urllib.parse.quote(t.encode("utf-8", "surrogatepass"), safe=""))

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        route=st.sampled_from(
            ["GET /v1/memories/{}", "DELETE /v1/memories/{}", "POST /v1/memories/{}/feedback",
             "POST /v1/sessions/{}/terminate", "GET /v1/memories?cursor={}", "GET /v1/memories?status={}",
             "GET /v1/memories?limit={}", "GET /v1/usage?group_by={}", "GET /v1/usage?from={}",
             "GET /v1/orgs/{}/auth-probe"]
        ),
        segment=segments,
    )  # fmt: skip
    def fuzz_paths(route: str, segment: str) -> None:
        method, path = route.split(" ", 1)
        request = urllib.request.Request(
            proxy.base_url + path.format(segment), data=b"{}" if method == "POST" else None, headers=good,
            method=method,
        )  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                status, body, ctype = r.status, r.read(), r.headers.get("Content-Type", "")
        except urllib.error.HTTPError as e:
            status, body, ctype = e.code, e.read(), e.headers.get("Content-Type", "")
        check_any(status, body, ctype)

    await asyncio.to_thread(fuzz_memory)
    await asyncio.to_thread(fuzz_paths)


blocks = st.lists(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image", "tool_use", "tool_result", "thinking", "video"]) | json_values},
        optional={"text": json_values, "source": json_values, "id": json_values, "name": json_values,
                  "input": json_values, "tool_use_id": json_values, "content": json_values, "is_error": json_values},
    ),
    max_size=3,
)  # fmt: skip
anthropic_turns = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", 7])},
                          optional={"content": nasty_text | blocks | json_values}),
    max_size=3,
)  # fmt: skip
messages_bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["echo", "ibex-minilm", "nope"]) | json_values,
        "max_tokens": st.integers(-5, 10**7) | json_values,
        "system": nasty_text | blocks | json_values,
        "messages": anthropic_turns | json_values,
        "stream": st.booleans() | json_values,
        "tools": st.lists(st.fixed_dictionaries({}, optional={"name": json_values, "input_schema": json_values}),
                          max_size=2) | json_values,
        "tool_choice": st.fixed_dictionaries({}, optional={"type": json_values, "name": json_values}) | json_values,
        "stop_sequences": json_values,
        "temperature": json_values,
    },
)  # fmt: skip
parts = st.lists(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["input_text", "output_text", "input_image", "input_file", "refusal"]) | json_values},
        optional={"text": json_values, "image_url": json_values, "refusal": json_values, "detail": json_values},
    ),
    max_size=3,
)  # fmt: skip
items = st.lists(
    st.fixed_dictionaries(
        {},
        optional={"type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "x"])
                  | json_values, "role": roles | json_values, "content": nasty_text | parts | json_values,
                  "call_id": json_values, "name": json_values, "arguments": json_values, "output": json_values},
    ),
    max_size=4,
)  # fmt: skip
responses_bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["echo", "ibex-minilm", "nope"]) | json_values,
        "input": nasty_text | items | json_values,
        "instructions": json_values,
        "max_output_tokens": st.integers(-5, 10**7) | json_values,
        "stream": st.booleans() | json_values,
        "store": json_values,
        "tools": st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search"])},
                                                optional={"name": json_values, "parameters": json_values}),
                          max_size=2) | json_values,
        "tool_choice": json_values,
        "text": json_values,
        "previous_response_id": json_values,
    },
)  # fmt: skip
embedding_bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["ibex-minilm", "echo", "nope"]) | json_values,
        "input": nasty_text | st.lists(nasty_text, max_size=3) | st.lists(st.integers(-5, 2**40), max_size=3)
        | json_values,
        "encoding_format": st.sampled_from(["float", "base64", "hex"]) | json_values,
        "dimensions": json_values,
    },
)  # fmt: skip
ANSWERS = {"/messages": "message", "/responses": "response", "/embeddings": "list"}


async def test_fuzzed_responses_messages_and_embeddings_never_cause_a_server_error(
    proxy: RunningProxy, tenants: TenantFactory
) -> None:
    t = await tenants.create(agent_spec={"budget": {"monthlyLimitUSD": "100.00"}})
    good = {"Authorization": f"Bearer {t.keys['alpha']}", "X-IBEX-Agent-ID": str(t.agents["alpha"]),
            "Content-Type": "application/json", "X-IBEX-Skip-Memory": "1"}  # fmt: skip

    def check_route(path: str, status: int, body: bytes, ctype: str) -> None:
        assert status < 500, (path, status, body[:300])
        if status >= 400:
            assert set(json.loads(body)["error"]) >= {"code", "message", "request_id"}, body[:300]
        elif "text/event-stream" not in ctype:
            answer = json.loads(body)
            assert answer.get("object", answer.get("type")) == ANSWERS[path], body[:300]

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        case=st.tuples(st.just("/messages"), messages_bodies) | st.tuples(st.just("/responses"), responses_bodies)
        | st.tuples(st.just("/embeddings"), embedding_bodies)
    )  # fmt: skip
    def fuzz(case: tuple[str, dict[str, Any]]) -> None:
        path, body = case
        check_route(path, *post(proxy.v1 + path, json.dumps(body).encode(), good))

    await asyncio.to_thread(fuzz)
