"""Finalizers: deleting an Organization or Agent removes its data from Postgres, Redis and ClickHouse (and records
what was removed); deleting a Directive drops it; deleting an ApiKey revokes it for good; nothing of another tenant
or agent is touched."""

from __future__ import annotations

import hashlib
import json
import uuid
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any
from uuid import UUID

from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.security.apikeys import parse_token
from ibex_dataplane.store.clickhouse import org_query
from ibex_dataplane.store.keys import GlobalKeys, TenantKeys
from tests.operator.support import apply, events, get, kubectl, wait_condition, wait_until
from tests.operator.test_resources import agent, api_key, directive, into, key_row, org, secret_token, token_valid

if TYPE_CHECKING:
    from tests.operator.conftest import KubeApiserver

ANALYTICS = ("llm_traces", "usage_facts")


async def seed(stores: Stores, org_id: UUID, agent_id: UUID, key_id: str) -> None:
    """Data the data plane would have written for one agent: memories, a session, spend, caches, analytics."""
    assert stores.admin_pool is not None
    now = datetime.now(UTC)
    async with stores.admin_pool.acquire() as conn:
        for text in ("likes tea", "lives in Lisbon"):
            await conn.execute(
                "INSERT INTO memories (id, org_id, agent_id, content, content_hash, status, source)"
                " VALUES ($1, $2, $3, $4, $5, 'active', 'user_provided')",
                uuid.uuid4(), org_id, agent_id, text, hashlib.sha256(text.encode()).digest(),
            )  # fmt: skip
        await conn.execute(
            "INSERT INTO sessions (org_id, agent_id, external_id) VALUES ($1, $2, $3)", org_id, agent_id, "s-1"
        )
        request_id = f"req-{uuid.uuid4().hex}"
        await conn.execute(
            "INSERT INTO budget_ledger (org_id, agent_id, request_id, model, cost_usd)"
            " VALUES ($1, $2, $3, 'echo', 0.5)",
            org_id, agent_id, request_id,
        )  # fmt: skip
        await conn.execute(
            "INSERT INTO budget_periods (org_id, scope_kind, scope_id, period_start, enforcement)"
            " VALUES ($1, 'agent', $2, date_trunc('month', now())::date, 'HardCap')"
            " ON CONFLICT DO NOTHING",
            org_id, agent_id,
        )  # fmt: skip
        await conn.execute(
            "INSERT INTO budget_periods (org_id, scope_kind, scope_id, period_start, enforcement)"
            " VALUES ($1, 'org', $1, date_trunc('month', now())::date, 'HardCap') ON CONFLICT DO NOTHING",
            org_id,
        )
        await conn.execute("INSERT INTO outbox (org_id, agent_id, kind) VALUES ($1, $2, 'hot_cache')", org_id, agent_id)
    keys = TenantKeys(org_id)
    await stores.redis.set(keys.agent_rate_window(agent_id), b"1")
    await stores.redis.set(keys.hot_memories(agent_id), b"cached")
    await stores.redis.set(keys.org_rate_window(), b"1")
    await stores.redis.set(GlobalKeys.api_key(key_id) + ":v1", b"cached key record")
    for table in ANALYTICS:
        columns = ["org_id", "agent_id", "request_id", "ts"]
        await stores.clickhouse.insert(table, [[org_id, agent_id, request_id, now]], columns)


async def rows_of(stores: Stores, org_id: UUID, agent_id: UUID | None = None) -> dict[str, int]:
    """Rows per table that carry the org (and agent), found in the catalog like the purge finds them."""
    assert stores.admin_pool is not None
    counts: dict[str, int] = {}
    async with stores.admin_pool.acquire() as conn:
        tables = await conn.fetch(
            "SELECT table_name, array_agg(column_name::text) AS cols FROM information_schema.columns"
            " WHERE table_schema = 'public' AND column_name IN ('org_id', 'agent_id') GROUP BY table_name"
        )
        for t in tables:
            name, cols = t["table_name"], set(t["cols"])
            if name == "tenant_deletions" or "org_id" not in cols:
                continue
            if agent_id is None:
                n = await conn.fetchval(f'SELECT count(*) FROM "{name}" WHERE org_id = $1', org_id)
            elif "agent_id" in cols:
                n = await conn.fetchval(
                    f'SELECT count(*) FROM "{name}" WHERE org_id = $1 AND agent_id = $2', org_id, agent_id
                )
            else:
                continue
            if n:
                counts[name] = n
        if agent_id is None and await conn.fetchval("SELECT count(*) FROM organizations WHERE id = $1", org_id):
            counts["organizations"] = 1
        if agent_id is not None and await conn.fetchval("SELECT count(*) FROM agents WHERE id = $1", agent_id):
            counts["agents"] = 1
    return counts


async def redis_keys(stores: Stores, org_id: UUID, agent_id: UUID | None = None) -> list[str]:
    found = [k.decode() async for k in stores.redis.scan_iter(match=TenantKeys(org_id).pattern(), count=500)]
    return sorted(k for k in found if agent_id is None or str(agent_id) in k.split(":"))


async def analytics_rows(stores: Stores, org_id: UUID, agent_id: UUID | None = None) -> int:
    total = 0
    for table in ANALYTICS:
        where = "org_id = {org_id:UUID}" + (" AND agent_id = {agent_id:UUID}" if agent_id else "")
        params = {"agent_id": agent_id} if agent_id else {}
        rows = await stores.clickhouse.query(org_query(f"SELECT count() FROM {table} WHERE {where}", org_id, **params))
        total += int(rows[0][0])
    return total


async def deletion_record(stores: Stores, uid: str) -> dict[str, Any]:
    assert stores.admin_pool is not None
    async with stores.admin_pool.acquire() as conn:
        row = await conn.fetchrow("SELECT * FROM tenant_deletions WHERE resource_uid = $1", uid)
    assert row is not None, f"no deletion record for {uid}"
    return dict(row)


async def ready_tenant(kube: KubeApiserver, ns: str, name: str, agents: list[str]) -> dict[str, Any]:
    await apply(
        kube,
        *into(
            ns,
            org(name),
            *(agent(a, name) for a in agents),
            directive(f"{agents[0]}-directive", agents[0], "Be kind."),
            api_key(f"{name}-key", name, agents),
        ),
    )
    ids: dict[str, Any] = {}
    o = await wait_condition(kube, "organization", name, ns)
    ids["org"] = UUID(o["status"]["orgId"])
    ids["org_uid"] = o["metadata"]["uid"]
    for a in agents:
        obj = await wait_condition(kube, "agent", a, ns)
        ids[a] = UUID(obj["status"]["agentId"])
        ids[f"{a}_uid"] = obj["metadata"]["uid"]
    await wait_condition(kube, "directive", f"{agents[0]}-directive", ns)
    k = await wait_condition(kube, "apikey", f"{name}-key", ns)
    ids["key"] = k["status"]["keyId"]
    return ids


async def test_deleting_an_organization_removes_its_data_from_every_store(
    kube_apiserver: KubeApiserver, op_namespace: str, stores: Stores
) -> None:
    kube, ns = kube_apiserver, op_namespace
    doomed = await ready_tenant(kube, ns, "doomed", ["alpha", "beta"])
    kept = await ready_tenant(kube, ns, "kept", ["gamma"])
    for t, agents in ((doomed, ("alpha", "beta")), (kept, ("gamma",))):
        for a in agents:
            await seed(stores, t["org"], t[a], t["key"])
    kept_rows, kept_keys = await rows_of(stores, kept["org"]), await redis_keys(stores, kept["org"])
    kept_analytics = await analytics_rows(stores, kept["org"])
    before = await rows_of(stores, doomed["org"])
    assert {"memories", "sessions", "agents", "api_keys", "budget_ledger", "outbox", "directives"} <= set(before)
    assert await redis_keys(stores, doomed["org"]) and await analytics_rows(stores, doomed["org"]) == 4

    await kubectl(kube, "-n", ns, "delete", "organization", "doomed", "--timeout=30s")

    assert await rows_of(stores, doomed["org"]) == {}
    assert await redis_keys(stores, doomed["org"]) == []
    assert not [k async for k in stores.redis.scan_iter(match=GlobalKeys.api_key(doomed["key"]) + ":*")]
    assert await analytics_rows(stores, doomed["org"]) == 0

    record = await deletion_record(stores, doomed["org_uid"])
    assert (record["kind"], record["namespace"], record["name"]) == ("Organization", ns, "doomed")
    assert record["org_id"] == doomed["org"] and record["completed_at"] is not None
    removed = json.loads(record["removed"])
    assert removed["postgres"]["memories"] == 4 and removed["postgres"]["organizations"] == 1
    assert removed["postgres"]["agents"] == 2 and removed["postgres"]["api_keys"] == 1
    assert removed["clickhouse"] == {"llm_traces": 2, "usage_facts": 2}
    assert removed["redis"]["rl"] >= 3 and removed["redis"]["hot"] == 2 and removed["redis"]["apikey"] == 1
    event = [e for e in await events(kube, ns, "doomed") if e["reason"] == "DataDeleted"]
    assert event and "postgres" in event[0]["message"] and "clickhouse 4 rows" in event[0]["message"]

    # the other tenant is untouched
    assert await rows_of(stores, kept["org"]) == kept_rows
    assert await redis_keys(stores, kept["org"]) == kept_keys
    assert await analytics_rows(stores, kept["org"]) == kept_analytics


async def test_deleting_an_agent_removes_only_that_agents_data(
    kube_apiserver: KubeApiserver, op_namespace: str, stores: Stores
) -> None:
    kube, ns = kube_apiserver, op_namespace
    t = await ready_tenant(kube, ns, "acme", ["alpha", "beta"])
    for a in ("alpha", "beta"):
        await seed(stores, t["org"], t[a], t["key"])
    beta_rows = await rows_of(stores, t["org"], t["beta"])
    beta_keys = await redis_keys(stores, t["org"], t["beta"])
    key_version = int(await stores.redis.get(GlobalKeys.api_key(t["key"])) or 0)

    await kubectl(kube, "-n", ns, "delete", "agent", "alpha", "--timeout=30s")

    assert await rows_of(stores, t["org"], t["alpha"]) == {}
    assert await redis_keys(stores, t["org"], t["alpha"]) == []
    assert await analytics_rows(stores, t["org"], t["alpha"]) == 0
    assert await rows_of(stores, t["org"], t["beta"]) == beta_rows
    assert await redis_keys(stores, t["org"], t["beta"]) == beta_keys
    assert await analytics_rows(stores, t["org"], t["beta"]) == 2
    assert "organizations" in await rows_of(stores, t["org"])
    # the key that could act as alpha now acts as beta only, and its cached record moved to a new version
    assert stores.admin_pool is not None
    async with stores.admin_pool.acquire() as conn:
        bound = await conn.fetch("SELECT agent_id FROM api_key_agents WHERE key_id = $1", t["key"])
        periods = await conn.fetch("SELECT scope_kind FROM budget_periods WHERE org_id = $1 ORDER BY 1", t["org"])
    assert [r["agent_id"] for r in bound] == [t["beta"]]
    assert [p["scope_kind"] for p in periods] == ["agent", "org"]  # beta's period and the org's stay
    assert int(await stores.redis.get(GlobalKeys.api_key(t["key"])) or 0) > key_version

    record = await deletion_record(stores, t["alpha_uid"])
    assert (record["kind"], record["agent_id"]) == ("Agent", t["alpha"])
    removed = json.loads(record["removed"])
    assert removed["postgres"]["memories"] == 2 and removed["postgres"]["agents"] == 1
    assert removed["postgres"]["budget_periods"] == 1 and removed["postgres"]["directive_versions"] == 1
    assert removed["clickhouse"] == {"llm_traces": 1, "usage_facts": 1}


async def test_deleting_a_directive_removes_it_and_its_versions(
    kube_apiserver: KubeApiserver, op_namespace: str, stores: Stores
) -> None:
    kube, ns = kube_apiserver, op_namespace
    t = await ready_tenant(kube, ns, "acme", ["alpha"])
    await apply(kube, *into(ns, directive("alpha-directive", "alpha", "Be kinder.")))
    await wait_condition(kube, "directive", "alpha-directive", ns, generation=2)
    version_key = TenantKeys(t["org"]).directive(t["alpha"])
    before = int(await stores.redis.get(version_key) or 0)

    await kubectl(kube, "-n", ns, "delete", "directive", "alpha-directive", "--timeout=30s")

    assert stores.admin_pool is not None
    async with stores.admin_pool.acquire() as conn:
        left = await conn.fetchval("SELECT count(*) FROM directive_versions WHERE agent_id = $1", t["alpha"])
    assert left == 0
    assert int(await stores.redis.get(version_key) or 0) > before
    reasons = [e["message"] for e in await events(kube, ns, "alpha-directive") if e["reason"] == "DirectiveRemoved"]
    assert reasons and "2 version(s)" in reasons[0]
    assert await get(kube, "directive", "alpha-directive", ns) is None


async def test_a_deleted_api_key_is_revoked_and_a_recreated_one_never_revives_the_old_token(
    kube_apiserver: KubeApiserver, op_namespace: str, stores: Stores, pepper: bytes
) -> None:
    kube, ns = kube_apiserver, op_namespace
    t = await ready_tenant(kube, ns, "acme", ["alpha"])
    old = await secret_token(kube, ns, "acme-key")
    assert old is not None and await token_valid(stores, pepper, old)

    await kubectl(kube, "-n", ns, "delete", "apikey", "acme-key", "--timeout=30s")
    assert not await token_valid(stores, pepper, old)
    row = await key_row(stores, t["key"])
    assert row is not None and row["revoked_at"] is not None  # the row stays, revoked, for the record
    assert "KeyRevoked" in {e["reason"] for e in await events(kube, ns, "acme-key")}

    # The same manifest applied again (a GitOps revert) gets the same key id with a fresh secret.
    await apply(kube, *into(ns, api_key("acme-key", "acme", ["alpha"])))
    await wait_condition(kube, "apikey", "acme-key", ns)

    async def fresh_token() -> str | None:
        token = await secret_token(kube, ns, "acme-key")
        return token if token and token != old and await token_valid(stores, pepper, token) else None

    new = await wait_until(fresh_token, timeout=30, what="a fresh token in the re-created Secret")
    assert parse_token(new)[0] == t["key"]
    assert not await token_valid(stores, pepper, old)
