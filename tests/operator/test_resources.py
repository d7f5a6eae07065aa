"""The operator against a real kube-apiserver: resources applied with kubectl converge into Postgres, Redis and
Secrets, report Kubernetes-style status, and invalid or dangling ones are refused or reported, never crash it."""

from __future__ import annotations

import base64
import json
from typing import TYPE_CHECKING, Any
from uuid import UUID

import yaml

from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.security.apikeys import parse_token, secret_matches
from ibex_dataplane.store.keys import TenantKeys
from tests.operator.support import (
    apply,
    condition,
    events,
    get,
    kubectl,
    resource,
    wait_condition,
    wait_until,
)

if TYPE_CHECKING:
    from tests.operator.conftest import KubeApiserver


def org(name: str, **spec: Any) -> dict[str, Any]:
    return resource("Organization", name, "", {"displayName": name.title(), "models": {"default": "echo"}, **spec})


def agent(name: str, org_name: str, **spec: Any) -> dict[str, Any]:
    return resource("Agent", name, "", {"organizationRef": {"name": org_name}, "defaultModel": "echo", **spec})


def directive(name: str, agent_name: str, content: str, **spec: Any) -> dict[str, Any]:
    return resource("Directive", name, "", {"agentRef": {"name": agent_name}, "content": content, **spec})


def api_key(name: str, org_name: str, agents: list[str], **spec: Any) -> dict[str, Any]:
    return resource(
        "ApiKey",
        name,
        "",
        {
            "organizationRef": {"name": org_name},
            "agentRefs": [{"name": a} for a in agents],
            "scopes": ["chat", "memory:read"],
            "secretName": name,
            **spec,
        },
    )


def into(namespace: str, *objs: dict[str, Any]) -> list[dict[str, Any]]:
    for o in objs:
        o["metadata"]["namespace"] = namespace
    return list(objs)


async def secret_token(kube: KubeApiserver, namespace: str, name: str) -> str | None:
    secret = await get(kube, "secret", name, namespace)
    if secret is None or "token" not in (secret.get("data") or {}):
        return None
    return base64.b64decode(secret["data"]["token"]).decode()


async def key_row(stores: Stores, key_id: str) -> dict[str, Any] | None:
    assert stores.admin_pool is not None
    async with stores.admin_pool.acquire() as conn:
        row = await conn.fetchrow("SELECT * FROM ibex_lookup_api_key($1)", key_id)
    return dict(row) if row else None


async def token_valid(stores: Stores, pepper: bytes, token: str) -> bool:
    """What the proxy checks: the key row exists, is not revoked, and the secret matches the stored hash."""
    key_id, secret = parse_token(token)
    row = await key_row(stores, key_id)
    return row is not None and row["revoked_at"] is None and secret_matches(pepper, secret, bytes(row["secret_hash"]))


async def test_each_kind_becomes_ready_and_reaches_the_stores(
    kube_apiserver: KubeApiserver, op_namespace: str, stores: Stores, pepper: bytes
) -> None:
    kube, ns = kube_apiserver, op_namespace
    await apply(
        kube,
        *into(
            ns,
            org("acme", limits={"requestsPerMinute": 600}),
            agent("bot", "acme"),
            directive("bot-directive", "bot", "You are brief."),
            api_key("bot-key", "acme", ["bot"]),
        ),
    )
    o = await wait_condition(kube, "organization", "acme", ns)
    a = await wait_condition(kube, "agent", "bot", ns)
    d = await wait_condition(kube, "directive", "bot-directive", ns)
    k = await wait_condition(kube, "apikey", "bot-key", ns)

    for obj in (o, a, d, k):
        status = obj["status"]
        assert status["observedGeneration"] == obj["metadata"]["generation"] == 1
        ready = condition(obj)
        assert ready is not None and ready["reason"] == "Reconciled" and ready["observedGeneration"] == 1
        assert ready["lastTransitionTime"]
        assert obj["metadata"]["finalizers"] == ["ibex.dev/cleanup"]
        # kopf's bookkeeping lives under our group, not kopf.zalando.org
        assert not any(a.startswith("kopf.zalando.org/") for a in obj["metadata"].get("annotations", {}))
        assert "ibex.dev/last-handled-configuration" in obj["metadata"]["annotations"]

    org_id, agent_id = UUID(o["status"]["orgId"]), UUID(a["status"]["agentId"])
    assert a["status"]["orgId"] == str(org_id)
    assert a["spec"]["memory"] == {  # defaults from the CRD schema
        "enabled": True,
        "contextTokens": 2000,
        "capture": "off",
        "captureRoles": ["user"],
    }
    assert stores.admin_pool is not None
    async with stores.admin_pool.acquire() as conn:
        org_row = await conn.fetchrow("SELECT * FROM organizations WHERE namespace = $1 AND name = $2", ns, "acme")
        agent_row = await conn.fetchrow("SELECT * FROM agents WHERE id = $1", agent_id)
        versions = await conn.fetch(
            "SELECT v.version, v.content FROM directive_versions v JOIN directives d ON d.id = v.directive_id"
            " WHERE d.namespace = $1 AND d.name = $2",
            ns,
            "bot-directive",
        )
    assert org_row["id"] == org_id and org_row["rpm_limit"] == 600 and org_row["display_name"] == "Acme"
    assert agent_row["org_id"] == org_id and agent_row["default_model"] == "echo"
    assert [(v["version"], v["content"]) for v in versions] == [(1, "You are brief.")]
    assert d["status"]["version"] == 1 and d["status"]["agentId"] == str(agent_id)

    # caches were moved to a new version for the data plane to reload
    assert int(await stores.redis.get(TenantKeys(org_id).policy()) or 0) >= 1
    assert int(await stores.redis.get(TenantKeys(org_id).directive(agent_id)) or 0) >= 1

    # the token is only in the Secret, which the ApiKey owns; the stores hold its hash
    token = await secret_token(kube, ns, "bot-key")
    assert token is not None
    key_id = k["status"]["keyId"]
    assert parse_token(token)[0] == key_id
    assert k["status"]["secretRef"] == {"name": "bot-key", "key": "token"}
    assert await token_valid(stores, pepper, token)
    row = await key_row(stores, key_id)
    assert row is not None and row["agent_ids"] == [agent_id] and sorted(row["scopes"]) == ["chat", "memory:read"]
    secret = await get(kube, "secret", "bot-key", ns)
    assert secret is not None
    assert secret["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "ibex-operator"
    (owner,) = secret["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("ApiKey", "bot-key", k["metadata"]["uid"])

    # transitions are Events; printer columns show readiness
    reasons = {e["reason"] for e in await events(kube, ns, "bot-key")}
    assert {"Ready", "KeyIssued"} <= reasons
    table = (await kubectl(kube, "-n", ns, "get", "organizations,agents,directives,apikeys")).stdout
    assert "READY" in table and table.count("True") >= 4


async def test_spec_changes_converge_and_generations_are_observed(
    kube_apiserver: KubeApiserver, op_namespace: str, stores: Stores, pepper: bytes
) -> None:
    kube, ns = kube_apiserver, op_namespace
    await apply(
        kube,
        *into(
            ns,
            org("acme"),
            agent("bot", "acme"),
            directive("bot-directive", "bot", "Version one."),
            api_key("bot-key", "acme", ["bot"]),
        ),
    )
    k = await wait_condition(kube, "apikey", "bot-key", ns)
    await wait_condition(kube, "directive", "bot-directive", ns)
    first_org = await wait_condition(kube, "organization", "acme", ns)
    first_token = await secret_token(kube, ns, "bot-key")
    assert first_token is not None

    await apply(
        kube,
        *into(
            ns,
            org("acme", suspended=True, limits={"tokensPerMinute": 1000}),
            agent("bot", "acme", memory={"enabled": False, "contextTokens": 0}),
            directive("bot-directive", "bot", "Version two.", injectionMode="UserPrepend"),
            api_key("bot-key", "acme", ["bot"], rotation=1),
        ),
    )
    o = await wait_condition(kube, "organization", "acme", ns, generation=2)
    a = await wait_condition(kube, "agent", "bot", ns, generation=2)
    d = await wait_condition(kube, "directive", "bot-directive", ns, generation=2)
    k2 = await wait_condition(kube, "apikey", "bot-key", ns, generation=2)
    assert d["status"]["version"] == 2
    assert k2["status"]["keyId"] == k["status"]["keyId"] and k2["status"]["rotation"] == 1
    assert o["status"]["orgId"] == first_org["status"]["orgId"]  # stable ids never change

    assert stores.admin_pool is not None
    async with stores.admin_pool.acquire() as conn:
        org_row = await conn.fetchrow("SELECT suspended, tpm_limit, rpm_limit, generation FROM organizations"
                                      " WHERE id = $1", UUID(o["status"]["orgId"]))  # fmt: skip
        agent_row = await conn.fetchrow(
            "SELECT memory_enabled, memory_context_tokens FROM agents WHERE id = $1", UUID(a["status"]["agentId"])
        )
        modes = await conn.fetch(
            "SELECT v.version, v.injection_mode FROM directive_versions v JOIN directives d ON d.id = v.directive_id"
            " WHERE d.namespace = $1 AND d.name = $2 ORDER BY 1",
            ns,
            "bot-directive",
        )
    assert dict(org_row) == {"suspended": True, "tpm_limit": 1000, "rpm_limit": None, "generation": 2}
    assert dict(agent_row) == {"memory_enabled": False, "memory_context_tokens": 0}
    assert [(m["version"], m["injection_mode"]) for m in modes] == [(1, "SystemFirst"), (2, "UserPrepend")]

    # rotation: a new secret under the same key id, the old token stops working
    async def rotated() -> str | None:
        token = await secret_token(kube, ns, "bot-key")
        return token if token != first_token else None

    second_token = await wait_until(rotated, what="the rotated token in the Secret")
    assert parse_token(second_token)[0] == parse_token(first_token)[0]
    assert await token_valid(stores, pepper, second_token)
    assert not await token_valid(stores, pepper, first_token)
    assert "KeyRotated" in {e["reason"] for e in await events(kube, ns, "bot-key")}

    # revocation through the spec: Ready=False with reason Revoked, and the token is dead
    await apply(kube, *into(ns, api_key("bot-key", "acme", ["bot"], rotation=1, revoked=True)))
    await wait_condition(kube, "apikey", "bot-key", ns, status="False", reason="Revoked", generation=3)
    assert not await token_valid(stores, pepper, second_token)


async def test_the_apiserver_refuses_invalid_resources_with_422(
    kube_apiserver: KubeApiserver, op_namespace: str
) -> None:
    kube, ns = kube_apiserver, op_namespace
    invalid = [
        (org("bad-limits", limits={"requestsPerMinute": 0}), "spec.limits.requestsPerMinute"),
        (org("bad-budget", budget={"monthlyLimitUSD": "lots", "enforcement": "Sometimes"}), "spec.budget"),
        (agent("bad-agent", "acme", memory={"contextTokens": -1}), "spec.memory.contextTokens"),
        (resource("Agent", "no-org", ns, {"displayName": "x"}), "spec.organizationRef"),
        (directive("bad-mode", "bot", "hi", injectionMode="Shout"), "spec.injectionMode"),
        (api_key("bad-scope", "acme", ["bot"], scopes=["chat", "root"]), "spec.scopes"),
        (api_key("dup-scope", "acme", ["bot"], scopes=["chat", "chat"]), "spec.scopes[1]"),
        (api_key("dup-agents", "acme", ["bot", "bot"]), "spec.agentRefs[1]"),
        (api_key("no-agents", "acme", []), "spec.agentRefs"),
    ]
    for obj, field in invalid:
        obj["metadata"]["namespace"] = ns
        out = await kubectl(kube, "create", "--validate=false", "-v=6", "-f", "-", input=json.dumps(obj), check=False)
        assert out.returncode != 0, f"{obj['metadata']['name']} was accepted"
        assert "422 Unprocessable Entity" in out.stderr, out.stderr[-2000:]
        assert field in out.stderr, (field, out.stderr[-1000:])
    listed = (await kubectl(kube, "-n", ns, "get", "ibex", "-o", "name")).stdout.strip()
    assert listed == ""


async def test_a_missing_organization_is_reported_and_recovers_when_it_appears(
    kube_apiserver: KubeApiserver, op_namespace: str, stores: Stores, pepper: bytes
) -> None:
    kube, ns = kube_apiserver, op_namespace
    await apply(kube, *into(ns, agent("bot", "late"), api_key("bot-key", "late", ["bot"])))
    a = await wait_condition(kube, "agent", "bot", ns, status="False", reason="OrganizationNotFound")
    bound = condition(a, "OrganizationBound")
    assert bound is not None and bound["status"] == "False" and "late" in bound["message"]
    await wait_condition(kube, "apikey", "bot-key", ns, status="False", reason="OrganizationNotFound")
    warnings = [e for e in await events(kube, ns, "bot") if e["type"] == "Warning"]
    assert any(e["reason"] == "OrganizationNotFound" for e in warnings)
    assert await get(kube, "secret", "bot-key", ns) is None

    await apply(kube, *into(ns, org("late")))
    a = await wait_condition(kube, "agent", "bot", ns, timeout=20)
    k = await wait_condition(kube, "apikey", "bot-key", ns, timeout=20)
    assert (condition(a, "OrganizationBound") or {}).get("status") == "True"
    token = await secret_token(kube, ns, "bot-key")
    assert token is not None and parse_token(token)[0] == k["status"]["keyId"]
    assert await token_valid(stores, pepper, token)


async def test_a_secret_the_operator_does_not_manage_is_never_overwritten(
    kube_apiserver: KubeApiserver, op_namespace: str
) -> None:
    kube, ns = kube_apiserver, op_namespace
    foreign = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "db-password", "namespace": ns},
        "stringData": {"token": "hunter2-not-ours"},
    }
    await kubectl(kube, "apply", "-f", "-", input=yaml.safe_dump(foreign))
    await apply(kube, *into(ns, org("acme"), agent("bot", "acme"), api_key("bot-key", "acme", ["bot"])))
    for o in (api_key("bot-key", "acme", ["bot"], secretName="db-password"),):
        o["metadata"]["namespace"] = ns
        await apply(kube, o)
    k = await wait_condition(kube, "apikey", "bot-key", ns, status="False", reason="SecretConflict", generation=2)
    assert "not managed" in (condition(k) or {}).get("message", "")
    secret = await get(kube, "secret", "db-password", ns)
    assert secret is not None and base64.b64decode(secret["data"]["token"]) == b"hunter2-not-ours"
    assert "ownerReferences" not in secret["metadata"]
