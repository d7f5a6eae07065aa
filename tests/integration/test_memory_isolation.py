"""Adversarial isolation: nothing of agent A's memories reaches org B or A's other agent, on any memory route."""

from __future__ import annotations

import time
import uuid

from aiohttp import ClientSession

from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.security.principal import HEADER, Principal, PrincipalSigner, http_target
from tests.support.memory import MemoryClient, memory_client
from tests.support.proxy import RunningProxy
from tests.support.tenants import TenantFactory

SECRET_FACT = "Agent alpha's secret: the launch code word is marmalade."


async def test_other_orgs_and_other_agents_see_nothing_on_any_route(
    proxy: RunningProxy, tenants: TenantFactory
) -> None:
    a = await tenants.create()
    b = await tenants.create()
    async with memory_client(proxy, a) as owner:
        created = await owner.write({"content": SECRET_FACT, "labels": ["secret"]})
        mid = created.body["memory"]["id"]
        intruders: dict[str, MemoryClient] = {
            "org B": owner.as_(b.keys["alpha"], str(b.agents["alpha"])),
            "org A, agent beta": owner.as_(a.keys["beta"], str(a.agents["beta"])),
        }
        for who, intruder in intruders.items():
            for reply in (
                await intruder.get(mid),
                await intruder.feedback(mid, True),
                await intruder.forget(mid),
                await intruder.call("POST", f"/v1/memories/{mid}/feedback", {"signal": "negative"}),
            ):
                assert reply.status == 404 and reply.error_code() == "NOT_FOUND", (who, reply.body)
            assert (await intruder.list()).body["data"] == [], who
            assert (await intruder.list("status=superseded")).body["data"] == [], who
            for query in (SECRET_FACT, "marmalade", "launch code"):
                assert (await intruder.search(query, labels=["secret"])).body["results"] == [], who
                assert (await intruder.search(query)).body["results"] == [], who
            # Writing the same content creates the intruder's own memory: no dedup across tenants.
            own = await intruder.write({"content": SECRET_FACT})
            assert own.status == 201 and own.body["memory"]["id"] != mid, who
            batch = await intruder.batch([{"content": SECRET_FACT}])
            assert batch.body["results"][0]["memory"]["id"] == own.body["memory"]["id"], who
        # Naming agent A with another org's key is refused the same way for a real and a made-up agent.
        foreign = owner.as_(b.keys["alpha"], str(a.agents["alpha"]))
        made_up = owner.as_(b.keys["alpha"], str(uuid.uuid4()))
        assert (await foreign.get(mid)).error_code() == (await made_up.get(mid)).error_code() == "AGENT_NOT_AUTHORIZED"
        # The owner still has it, untouched.
        mine = await owner.get(mid)
        assert mine.status == 200 and mine.body["memory"]["usefulness"] == 0.5


async def test_missing_scopes_are_403_before_the_memory_stage(proxy: RunningProxy, tenants: TenantFactory) -> None:
    t = await tenants.create(scopes=("chat",))
    async with memory_client(proxy, t) as client:
        for reply in (
            await client.write({"content": "x"}),
            await client.list(),
            await client.search("x"),
            await client.forget(str(uuid.uuid4())),
            await client.batch([{"content": "x"}]),
        ):
            assert reply.status == 403 and reply.error_code() == "INSUFFICIENT_PERMISSIONS"
        assert (await client.as_(None, client.agent).list()).status == 401


async def test_the_data_plane_role_without_an_org_sees_zero_memory_rows(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores
) -> None:
    t = await tenants.create()
    async with memory_client(proxy, t) as client:
        first = await client.write({"content": "Row-level security keeps this hidden.", "labels": ["x"]})
        await client.write({"content": "Row-level security keeps this hidden too."}, headers={"Idempotency-Key": "i"})
        await client.feedback(first.body["memory"]["id"], True)
    async with stores.db.unscoped() as conn:
        assert await conn.fetchval("SELECT current_user") == "ibex_app"
        for table in ("memories", "memory_labels", "memory_relationships", "idempotency_keys", "outbox"):
            assert await conn.fetchval(f"SELECT count(*) FROM {table}") == 0, table
    async with stores.db.tenant(t.org_id, t.agents["beta"]) as conn:
        assert await conn.fetchval("SELECT count(*) FROM memories") == 0
    async with stores.db.tenant(t.org_id, t.agents["alpha"]) as conn:
        assert await conn.fetchval("SELECT count(*) FROM memories") == 2


async def test_the_memory_stage_refuses_missing_forged_and_expired_principals(
    proxy: RunningProxy, tenants: TenantFactory
) -> None:
    t = await tenants.create()
    assert proxy.memory is not None
    stage = proxy.memory
    listing = http_target("GET", "/v1/memories")
    good = Principal(t.org_id, t.agents["alpha"], frozenset({"memory:read"}), "r", time.time() + 30, listing)
    expired = Principal(t.org_id, t.agents["alpha"], frozenset({"memory:read"}), "r", time.time() - 1, listing)
    # Signed properly, but for another call: replaying it against this route is refused.
    elsewhere = Principal(
        t.org_id, t.agents["alpha"], frozenset({"memory:read"}), "r", time.time() + 30,
        http_target("POST", "/v1/memories/search"),
    )  # fmt: skip
    forged = PrincipalSigner(b"not-the-real-secret-at-all").sign(good)
    tampered = stage.signer.sign(good)[:-3] + "AAA"
    async with ClientSession() as http:
        for token, code in (
            (None, "MISSING_TOKEN"),
            (forged, "INVALID_TOKEN"),
            (tampered, "INVALID_TOKEN"),
            (stage.signer.sign(expired), "INVALID_TOKEN"),
            ("garbage", "INVALID_TOKEN"),
            (stage.signer.sign(elsewhere), "INVALID_TOKEN"),
        ):
            headers = {HEADER: token} if token else {}
            for path in ("/v1/memories",):
                async with http.get(stage.base_url + path, headers=headers) as r:
                    body = await r.json()
                    assert (r.status, body["error"]["code"]) == (401, code), (token, path)
        async with http.get(stage.base_url + "/v1/memories", headers={HEADER: stage.signer.sign(good)}) as r:
            assert r.status == 200
        for token in (None, stage.signer.sign(good)):  # an unknown route reveals nothing either way
            async with http.get(stage.base_url + "/v1/does-not-exist", headers={HEADER: token} if token else {}) as r:
                assert r.status == 401
        # A principal without the write scope cannot write, whatever the body says.
        writing = Principal(
            t.org_id, t.agents["alpha"], frozenset({"memory:read"}), "r", time.time() + 30,
            http_target("POST", "/v1/memories"),
        )  # fmt: skip
        headers = {HEADER: stage.signer.sign(writing)}
        async with http.post(stage.base_url + "/v1/memories", json={"content": "x"}, headers=headers) as r:
            assert r.status == 403


async def test_the_full_text_function_only_answers_for_the_callers_own_org_and_agent(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores
) -> None:
    a = await tenants.create()
    b = await tenants.create()
    async with memory_client(proxy, a) as owner:
        await owner.write({"content": SECRET_FACT})
    alpha = a.agents["alpha"]
    sql = "SELECT count(*) FROM ibex_memory_text_candidates($1, 'marmalade', NULL, false, NULL, '{}', 10)"
    async with stores.db.tenant(a.org_id, alpha) as conn:
        assert await conn.fetchval(sql, alpha) == 1
    async with stores.db.unscoped() as conn:
        assert await conn.fetchval(sql, alpha) == 0
    async with stores.db.tenant(b.org_id) as conn:
        assert await conn.fetchval(sql, alpha) == 0
    async with stores.db.tenant(a.org_id, a.agents["beta"]) as conn:
        assert await conn.fetchval(sql, alpha) == 0
