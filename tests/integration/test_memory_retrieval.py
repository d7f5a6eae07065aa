"""Retrieval quality of POST /v1/memories/search on small fixed conversations: OR text, neighbours, junk."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from tests.support.memory import MemoryClient, memory_client
from tests.support.proxy import RunningProxy
from tests.support.tenants import TenantFactory

SESSION_START = datetime(2022, 4, 12, 18, 0, tzinfo=UTC)
TURNS = [
    ("s1", "Ines: I just got back from a week of kayaking along the fjords near Bergen."),
    ("s1", "Omar: Wow, how were the fjords? Did the weather hold up?"),
    ("s1", "Ines: Mostly sunny, and we camped on a tiny island every night."),
    ("s1", "Omar: Did you bring your own kayak or rent one?"),
    ("s1", "Ines: We rented two sea kayaks from a shop in the harbour."),
    ("s2", "Omar: My sourdough starter finally doubled overnight, so I baked three loaves."),
    ("s2", "Ines: Three loaves! Which flour did you use?"),
    ("s2", "Omar: A rye and spelt mix from the farmers market."),
    ("s2", "Ines: I should try baking again, my last loaf was a brick."),
    ("s2", "Omar: Lower hydration helps at first, try seventy percent."),
]


def turn_body(i: int, session: str, content: str) -> dict[str, Any]:
    start = SESSION_START + timedelta(days=0 if session == "s1" else 30)
    at = start + timedelta(minutes=i)
    return {"content": content, "session_id": session, "valid_from": start.isoformat(), "observed_at": at.isoformat()}


async def conversation(client: MemoryClient) -> list[str]:
    reply = await client.batch([turn_body(i, s, c) for i, (s, c) in enumerate(TURNS)])
    assert [r["status"] for r in reply.body["results"]] == [201] * len(TURNS)
    return [r["memory"]["id"] for r in reply.body["results"]]


async def test_or_semantics_finds_a_memory_sharing_one_word(proxy: RunningProxy, tenants: TenantFactory) -> None:
    t = await tenants.create()
    async with memory_client(proxy, t) as client:
        ids = await conversation(client)
        # Most words of the question appear in no memory; the rare one that does ("spelt") is enough.
        reply = await client.search("Which grains went into the bread, was it spelt?")
        assert reply.status == 200
        assert reply.body["results"][0]["memory"]["id"] == ids[7]
        assert reply.body["results"][0]["matched_by"] in ("text", "both")


async def test_the_answer_turn_after_a_matching_question_is_returned(
    proxy: RunningProxy, tenants: TenantFactory
) -> None:
    t = await tenants.create()
    async with memory_client(proxy, t) as client:
        ids = await conversation(client)
        # The question's words sit in Omar's question; the answer is the next turn, which shares none of them.
        reply = await client.search("Did Ines bring her own kayak or rent one?", limit=3)
        top = [h["memory"]["id"] for h in reply.body["results"]]
        assert ids[3] in top and ids[4] in top


async def test_junk_queries_return_little_or_nothing(proxy: RunningProxy, tenants: TenantFactory) -> None:
    t = await tenants.create()
    async with memory_client(proxy, t) as client:
        await conversation(client)
        for junk in (
            "qzxv plumbrick vantor eeblewop",
            "xk7 94jd lmqp zzv",
            "quarterly tax filing deadline for corporate income statements",
            "How do neutron stars form after a supernova?",
            "When did Beatrice adopt her second greyhound?",  # a name no memory holds lifts nothing
        ):
            reply = await client.search(junk, limit=10)
            assert reply.status == 200
            assert len(reply.body["results"]) <= 1, (junk, [h["memory"]["content"] for h in reply.body["results"]])
