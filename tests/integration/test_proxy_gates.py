"""Every gate of the protected path answers with its documented status and code, in the documented envelope."""

from __future__ import annotations

import asyncio
import io
import time
import uuid
from typing import Any

import pytest
from aiohttp import ClientSession

from ibex_operator.models import AgentSpec, ApiKeySpec, OrganizationSpec
from ibex_operator.reconcile import Reconciler
from tests.support.proxy import RunningProxy
from tests.support.tenants import NAMESPACE, Tenant, TenantFactory
from tests.support.waiting import until

CHAT = {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}


async def call(
    proxy: RunningProxy,
    *,
    token: str | None = None,
    agent: str | None = None,
    body: Any = CHAT,
    raw: bytes | None = None,
    path: str = "/v1/chat/completions",
    method: str = "POST",
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any], dict[str, str]]:
    h = dict(headers or {})
    if token is not None:
        h["Authorization"] = f"Bearer {token}"
    if agent is not None:
        h["X-IBEX-Agent-ID"] = agent
    async with ClientSession() as http:
        kwargs: dict[str, Any] = {"headers": h}
        if raw is not None:
            kwargs["data"] = io.BytesIO(raw)
            h.setdefault("Content-Type", "application/json")
        elif method in ("POST", "PUT", "PATCH"):
            kwargs["json"] = body
        async with http.request(method, proxy.base_url + path, **kwargs) as r:
            payload = await r.json(content_type=None)
            return r.status, payload, dict(r.headers)


def assert_error(result: tuple[int, dict[str, Any], dict[str, str]], status: int, code: str) -> dict[str, Any]:
    got_status, payload, headers = result
    assert (got_status, payload.get("error", {}).get("code")) == (status, code), payload
    error = payload["error"]
    assert set(error) >= {"code", "message", "request_id"}
    assert error["request_id"] == headers["X-Request-ID"]
    return error


async def test_missing_and_bad_tokens_are_401(proxy: RunningProxy, tenants: TenantFactory) -> None:
    t = await tenants.create()
    agent = str(t.agents["alpha"])
    assert_error(await call(proxy, agent=agent), 401, "MISSING_TOKEN")
    assert_error(await call(proxy, agent=agent, headers={"Authorization": "Basic abc"}), 401, "MISSING_TOKEN")
    assert_error(await call(proxy, token="sk-not-ours", agent=agent), 401, "INVALID_TOKEN")
    forged = t.keys["alpha"][:-4] + ("AAAA" if not t.keys["alpha"].endswith("AAAA") else "BBBB")
    assert_error(await call(proxy, token=forged, agent=agent), 401, "INVALID_TOKEN")
    unknown = "ibex_sk_" + "a" * 16 + "_" + "b" * 43
    assert_error(await call(proxy, token=unknown, agent=agent), 401, "INVALID_TOKEN")


async def test_agent_binding(proxy: RunningProxy, tenants: TenantFactory) -> None:
    a = await tenants.create()
    b = await tenants.create()
    key = a.keys["alpha"]
    assert_error(await call(proxy, token=key), 400, "MISSING_AGENT_ID")
    # Org B's agent with org A's key: nothing about B is revealed.
    assert_error(await call(proxy, token=key, agent=str(b.agents["alpha"])), 403, "AGENT_NOT_AUTHORIZED")
    # Org A's other agent, which this key may not act as.
    assert_error(await call(proxy, token=key, agent=str(a.agents["beta"])), 403, "AGENT_NOT_AUTHORIZED")
    assert_error(await call(proxy, token=key, agent=str(uuid.uuid4())), 403, "AGENT_NOT_AUTHORIZED")
    assert_error(await call(proxy, token=key, agent="no-such-agent"), 403, "AGENT_NOT_AUTHORIZED")
    status, _, _ = await call(proxy, token=key, agent=str(a.agents["alpha"]))
    assert status == 200


async def test_path_org_must_be_the_keys_org(proxy: RunningProxy, tenants: TenantFactory) -> None:
    a = await tenants.create()
    b = await tenants.create()
    path = f"/v1/orgs/{b.org_id}/auth-probe"
    assert_error(await call(proxy, token=a.keys["alpha"], path=path, method="GET"), 403, "PATH_ORG_MISMATCH")
    status, body, _ = await call(proxy, token=a.keys["alpha"], path=f"/v1/orgs/{a.org_id}/auth-probe", method="GET")
    assert (status, body["org_id"]) == (200, str(a.org_id))


async def test_me_describes_the_key_and_only_its_agents(proxy: RunningProxy, tenants: TenantFactory) -> None:
    a = await tenants.create()
    status, body, _ = await call(proxy, token=a.keys["beta"], path="/v1/me", method="GET")
    assert status == 200
    assert body["org_id"] == str(a.org_id)
    assert body["key_id"] == a.key_ids["beta"]
    assert [ag["id"] for ag in body["agents"]] == [str(a.agents["beta"])]


async def test_suspension_and_model_policy(proxy: RunningProxy, tenants: TenantFactory, reconciler: Reconciler) -> None:
    t = await tenants.create(org_spec={"models": {"allow": ["echo*"], "deny": ["echo-secret"], "default": "echo"}})
    key, agent = t.keys["alpha"], str(t.agents["alpha"])
    assert_error(await call(proxy, token=key, agent=agent, body={**CHAT, "model": "gpt-4o"}), 403, "MODEL_NOT_ALLOWED")
    assert_error(
        await call(proxy, token=key, agent=agent, body={**CHAT, "model": "echo-secret"}), 403, "MODEL_NOT_ALLOWED"
    )
    status, _, _ = await call(proxy, token=key, agent=agent, body={"messages": CHAT["messages"]})  # default model
    assert status == 200
    agent_name = f"alpha-{t.name.removeprefix('org-')}"
    await reconciler.agent(
        NAMESPACE, agent_name, AgentSpec.model_validate({"organizationRef": {"name": t.name}, "suspended": True}),
        generation=2,
    )  # fmt: skip
    # Each reconcile reaches the proxy's local cache through the invalidation event, within milliseconds.
    await until(lambda: refused_with(proxy, key, agent, "AGENT_SUSPENDED"), "the agent's suspension")
    await reconciler.organization(NAMESPACE, t.name, OrganizationSpec(suspended=True), generation=2)
    await until(lambda: refused_with(proxy, key, agent, "ORG_SUSPENDED"), "the org's suspension")
    assert_error(await call(proxy, token=key, agent=agent), 403, "ORG_SUSPENDED")


async def refused_with(proxy: RunningProxy, key: str, agent: str, code: str) -> bool:
    status, payload, _ = await call(proxy, token=key, agent=agent)
    return status == 403 and payload.get("error", {}).get("code") == code


async def test_scopes_are_enforced(proxy: RunningProxy, tenants: TenantFactory) -> None:
    t = await tenants.create(scopes=("memory:read",))
    assert_error(
        await call(proxy, token=t.keys["alpha"], agent=str(t.agents["alpha"])), 403, "INSUFFICIENT_PERMISSIONS"
    )


async def test_body_content_type_json_and_validation(proxy: RunningProxy, tenants: TenantFactory) -> None:
    t = await tenants.create()
    key, agent = t.keys["alpha"], str(t.agents["alpha"])
    big = b'{"messages": [{"role": "user", "content": "' + b"x" * (1024 * 1024) + b'"}]}'
    assert_error(await call(proxy, token=key, agent=agent, raw=big), 413, "PAYLOAD_TOO_LARGE")
    assert_error(
        await call(proxy, token=key, agent=agent, raw=b"hi", headers={"Content-Type": "text/plain"}),
        415, "UNSUPPORTED_MEDIA_TYPE",
    )  # fmt: skip
    assert_error(await call(proxy, token=key, agent=agent, raw=b'{"messages": ['), 400, "INVALID_JSON")
    error = assert_error(
        await call(proxy, token=key, agent=agent,
                   body={"model": "echo", "messages": [{"role": "wizard", "content": 3}], "temperature": 9}),
        400, "VALIDATION_ERROR",
    )  # fmt: skip
    fields = {f["field"] for f in error["field_errors"]}
    assert fields == {"messages[0].role", "temperature"}


async def test_unknown_routes_and_wrong_methods_are_enveloped(proxy: RunningProxy) -> None:
    assert_error(await call(proxy, path="/v1/nope", method="GET"), 404, "NOT_FOUND")
    result = await call(proxy, path="/v1/chat/completions", method="GET")
    assert_error(result, 405, "METHOD_NOT_ALLOWED")
    assert "POST" in result[2]["Allow"]


async def test_budget_exhaustion_is_402_and_calls_no_provider(proxy: RunningProxy, tenants: TenantFactory) -> None:
    # A budget too small for even one worst-case echo call (max output 4096 tokens at $2/M is ~$0.008).
    t = await tenants.create(agent_spec={"budget": {"monthlyLimitUSD": "0.000001"}})
    assert_error(await call(proxy, token=t.keys["alpha"], agent=str(t.agents["alpha"])), 402, "BUDGET_EXCEEDED")


async def test_rate_limit_is_429_with_retry_after(proxy: RunningProxy, tenants: TenantFactory) -> None:
    t = await tenants.create(agent_spec={"limits": {"requestsPerMinute": 2}})
    key, agent = t.keys["alpha"], str(t.agents["alpha"])
    assert (await call(proxy, token=key, agent=agent))[0] == 200
    assert (await call(proxy, token=key, agent=agent))[0] == 200
    result = await call(proxy, token=key, agent=agent)
    assert_error(result, 429, "RATE_LIMITED")
    assert int(result[2]["Retry-After"]) >= 1
    assert result[2]["X-RateLimit-Remaining"] == "0"


async def test_revoked_key_fails_on_another_replica_within_a_second(
    proxy: RunningProxy, second_proxy: RunningProxy, tenants: TenantFactory, reconciler: Reconciler
) -> None:
    t: Tenant = await tenants.create(agents=("solo",))
    key, agent = t.keys["solo"], str(t.agents["solo"])
    for replica in (proxy, second_proxy):  # warm both replicas' caches
        assert (await call(replica, token=key, agent=agent))[0] == 200
    key_name = f"solo-key-{t.name.removeprefix('org-')}"
    spec = ApiKeySpec.model_validate(
        {"organizationRef": {"name": t.name}, "agentRefs": [{"name": f"solo-{t.name.removeprefix('org-')}"}],
         "scopes": ["chat"], "secretName": key_name, "revoked": True}
    )  # fmt: skip
    await reconciler.api_key(NAMESPACE, key_name, spec, generation=2)
    revoked_at = time.monotonic()
    while True:
        status, _, _ = await call(second_proxy, token=key, agent=agent)
        if status == 401:
            break
        assert time.monotonic() - revoked_at < 1.0, "revocation did not reach the second replica within 1 s"
        await asyncio.sleep(0.02)
    assert_error(await call(proxy, token=key, agent=agent), 401, "INVALID_TOKEN")


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/metrics", "/openapi.json"])
async def test_public_endpoints_answer(proxy: RunningProxy, path: str) -> None:
    async with ClientSession() as http, http.get(proxy.base_url + path) as r:
        assert r.status == 200


async def test_memory_routes_are_rate_limited_too(proxy: RunningProxy, tenants: TenantFactory) -> None:
    t = await tenants.create(agent_spec={"limits": {"requestsPerMinute": 2}})
    key, agent = t.keys["alpha"], str(t.agents["alpha"])
    statuses = [(await call(proxy, token=key, agent=agent, path="/v1/memories", method="GET"))[0] for _ in range(2)]
    assert statuses == [200, 200]
    assert_error(await call(proxy, token=key, agent=agent, path="/v1/memories", method="GET"), 429, "RATE_LIMITED")
    # chat shares the same per-minute budget of requests
    assert_error(await call(proxy, token=key, agent=agent), 429, "RATE_LIMITED")
