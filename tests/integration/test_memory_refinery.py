"""Each refinery stage, observed over HTTP through the proxy with real Postgres, Valkey, ONNX and Presidio."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from uuid import UUID

import numpy as np
import pytest
from aiohttp import ClientSession, web

from ibex_dataplane.embedding import EmbeddingError, Embeddings
from ibex_dataplane.memory.app import METRICS, OUTBOX, SERVICE
from ibex_dataplane.memory.models import Tenant
from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.security.principal import HEADER, Principal, http_target
from ibex_dataplane.settings import Settings
from ibex_dataplane.store.keys import TenantKeys
from tests.support.memory import memory_client
from tests.support.proxy import MemoryDeps, RunningProxy, running_memory_stage, running_proxy
from tests.support.tenants import TenantFactory


async def rows(stores: Stores, org: UUID, agent: UUID, sql: str, *args: object) -> list[dict[str, object]]:
    async with stores.db.tenant(org, agent) as conn:
        return [dict(r) for r in await conn.fetch(sql, *args)]


async def test_pii_stage_masks_confident_findings_with_typed_placeholders(
    proxy: RunningProxy, tenants: TenantFactory
) -> None:
    t = await tenants.create()
    async with memory_client(proxy, t) as client:
        reply = await client.write({"content": "Send the invoice to jane.doe@example.co.uk by Friday."})
        assert reply.status == 201
        assert reply.body["memory"]["content"] == "Send the invoice to [EMAIL_ADDRESS] by Friday."


async def test_low_confidence_pii_quarantines_without_echo_and_without_embedding(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores
) -> None:
    t = await tenants.create()
    async with memory_client(proxy, t) as client:
        # A bare phone number with no context word scores below 0.70 but is plausible: quarantine.
        reply = await client.write({"content": "Reach the vendor at 415-555-0132 tomorrow."})
        assert reply.status == 202, reply.body
        memory = reply.body["memory"]
        assert memory["status"] == "quarantined"
        # No part of the number comes back (a bare "415" can occur inside a random id).
        assert "content" not in memory and "415-555" not in reply.raw.decode() and "555-0132" not in reply.raw.decode()
        assert (await client.get(memory["id"])).status == 404
        assert (await client.list()).body["data"] == []
        assert (await client.search("vendor")).body["results"] == []
    stored = await rows(stores, t.org_id, t.agents["alpha"], "SELECT status, embedding FROM memories")
    assert stored == [{"status": "quarantined", "embedding": None}]


async def test_embedding_failure_is_503_and_leaves_nothing_behind(
    settings: Settings, stores: Stores, pepper: bytes, memory_deps: MemoryDeps, tenants: TenantFactory
) -> None:
    class BrokenEmbedder:
        dimensions = 384
        model_name = "broken"

        async def embed(self, texts: Sequence[str]) -> Embeddings:
            raise EmbeddingError("model file is corrupt")

        def embed_sync(self, texts: Sequence[str]) -> Embeddings:
            raise EmbeddingError("model file is corrupt")

    t = await tenants.create()
    deps = MemoryDeps(BrokenEmbedder(), memory_deps.redactor)
    async with running_proxy(settings, stores, pepper, memory=deps) as broken, memory_client(broken, t) as client:
        reply = await client.write({"content": "This will never be embedded."})
        assert reply.status == 503 and reply.error_code() == "SERVICE_DEGRADED"
        batch = await client.batch([{"content": "neither will this"}, {"content": ""}])
        assert [r["status"] for r in batch.body["results"]] == [503, 400]
    assert await rows(stores, t.org_id, t.agents["alpha"], "SELECT id FROM memories") == []
    assert await rows(stores, t.org_id, t.agents["alpha"], "SELECT id FROM outbox") == []


async def test_near_duplicates_and_contradictions_become_relationships(
    proxy: RunningProxy, tenants: TenantFactory
) -> None:
    t = await tenants.create()
    async with memory_client(proxy, t) as client:
        floor3 = (await client.write({"content": "The user's office is on floor 3."})).body["memory"]["id"]
        floor5 = await client.write({"content": "The user's office is on floor 5."})
        kinds = {(r["kind"], r["target_id"]) for r in floor5.body["relationships"]}
        assert ("near_duplicate_of", floor3) in kinds
        assert ("contradicts", floor3) in kinds
        tea = (await client.write({"content": "The user likes green tea."})).body["memory"]["id"]
        no_tea = await client.write({"content": "The user does not like green tea."})
        assert ("contradicts", tea) in {(r["kind"], r["target_id"]) for r in no_tea.body["relationships"]}
        # A signal, not a merge: both memories stay active.
        assert (await client.get(floor3)).body["memory"]["status"] == "active"
        assert (await client.get(tea)).body["memory"]["status"] == "active"


async def test_a_newer_fact_supersedes_the_older_one_and_closes_its_validity(
    proxy: RunningProxy, tenants: TenantFactory
) -> None:
    t = await tenants.create()
    async with memory_client(proxy, t) as client:
        paris = await client.write({"content": "The user lives in Paris.", "valid_from": "2020-01-01T00:00:00Z"})
        berlin = await client.write({"content": "The user lives in Berlin.", "valid_from": "2023-06-01T00:00:00Z"})
        assert berlin.status == 201
        old_id = paris.body["memory"]["id"]
        assert ("supersedes", old_id) in {(r["kind"], r["target_id"]) for r in berlin.body["relationships"]}
        old = (await client.get(old_id)).body["memory"]
        assert old["status"] == "superseded"
        assert old["valid_until"] == "2023-06-01T00:00:00Z"
        assert old["revision"] == 2
        found = await client.search("Where does the user live?", min_confidence=0)
        contents = [h["memory"]["content"] for h in found.body["results"]]
        assert "The user lives in Paris." not in contents
        history = await client.list("status=superseded")
        assert [m["id"] for m in history.body["data"]] == [old_id]


async def test_disjoint_validity_supersedes_by_interval_without_the_classifier(
    settings: Settings, stores: Stores, memory_deps: MemoryDeps, tenants: TenantFactory
) -> None:
    asked: list[str] = []

    class RecordingClassifier:
        async def classify(self, question: object) -> str:
            asked.append("asked")
            raise RuntimeError("must not be asked")

    t = await tenants.create()
    # Straight to a memory stage with this classifier, signing principals as the proxy would.
    async with running_memory_stage(settings, stores, memory_deps, classifier=RecordingClassifier()) as stage:
        scopes = frozenset({"memory:write", "memory:read"})
        principal = Principal(
            t.org_id, t.agents["alpha"], scopes, "r1", time.time() + 30, http_target("POST", "/v1/memories")
        )
        headers = {HEADER: stage.signer.sign(principal)}
        async with ClientSession() as http:

            async def write(body: dict[str, object]) -> dict[str, object]:
                async with http.post(stage.base_url + "/v1/memories", json=body, headers=headers) as r:
                    assert r.status == 201, await r.text()
                    return await r.json()  # type: ignore[no-any-return]

            old = await write({"content": "The team standup is at 9am.", "valid_from": "2021-01-01T00:00:00Z",
                               "valid_until": "2022-01-01T00:00:00Z"})  # fmt: skip
            new = await write({"content": "The team standup is at 10am.", "valid_from": "2022-01-01T00:00:00Z"})
            old_id = old["memory"]["id"]  # type: ignore[index]
            kinds = {(r["kind"], r["target_id"], r["needs_review"]) for r in new["relationships"]}  # type: ignore[attr-defined]
            assert ("supersedes", old_id, False) in kinds
            assert asked == []
            # A classifier failure never rewrites history: the pair is only flagged for review.
            again = await write({"content": "The team standup is at 10am sharp."})
            flagged = [r for r in again["relationships"] if r["needs_review"]]  # type: ignore[attr-defined]
            assert flagged and all(r["kind"] == "overlaps" for r in flagged)
            assert asked


async def test_hot_cache_follows_commits_and_forgets_through_postgres(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores
) -> None:
    t = await tenants.create()
    assert proxy.memory is not None
    service = proxy.memory.app[SERVICE]
    tenant = Tenant(t.org_id, t.agents["alpha"])
    async with memory_client(proxy, t) as client:
        a = (await client.write({"content": "Hot memory number one."})).body["memory"]["id"]
        b = (await client.write({"content": "Hot memory number two, quite different."})).body["memory"]["id"]
        hot = [str(m.id) for m in await service.hot(tenant, 10)]
        assert set(hot) == {a, b}
        await client.forget(a)
        key = TenantKeys(t.org_id).hot_memories(t.agents["alpha"])
        assert a.encode() not in await stores.redis.zrange(key, 0, -1)
        # Even a stale member put back by hand is never rehydrated.
        await stores.redis.zadd(key, {a: 9e12})
        assert [str(m.id) for m in await service.hot(tenant, 10)] == [b]


async def test_after_commit_failures_are_retried_through_the_outbox(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores
) -> None:
    t = await tenants.create()
    assert proxy.memory is not None
    app = proxy.memory.app
    failures = app[METRICS].after_commit_failures.labels("hot_cache")
    before = failures._value.get()
    outbox = app[OUTBOX]
    key = TenantKeys(t.org_id).hot_memories(t.agents["alpha"])
    original = outbox._hot.sync

    async def redis_down(*args: object, **kwargs: object) -> None:
        from ibex_dataplane.store.errors import StoreUnavailable

        raise StoreUnavailable("redis", "ConnectionError")

    outbox._hot.sync = redis_down  # type: ignore[method-assign]
    try:
        async with memory_client(proxy, t) as client:
            reply = await client.write({"content": "Written while the cache is down."})
            assert reply.status == 201  # the durable record does not care
    finally:
        outbox._hot.sync = original  # type: ignore[method-assign]
    assert failures._value.get() == before + 1
    assert await stores.redis.zcard(key) == 0
    pending = await rows(stores, t.org_id, t.agents["alpha"], "SELECT id FROM outbox WHERE done_at IS NULL")
    assert len(pending) == 1
    async with stores.db.tenant(t.org_id) as conn:
        await conn.execute("UPDATE outbox SET available_at = now() WHERE org_id = $1", t.org_id)
    for _ in range(100):
        if await stores.redis.zcard(key) == 1:
            break
        await asyncio.sleep(0.05)
    assert await stores.redis.zcard(key) == 1
    done = await rows(stores, t.org_id, t.agents["alpha"], "SELECT done_at FROM outbox")
    for _ in range(40):
        if all(r["done_at"] for r in done):
            break
        await asyncio.sleep(0.05)
        done = await rows(stores, t.org_id, t.agents["alpha"], "SELECT done_at FROM outbox")
    assert all(r["done_at"] for r in done)


async def test_batch_returns_per_item_results_in_input_order(proxy: RunningProxy, tenants: TenantFactory) -> None:
    t = await tenants.create()
    async with memory_client(proxy, t) as client:
        existing = await client.write({"content": "Already known fact."})
        items = [
            {"content": "First new fact about invoices."},
            {"content": ""},
            {"content": "already known FACT."},
            {"content": "First new fact about invoices."},
            {"content": "Call me at 415-555-0132."},
            {"content": "A second, unrelated fact about the garden.", "labels": ["home"]},
        ]
        reply = await client.batch(items)
        assert reply.status == 200
        results = reply.body["results"]
        assert [r["status"] for r in results] == [201, 400, 200, 200, 201, 201], results
        assert results[1]["error"]["code"] == "VALIDATION_ERROR"
        assert results[2]["memory"]["id"] == existing.body["memory"]["id"]
        assert results[3]["memory"]["id"] == results[0]["memory"]["id"]
        assert results[4]["memory"]["content"] == "Call me at [PHONE_NUMBER]."
        too_many = await client.batch([{"content": f"fact {i}"} for i in range(101)])
        assert too_many.status == 400


@pytest.mark.parametrize("size", [1, 20])
async def test_vectors_are_stored_for_every_created_memory(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores, size: int
) -> None:
    t = await tenants.create()
    async with memory_client(proxy, t) as client:
        reply = await client.batch([{"content": f"Distinct fact number {i} about topic {i * 7}."} for i in range(size)])
        assert {r["status"] for r in reply.body["results"]} == {201}
    stored = await rows(stores, t.org_id, t.agents["alpha"], "SELECT embedding FROM memories")
    assert len(stored) == size
    for row in stored:
        raw = row["embedding"]
        vector = np.asarray(raw.to_numpy() if hasattr(raw, "to_numpy") else raw)
        assert vector.shape == (384,)
        assert abs(float(np.linalg.norm(vector)) - 1.0) < 1e-3


async def test_a_batch_larger_than_a_slice_relates_items_across_slices(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores
) -> None:
    """The memory stage commits a ``:batch`` slice by slice (10 items); later slices see the earlier ones as stored
    memories, so relationships, supersession and exact duplicates across slices come out as within one slice."""
    t = await tenants.create()
    topics = ["invoices", "the garden", "the car", "holidays", "a printer", "the dentist", "a bicycle", "the piano"]
    items: list[dict[str, object]] = [
        {"content": f"Note {i}: the user wrote down item {i} about {topics[i % len(topics)]}."} for i in range(60)
    ]
    items[0] = {"content": "The user's office is on floor 3."}
    items[5] = {"content": "The user lives in Paris.", "valid_from": "2020-01-01T00:00:00Z"}
    items[30] = {"content": "The user's office is on floor 5."}  # fourth slice
    items[52] = {"content": "The user lives in Berlin.", "valid_from": "2023-06-01T00:00:00Z"}  # sixth slice
    items[55] = {"content": "the user's office is on FLOOR 3."}  # exact duplicate of the first item, sixth slice
    assert proxy.memory is not None
    persists = persist_calls(proxy.memory.app)
    async with memory_client(proxy, t) as client:
        reply = await client.batch(items)
        # Six slices of 10, one commit each; the sixth commits 9 (its exact duplicate follows the first item).
        assert persist_calls(proxy.memory.app) - persists == 6
        assert reply.status == 200
        results = reply.body["results"]
        assert [r["status"] for r in results] == [200 if i == 55 else 201 for i in range(60)], results
        first = results[0]["memory"]["id"]
        assert results[55]["memory"]["id"] == first
        floor5 = {(r["kind"], r["target_id"]) for r in results[30]["relationships"]}
        assert {("near_duplicate_of", first), ("contradicts", first)} <= floor5
        paris = results[5]["memory"]["id"]
        assert ("supersedes", paris) in {(r["kind"], r["target_id"]) for r in results[52]["relationships"]}
        assert (await client.get(paris)).body["memory"]["status"] == "superseded"
    stored = await rows(stores, t.org_id, t.agents["alpha"], "SELECT count(*) AS n FROM memories")
    assert stored == [{"n": 59}]


def persist_calls(app: web.Application) -> float:
    """How many times the memory stage's persist stage ran (its duration histogram's count)."""
    for metric in app[METRICS].stage_seconds.collect():
        for sample in metric.samples:
            if sample.name.endswith("_count") and sample.labels.get("stage") == "persist":
                return sample.value
    return 0.0
