"""The memory routes over HTTP through the proxy: wire shapes and status codes of architecture section 9.5."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from tests.support.memory import memory_client
from tests.support.proxy import RunningProxy
from tests.support.tenants import TenantFactory

MEMORY_FIELDS = {
    "id", "agent_id", "content", "status", "labels", "source", "confidence", "usefulness", "valid_from",
    "valid_until", "observed_at", "session_id", "metadata", "revision", "retrieval_count", "created_at", "updated_at",
}  # fmt: skip


async def test_a_new_memory_is_201_with_the_memory_object(proxy: RunningProxy, tenants: TenantFactory) -> None:
    t = await tenants.create()
    async with memory_client(proxy, t) as client:
        reply = await client.write(
            {"content": "The user prefers window seats on long flights.", "labels": ["travel", "prefs"],
             "source": "user_provided", "confidence": 0.9, "session_id": "s-1", "metadata": {"k": "v"}}
        )  # fmt: skip
        assert reply.status == 201, reply.body
        memory = reply.body["memory"]
        assert set(memory) == MEMORY_FIELDS
        assert memory["content"] == "The user prefers window seats on long flights."
        assert memory["status"] == "active"
        assert memory["labels"] == ["prefs", "travel"]
        assert memory["agent_id"] == str(t.agents["alpha"])
        assert memory["confidence"] == 0.9
        assert memory["usefulness"] == 0.5
        assert memory["revision"] == 1
        assert memory["created_at"].endswith("Z")
        assert reply.body["relationships"] == []
        assert reply.headers["X-Request-ID"]

        got = await client.get(memory["id"])
        assert got.status == 200
        assert got.body["memory"]["id"] == memory["id"]


async def test_exact_duplicates_answer_200_with_the_existing_memory(
    proxy: RunningProxy, tenants: TenantFactory
) -> None:
    t = await tenants.create()
    async with memory_client(proxy, t) as client:
        first = await client.write({"content": "Deploys happen on Tuesdays."})
        again = await client.write({"content": "  deploys   HAPPEN on tuesdays. "})
        assert first.status == 201
        assert again.status == 200, again.body
        assert again.body["deduplicated"] == "exact"
        assert again.body["memory"]["id"] == first.body["memory"]["id"]
        assert again.body["memory"]["retrieval_count"] == 1


async def test_validation_errors_are_400_with_field_errors(proxy: RunningProxy, tenants: TenantFactory) -> None:
    t = await tenants.create()
    now = datetime.now(UTC)
    async with memory_client(proxy, t) as client:
        cases = [
            ({"content": ""}, "content"),
            ({"content": "x" * 10_001}, "content"),
            ({}, "content"),
            ({"content": "ok", "labels": []}, "labels"),
            ({"content": "ok", "labels": ["a", "a"]}, "labels[1]"),
            ({"content": "ok", "labels": ["a", "b", "c", "d", "e", "f"]}, "labels"),
            ({"content": "ok", "source": "telepathy"}, "source"),
            ({"content": "ok", "confidence": 1.5}, "confidence"),
            ({"content": "ok", "valid_from": now.isoformat(), "valid_until": (now - timedelta(1)).isoformat()},
             "valid_until"),
            ({"content": "ok", "valid_from": "yesterday"}, "valid_from"),
            ({"content": "ok", "org_id": "someone-else"}, "org_id"),
        ]  # fmt: skip
        for body, field in cases:
            reply = await client.write(body)
            assert reply.status == 400, (body, reply.body)
            assert reply.error_code() == "VALIDATION_ERROR"
            assert field in [e["field"] for e in reply.body["error"]["field_errors"]], (body, reply.body)
        bad_json = await client.call("POST", "/v1/memories", headers={"Content-Type": "application/json"})
        assert bad_json.status == 400
        listed = await client.list()
        assert listed.body["data"] == []


async def test_forget_is_204_then_404(proxy: RunningProxy, tenants: TenantFactory) -> None:
    t = await tenants.create()
    async with memory_client(proxy, t) as client:
        created = await client.write({"content": "The staging cluster is rebuilt nightly."})
        mid = created.body["memory"]["id"]
        gone = await client.forget(mid)
        assert gone.status == 204 and gone.raw == b""
        assert (await client.forget(mid)).status == 404
        assert (await client.get(mid)).status == 404
        assert (await client.forget("not-a-uuid")).error_code() == "NOT_FOUND"
