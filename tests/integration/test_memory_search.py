"""Search, list and feedback over HTTP: hybrid retrieval, composite score, fences, filters, pagination."""

from __future__ import annotations

import asyncio
import itertools
import math
from datetime import UTC, datetime, timedelta
from typing import Any

from ibex_dataplane.runtime.stores import Stores
from tests.support.memory import memory_client
from tests.support.proxy import RunningProxy
from tests.support.tenants import TenantFactory

WEIGHTS = {"relevance": 0.40, "recency": 0.25, "usefulness": 0.20, "confidence": 0.10, "frequency": 0.05}


async def test_hybrid_search_returns_scored_hits_with_all_components(
    proxy: RunningProxy, tenants: TenantFactory
) -> None:
    t = await tenants.create()
    async with memory_client(proxy, t) as client:
        seats = await client.write({"content": "The user prefers window seats on long flights."})
        await client.write({"content": "Quarterly revenue grew eight percent."})
        await client.write({"content": "The garden needs watering every second day."})
        reply = await client.search("the user prefers window seats on long flights")
        assert reply.status == 200
        results = reply.body["results"]
        assert results[0]["memory"]["id"] == seats.body["memory"]["id"]
        assert results[0]["matched_by"] == "both"
        for hit in results:
            components = hit["components"]
            assert set(components) == set(WEIGHTS)
            assert math.isclose(hit["score"], sum(WEIGHTS[k] * v for k, v in components.items()), abs_tol=1e-5)
        assert all(a["score"] >= b["score"] for a, b in itertools.pairwise(results))
        paraphrase = await client.search("Which seat does the traveller like on a long-haul plane?")
        assert paraphrase.body["results"][0]["memory"]["id"] == seats.body["memory"]["id"]
        assert "revenue" not in str(results)  # below the relevance floor: no shared words, unrelated meaning
        text_only = await client.search("watering")
        assert [h["memory"]["content"] for h in text_only.body["results"]] == [
            "The garden needs watering every second day."
        ]
        assert text_only.body["results"][0]["matched_by"] in ("text", "both")
        # Retrieval bookkeeping is written just after the answer (batched); later reads see it.
        for _ in range(60):
            await asyncio.sleep(0.05)
            again = await client.search("watering")
            if again.body["results"][0]["components"]["frequency"] > 0:
                break
        assert again.body["results"][0]["memory"]["retrieval_count"] >= 1


async def test_search_filters_limit_and_validation(proxy: RunningProxy, tenants: TenantFactory) -> None:
    t = await tenants.create()
    async with memory_client(proxy, t) as client:
        items = [
            {"content": f"Project falcon status note {i}: the build is green.", "confidence": c, "labels": labels}
            for i, (c, labels) in enumerate([(0.9, ["falcon", "ci"]), (0.4, ["falcon"]), (0.95, ["ci"])])
        ]
        reply = await client.batch(items)
        assert [r["status"] for r in reply.body["results"]] == [201, 201, 201]
        everything = await client.search("project falcon status build green")
        assert len(everything.body["results"]) == 3
        assert len((await client.search("project falcon status build green", limit=2)).body["results"]) == 2
        confident = await client.search("project falcon status build green", min_confidence=0.8)
        assert {h["memory"]["confidence"] for h in confident.body["results"]} == {0.9, 0.95}
        labelled = await client.search("project falcon status build green", labels=["falcon", "ci"])
        assert [h["memory"]["labels"] for h in labelled.body["results"]] == [["ci", "falcon"]]
        for bad in ({"query": ""}, {"query": "x", "limit": 51}, {"query": "x", "labels": []},
                    {"query": "x", "as_of": "2020-01-01T00:00:00Z"}, {"query": "x", "min_confidence": 2}):  # fmt: skip
            failed = await client.call("POST", "/v1/memories/search", bad)
            assert failed.status == 400 and failed.error_code() == "VALIDATION_ERROR", bad


async def test_reads_are_validity_fenced(proxy: RunningProxy, tenants: TenantFactory) -> None:
    t = await tenants.create()
    now = datetime.now(UTC)
    async with memory_client(proxy, t) as client:
        expired = await client.write({"content": "The old wifi password rotates monthly.",
                                      "valid_from": (now - timedelta(days=60)).isoformat(),
                                      "valid_until": (now - timedelta(days=1)).isoformat()})  # fmt: skip
        future = await client.write({"content": "The new office opens downtown next year.",
                                     "valid_from": (now + timedelta(days=300)).isoformat()})  # fmt: skip
        current = await client.write({"content": "The wifi password is printed at reception."})
        for reply in (expired, future):
            assert reply.status == 201
            assert (await client.get(reply.body["memory"]["id"])).status == 404
        listed = [m["id"] for m in (await client.list()).body["data"]]
        assert listed == [current.body["memory"]["id"]]
        found = await client.search("wifi password")
        assert [h["memory"]["id"] for h in found.body["results"]] == [current.body["memory"]["id"]]
        found = await client.search("The new office opens downtown next year.")
        assert found.body["results"] == []


async def test_list_paginates_with_a_cursor(proxy: RunningProxy, tenants: TenantFactory) -> None:
    t = await tenants.create()
    async with memory_client(proxy, t) as client:
        reply = await client.batch([{"content": f"Paginated memory {i} about {chr(97 + i) * 3}."} for i in range(7)])
        created = {r["memory"]["id"] for r in reply.body["results"]}
        seen: list[str] = []
        cursor = None
        for _ in range(10):
            page = await client.list("limit=3" + (f"&cursor={cursor}" if cursor else ""))
            assert page.status == 200
            seen += [m["id"] for m in page.body["data"]]
            cursor = page.body["next_cursor"]
            if cursor is None:
                break
        assert len(seen) == 7 and set(seen) == created
        for bad in ("status=forgotten", "limit=0", "limit=1000", "cursor=%%%", "org_id=x"):
            failed = await client.list(bad)
            assert failed.status == 400 and failed.error_code() == "VALIDATION_ERROR", bad


async def test_feedback_updates_usefulness_laplace_smoothed(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores
) -> None:
    t = await tenants.create()
    async with memory_client(proxy, t) as client:
        mid = (await client.write({"content": "Feedback target memory."})).body["memory"]["id"]
        up = await client.feedback(mid, True)
        assert up.status == 200
        assert math.isclose(up.body["memory"]["usefulness"], 2 / 3, abs_tol=1e-5)
        assert up.body["memory"]["revision"] == 2
        down = await client.call("POST", f"/v1/memories/{mid}/feedback", {"signal": "negative"})
        assert math.isclose(down.body["memory"]["usefulness"], 2 / 4, abs_tol=1e-5)
        down = await client.feedback(mid, False)
        assert math.isclose(down.body["memory"]["usefulness"], 2 / 5, abs_tol=1e-5)
        bad = await client.call("POST", f"/v1/memories/{mid}/feedback", {"useful": "yes"})
        assert bad.status == 400
    async with stores.db.tenant(t.org_id, t.agents["alpha"]) as conn:
        row = await conn.fetchrow("SELECT positive_feedback, negative_feedback FROM memories")
    assert (row["positive_feedback"], row["negative_feedback"]) == (1, 2)


async def test_bm25_postings_follow_a_memory_from_write_to_forget(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores
) -> None:
    t = await tenants.create()
    agent = t.agents["alpha"]
    postings = "SELECT lexeme, tf, doc_len FROM memory_terms WHERE memory_id = $1::uuid ORDER BY lexeme"
    async with memory_client(proxy, t) as client:
        mid = (await client.write({"content": "Marmalade on toast, marmalade in tea."})).body["memory"]["id"]
        async with stores.db.tenant(t.org_id, agent) as conn:
            written = [tuple(r) for r in await conn.fetch(postings, mid)]
        assert written == [("marmalad", 2.0, 3.0), ("tea", 1.0, 3.0), ("toast", 1.0, 3.0)]
        found = (await client.search("marmalade")).body["results"]
        assert [h["memory"]["id"] for h in found] == [mid]
        assert found[0]["matched_by"] in ("text", "both")
        await client.feedback(mid, True)  # bookkeeping updates leave the postings as they are
        async with stores.db.tenant(t.org_id, agent) as conn:
            assert [tuple(r) for r in await conn.fetch(postings, mid)] == written
        assert (await client.forget(mid)).status == 204
        async with stores.db.tenant(t.org_id, agent) as conn:
            assert await conn.fetch(postings, mid) == []
        assert (await client.search("marmalade")).body["results"] == []


async def test_postings_of_one_agent_are_invisible_to_another(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores
) -> None:
    t = await tenants.create()
    async with memory_client(proxy, t) as client:
        await client.write({"content": "The quince jelly recipe is secret."})
    other = await tenants.create()
    async with stores.db.tenant(other.org_id, other.agents["alpha"]) as conn:
        assert await conn.fetchval("SELECT count(*) FROM memory_terms WHERE lexeme = 'quinc'") == 0
    async with stores.db.tenant(t.org_id, t.agents["alpha"]) as conn:
        assert await conn.fetchval("SELECT count(*) FROM memory_terms WHERE lexeme = 'quinc'") == 1


async def test_a_repeated_query_reuses_its_encodings_within_its_organization_only(
    proxy: RunningProxy, tenants: TenantFactory
) -> None:
    from ibex_dataplane.memory.app import METRICS

    assert proxy.memory is not None
    registry = proxy.memory.app[METRICS].registry

    def lookups(result: str) -> float:
        return registry.get_sample_value("ibex_memory_query_cache_lookups_total", {"result": result}) or 0.0

    query = "which colour did the committee pick for the new bicycle shed"
    t, other = await tenants.create(), await tenants.create()
    async with memory_client(proxy, t) as client, memory_client(proxy, other) as stranger:
        mine = await client.write({"content": "The committee picked green for the new bicycle shed."})
        theirs = await stranger.write({"content": "The committee picked a red roof for the bicycle shed."})
        hits, misses = lookups("hit"), lookups("miss")
        first = await client.search(query)
        assert (lookups("hit"), lookups("miss")) == (hits, misses + 1)
        second = await client.search(query)
        assert (lookups("hit"), lookups("miss")) == (hits + 1, misses + 1)

        # The cached encodings find and judge exactly as the models' own did (recency and retrieval counts move on).
        def judged(reply: Any) -> list[tuple[str, float]]:
            return [(h["memory"]["id"], h["components"]["relevance"]) for h in reply.body["results"]]

        assert judged(second) == judged(first)
        assert first.body["results"][0]["memory"]["id"] == mine.body["memory"]["id"]
        # The same text from another organization is encoded afresh and finds only that organization's memory.
        foreign = await stranger.search(query)
        assert (lookups("hit"), lookups("miss")) == (hits + 1, misses + 2)
        assert [h["memory"]["id"] for h in foreign.body["results"]] == [theirs.body["memory"]["id"]]
