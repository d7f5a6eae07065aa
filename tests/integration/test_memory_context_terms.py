"""Conversation context in the text leg: a turn is also found by the words of the turn before it in its session.

The link is made when the writing transaction commits, whatever order a batch inserts its items in; forgetting the
earlier turn takes its words out of the later turn's postings; other sessions and other agents lend nothing; the
migration links the memories written before it.
"""

from __future__ import annotations

import shutil
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg

from ibex_dataplane.runtime.embedded import RuntimeInfo
from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.store.migrations import default_migrations_dir, migrate_postgres
from tests.integration.test_migrations import fresh_database
from tests.support.memory import memory_client
from tests.support.proxy import RunningProxy
from tests.support.tenants import TenantFactory

START = datetime(2023, 5, 21, 13, 56, tzinfo=UTC)
LEXEMES = "SELECT lexeme FROM memory_terms WHERE memory_id = $1::uuid ORDER BY lexeme"


def turn(content: str, minute: int, session: str = "s1") -> dict[str, Any]:
    at = START + timedelta(minutes=minute)
    return {"content": content, "session_id": session, "observed_at": at.isoformat(), "valid_from": at.isoformat()}


async def test_a_reply_is_found_by_the_words_of_the_question_it_answers(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores
) -> None:
    t = await tenants.create()
    agent = t.agents["alpha"]
    async with memory_client(proxy, t) as client:
        # One batch: the persist stage inserts by content hash, so the reply may be inserted before the question.
        written = await client.batch(
            [
                turn("Tim: Which basketball team did you sign with?", 0),
                turn("John: The Minnesota Wolves! I can't wait to play with them!", 1),
                turn("Tim: Woohoo, congratulations!", 2),
            ]
        )
        assert written.status == 200
        question, reply, cheer = (r["memory"]["id"] for r in written.body["results"])
        async with stores.db.tenant(t.org_id, agent) as conn:
            reply_terms = [r["lexeme"] for r in await conn.fetch(LEXEMES, reply)]
            cheer_terms = [r["lexeme"] for r in await conn.fetch(LEXEMES, cheer)]
            links = dict(
                tuple(r) for r in await conn.fetch("SELECT memory_id::text, context_id::text FROM memory_context")
            )
        assert {"basketbal", "team", "sign", "minnesota", "wolv"} <= set(reply_terms)
        assert {"minnesota", "wolv", "congratul"} <= set(cheer_terms) and "team" not in cheer_terms
        assert links == {reply: question, cheer: reply}

        found = await client.search("Which basketball team did John sign with?")
        ids = [h["memory"]["id"] for h in found.body["results"]]
        assert reply in ids and question in ids

        assert (await client.forget(question)).status == 204
        async with stores.db.tenant(t.org_id, agent) as conn:
            reply_terms = [r["lexeme"] for r in await conn.fetch(LEXEMES, reply)]
            assert await conn.fetchval("SELECT count(*) FROM memory_context WHERE context_id = $1::uuid", question) == 0
        assert {"minnesota", "wolv"} <= set(reply_terms) and not {"basketbal", "team", "sign"} & set(reply_terms)
        after = await client.search("basketball team")
        assert after.body["results"] == []


async def test_context_stays_within_a_session_and_an_agent_and_is_the_latest_earlier_turn(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores
) -> None:
    t = await tenants.create(agents=("alpha", "beta"))
    async with memory_client(proxy, t, agent="alpha") as alpha, memory_client(proxy, t, agent="beta") as beta:
        replies = {
            "other_agent": await beta.write(turn("Tim: What is your favourite marmalade?", 0)),
            "other_session": await alpha.write(turn("Tim: What is your favourite quince jelly?", 0, session="s0")),
            "first": await alpha.write(turn("Tim: Did you ever try kumquat preserves?", 0)),
            # Separate requests, written out of order: the later request's turn sits between the two.
            "last": await alpha.write(turn("John: Only once, at my aunt's.", 5)),
            "middle": await alpha.write(turn("John: Kumquats? Never heard of them.", 2)),
            "no_session": await alpha.write({"content": "John: Oranges are fine."}),
        }
        for reply in replies.values():
            assert reply.status == 201, reply.body
        ids = {name: reply.body["memory"]["id"] for name, reply in replies.items()}
    async with stores.db.tenant(t.org_id, t.agents["alpha"]) as conn:
        links = dict(tuple(r) for r in await conn.fetch("SELECT memory_id::text, context_id::text FROM memory_context"))
        last_terms = {r["lexeme"] for r in await conn.fetch(LEXEMES, ids["last"])}
    # "last" was written before "middle" existed, so it took "first"; "middle" then took "first" too.
    assert links == {ids["last"]: ids["first"], ids["middle"]: ids["first"]}
    assert "kumquat" in last_terms and not {"marmalad", "quinc", "jelli"} & last_terms


async def test_memories_written_before_the_migration_are_linked_when_it_applies(
    runtime_info: RuntimeInfo, tmp_path: Path
) -> None:
    dsn = await fresh_database(runtime_info)
    earlier = tmp_path / "postgres"
    earlier.mkdir()
    for migration in sorted((default_migrations_dir() / "postgres").glob("*.sql")):
        if migration.name < "0021":
            shutil.copy(migration, earlier)
    await migrate_postgres(dsn, earlier)
    org, agent = uuid.uuid4(), uuid.uuid4()
    rows = [("Tim: Which basketball team did you sign with?", 0), ("John: The Minnesota Wolves!", 1)]
    ids = [uuid.uuid4() for _ in rows]
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("INSERT INTO organizations (id, namespace, name) VALUES ($1, 'ns', 'o')", org)
        await conn.execute("INSERT INTO agents (id, org_id, namespace, name) VALUES ($1, $2, 'ns', 'a')", agent, org)
        for memory_id, (content, minute) in zip(ids, rows, strict=True):
            await conn.execute(
                "INSERT INTO memories (id, org_id, agent_id, content, content_hash, status, source, session_id,"
                " observed_at) VALUES ($1, $2, $3, $4, $5, 'active', 'imported', 's1', $6)",
                memory_id, org, agent, content, uuid.uuid4().bytes, START + timedelta(minutes=minute),
            )  # fmt: skip
        await migrate_postgres(dsn, default_migrations_dir() / "postgres")
        links = {tuple(r) for r in await conn.fetch("SELECT memory_id, context_id FROM memory_context")}
        reply_terms = {r["lexeme"] for r in await conn.fetch(LEXEMES, str(ids[1]))}
    finally:
        await conn.close()
    assert links == {(ids[1], ids[0])}
    assert {"basketbal", "team", "sign", "minnesota", "wolv"} <= reply_terms
