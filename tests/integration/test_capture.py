"""Memories from conversations (spec.memory.capture): what a chat turn leaves in memory, for whom, and when not.

Through the real proxy, context stage and memory stage (whose capture worker drains the queue), with the ``echo``
model, which answers with the messages it was sent: so a later session's answer shows the memory context.
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

import orjson
import pytest
from aiohttp import ClientSession

from ibex_dataplane.memory.app import SERVICE
from ibex_dataplane.memory.capture import CaptureWorker, chunks
from ibex_dataplane.memory.metrics import MemoryMetrics
from ibex_dataplane.memory.repository import MemoryRepository
from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.shared.idempotency import IdempotencyLedger
from tests.support.capture import chat, extracted, headers, jobs_of, until
from tests.support.proxy import RunningProxy
from tests.support.tenants import TenantFactory

CAPTURE_TURNS = {"memory": {"capture": "turns"}}
FACT = "My sister Zorbadine moved to Tallinn last spring and teaches cello there."


async def test_a_fact_said_in_one_session_is_in_the_context_of_a_later_session_and_nowhere_else(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores
) -> None:
    t = await tenants.create(agent_spec=CAPTURE_TURNS, directive=None)
    other_org = await tenants.create(agent_spec=CAPTURE_TURNS, directive=None)
    async with ClientSession() as http:
        status, _, h = await chat(http, proxy, headers(t, "alpha", "monday"), {"role": "user", "content": FACT})
        assert status == 200
        assert h["X-IBEX-Session-ID"] == "monday"

        async def stored() -> bool:
            return len(await extracted(http, proxy, t, "alpha")) == 1

        await until(stored, "the captured turn")
        [memory] = await extracted(http, proxy, t, "alpha")
        assert memory["content"] == FACT
        assert memory["source"] == "extracted"
        assert memory["session_id"] == "monday"
        assert memory["metadata"]["capture"] == {"session_id": "monday", "turn": 1, "role": "user", "message": 0,
                                                 "part": 0}  # fmt: skip
        assert memory["observed_at"] is not None and memory["valid_from"] is None  # a remark, not a validity claim

        async def dequeued() -> bool:
            return await jobs_of(stores, t.org_id) == []

        await until(dequeued, "the processed job to leave the queue with its text")

        question = {"role": "user", "content": "Where does my sister Zorbadine live now?"}
        status, body, h = await chat(http, proxy, headers(t, "alpha", "friday"), question)
        assert status == 200
        assert int(h["X-IBEX-Memories-Injected"]) >= 1
        assert "Tallinn" in orjson.loads(body)["choices"][0]["message"]["content"]

        # Another agent of the same org and an agent of another org: nothing of it, in memory or in context.
        for tenant, agent in ((t, "beta"), (other_org, "alpha")):
            status, body, _ = await chat(http, proxy, headers(tenant, agent, "friday"), question)
            assert status == 200
            assert "Tallinn" not in body
            assert all("Tallinn" not in m["content"] for m in await extracted(http, proxy, tenant, agent))


async def test_only_the_turns_own_messages_are_captured_and_the_answer_only_when_asked(
    proxy: RunningProxy, tenants: TenantFactory
) -> None:
    t = await tenants.create(
        agent_specs={"alpha": CAPTURE_TURNS, "beta": {"memory": {"capture": "turns",
                                                                 "captureRoles": ["user", "assistant"]}}},
        directive="You are a test agent.",
    )  # fmt: skip
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "An earlier question about ferns."},
        {"role": "assistant", "content": "An earlier answer about ferns."},
        {"role": "user", "content": [{"type": "text", "text": "I keep three axolotls named Pim, Pam and Pom."},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
    ]  # fmt: skip
    async with ClientSession() as http:
        for agent in ("alpha", "beta"):
            status, _, _ = await chat(http, proxy, headers(t, agent, "pets"), *history, stream=agent == "beta")
            assert status == 200

        async def both() -> bool:
            return bool(await extracted(http, proxy, t, "alpha")) and len(await extracted(http, proxy, t, "beta")) == 2

        await until(both, "both agents' captured turns")
        [user_only] = await extracted(http, proxy, t, "alpha")
        assert user_only["content"] == "I keep three axolotls named Pim, Pam and Pom."
        with_answer = {m["metadata"]["capture"]["role"]: m["content"] for m in await extracted(http, proxy, t, "beta")}
        assert with_answer["user"] == "I keep three axolotls named Pim, Pam and Pom."
        # The answer of echo is what it was sent: the streamed answer was captured whole.
        assert "axolotls" in with_answer["assistant"] and "You are a test agent." in with_answer["assistant"]
        for m in [user_only, *await extracted(http, proxy, t, "beta")]:
            assert "ferns" not in m["content"] or m["metadata"]["capture"]["role"] == "assistant"
            assert "Be brief" not in m["content"] or m["metadata"]["capture"]["role"] == "assistant"


async def test_captured_pii_is_redacted_or_quarantined_exactly_as_a_direct_write(
    proxy: RunningProxy, tenants: TenantFactory
) -> None:
    t = await tenants.create(agents=("alpha", "beta"), agent_spec=CAPTURE_TURNS, directive=None)
    texts = ["Write to me at jules.verne@example.org about the trip.", "Call me back on 212 555 0187 tomorrow."]
    async with ClientSession() as http:
        for i, text in enumerate(texts):
            status, _, _ = await chat(http, proxy, headers(t, "alpha", f"pii-{i}"), {"role": "user", "content": text})
            assert status == 200
            async with http.post(proxy.v1 + "/memories", json={"content": text},
                                 headers=headers(t, "beta", "direct")) as r:  # fmt: skip
                assert r.status in (201, 202), await r.text()
        h = headers(t, "alpha", "listing")

        async def captured() -> bool:
            async with http.get(proxy.v1 + "/memories", params={"status": "quarantined"}, headers=h) as r:
                quarantined = (await r.json())["data"]
            return len(await extracted(http, proxy, t, "alpha")) + len(quarantined) == len(texts)

        await until(captured, "the captured turns")

        async def by_status(agent: str) -> dict[str, list[str]]:
            out: dict[str, list[str]] = {}
            for status in ("active", "quarantined"):
                async with http.get(proxy.v1 + "/memories", params={"status": status},
                                    headers=headers(t, agent, "listing")) as r:  # fmt: skip
                    out[status] = sorted(str(m["content"]) for m in (await r.json())["data"])
            return out

        via_chat, direct = await by_status("alpha"), await by_status("beta")
        assert via_chat == direct
        assert any("[EMAIL_ADDRESS]" in c for c in via_chat["active"])
        assert all("jules.verne@example.org" not in c for cs in via_chat.values() for c in cs)


async def test_capture_off_queues_nothing_and_a_failed_answer_is_not_captured(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores
) -> None:
    off = await tenants.create(directive=None)
    on = await tenants.create(agent_spec=CAPTURE_TURNS, directive=None)
    async with ClientSession() as http:
        status, _, _ = await chat(http, proxy, headers(off, "alpha", "s"), {"role": "user", "content": FACT})
        assert status == 200
        # An invalid request never reaches the model: nothing to capture.
        bad = {"role": "user", "content": FACT, "name": 12}
        status, _, _ = await chat(http, proxy, headers(on, "alpha", "s"), bad)
        assert status == 400
    assert stores.admin_pool is not None

    async def checkpointed() -> bool:  # after-answer work: the statement that would also have queued the turn
        async with stores.admin_pool.acquire() as conn:  # type: ignore[union-attr]
            n = await conn.fetchval("SELECT count(*) FROM session_checkpoints WHERE org_id = $1", off.org_id)
        return bool(n == 1)

    await until(checkpointed, "the turn's checkpoint")
    async with stores.admin_pool.acquire() as conn:
        queued = await conn.fetchval("SELECT count(*) FROM capture_jobs WHERE org_id = ANY($1::uuid[])",
                                     [off.org_id, on.org_id])  # fmt: skip
        memories = await conn.fetchval("SELECT count(*) FROM memories WHERE org_id = ANY($1::uuid[])",
                                       [off.org_id, on.org_id])  # fmt: skip
    assert (queued, memories) == (0, 0)


@pytest.mark.parametrize("value", ["yesterday", "2026-13-01T00:00:00Z", "2023-05-08T13:56:00", "2999-01-01T00:00:00Z"])
async def test_a_malformed_observed_at_header_is_a_400_in_the_envelope(
    proxy: RunningProxy, tenants: TenantFactory, value: str
) -> None:
    t = await tenants.create(agents=("alpha",), agent_spec=CAPTURE_TURNS, directive=None)
    async with ClientSession() as http:
        status, body, _ = await chat(http, proxy, headers(t, "alpha", "s", **{"X-IBEX-Observed-At": value}),
                                     {"role": "user", "content": FACT})  # fmt: skip
    assert status == 400
    error = orjson.loads(body)["error"]
    assert error["code"] == "INVALID_REQUEST" and error["request_id"]
    assert error["field_errors"][0]["field"] == "header X-IBEX-Observed-At"


async def test_observed_at_dates_a_replayed_turn(proxy: RunningProxy, tenants: TenantFactory) -> None:
    t = await tenants.create(agents=("alpha",), agent_spec=CAPTURE_TURNS, directive=None)
    h = headers(t, "alpha", "replay", **{"X-IBEX-Observed-At": "2023-05-08T13:56:00+02:00"})
    async with ClientSession() as http:
        assert (await chat(http, proxy, h, {"role": "user", "content": FACT}))[0] == 200

        async def stored() -> bool:
            return bool(await extracted(http, proxy, t, "alpha"))

        await until(stored, "the captured turn")
        [memory] = await extracted(http, proxy, t, "alpha")
    assert memory["observed_at"].startswith("2023-05-08T11:56:00")


def test_long_messages_are_captured_in_pieces_within_the_content_limit() -> None:
    text = " ".join(f"word{i}" for i in range(5000))
    pieces = chunks(text, limit=10_000)
    assert len(pieces) > 1 and all(len(p.encode()) <= 10_000 for p in pieces)
    assert " ".join(pieces) == text
    assert chunks("é" * 6000, limit=10_000) == ["é" * 5000, "é" * 1000]  # no cut through a character


class _DiesBeforeDeleting(MemoryRepository):
    """A worker's store access that dies once right after a job's memories were stored, before the job is deleted
    (the process is killed there). It leases only this test's org's jobs, so the memory stage's own worker, which
    shares the database, never races it; everything else is the real repository."""

    def __init__(self, stores: Stores, org_id: UUID) -> None:
        super().__init__(stores.db)
        self._admin = stores.admin_pool
        self._org = org_id
        self.died = False

    async def lease_capture(self, limit: int, lease: float) -> list[dict[str, Any]]:
        assert self._admin is not None
        async with self._admin.acquire() as conn:
            rows = await conn.fetch(
                "UPDATE capture_jobs SET attempts = attempts + 1 WHERE org_id = $1 AND failed_at IS NULL"
                " RETURNING id, org_id, agent_id, session_id, turn, request_id, mode, model, messages, observed_at,"
                " created_at, attempts",
                self._org,
            )
        return [dict(r) for r in rows]

    async def capture_done(self, tenant: Any, job_id: int) -> None:
        if not self.died:
            self.died = True
            raise OSError("killed")
        await super().capture_done(tenant, job_id)


async def test_a_job_redelivered_after_its_memories_were_stored_replays_instead_of_writing_twice(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores
) -> None:
    t = await tenants.create(agents=("alpha",), agent_spec=CAPTURE_TURNS, directive=None)
    assert stores.admin_pool is not None and proxy.memory is not None
    service = proxy.memory.app[SERVICE]
    repo = _DiesBeforeDeleting(stores, t.org_id)
    metrics = MemoryMetrics()
    worker = CaptureWorker(repo, service.write, IdempotencyLedger(stores.db), metrics)
    # Queued as the proxy queues a turn, but not due for the memory stage's own worker for an hour.
    async with stores.admin_pool.acquire() as conn:
        await conn.execute(
            "INSERT INTO capture_jobs (org_id, agent_id, session_id, turn, request_id, mode, messages, available_at)"
            " VALUES ($1, $2, 'crash', 1, 'req-crash', 'turns', $3::jsonb, now() + interval '1 hour')",
            t.org_id, t.agents["alpha"], orjson.dumps([{"role": "user", "content": FACT}]).decode(),
        )  # fmt: skip

    async def memories() -> int:
        async with stores.admin_pool.acquire() as conn:  # type: ignore[union-attr]
            n: int = await conn.fetchval("SELECT count(*) FROM memories WHERE org_id = $1", t.org_id)
            return n

    assert await worker.run_once() == 1  # stores the memory, then dies before deleting the job
    assert repo.died and await memories() == 1
    [job] = await jobs_of(stores, t.org_id)
    assert job["messages"] is not None  # still queued: nothing was lost
    assert await worker.run_once() == 1  # redelivered
    assert await memories() == 1  # replayed from the ledger, not written twice
    assert await jobs_of(stores, t.org_id) == []
    assert metrics.capture_jobs.labels("replayed")._value.get() == 1


async def test_a_job_that_cannot_succeed_fails_visibly_and_loses_its_text_and_expired_text_is_deleted(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores
) -> None:
    t = await tenants.create(agents=("alpha",), agent_spec={"memory": {"capture": "facts"}}, directive=None)
    assert stores.admin_pool is not None and proxy.memory is not None
    repo = _DiesBeforeDeleting(stores, t.org_id)
    repo.died = True  # an ordinary worker
    metrics = MemoryMetrics()
    worker = CaptureWorker(repo, proxy.memory.app[SERVICE].write, IdempotencyLedger(stores.db), metrics,
                           max_attempts=2)  # fmt: skip
    async with stores.admin_pool.acquire() as conn:
        for turn in (1, 2):  # facts: not served by the worker (yet)
            await conn.execute(
                "INSERT INTO capture_jobs (org_id, agent_id, session_id, turn, request_id, mode, messages,"
                " available_at, expires_at) VALUES ($1, $2, 'stale', $3, 'req', 'facts', $4::jsonb,"
                " now() + interval '1 hour', now() + interval '1 day')",
                t.org_id, t.agents["alpha"], turn, orjson.dumps([{"role": "user", "content": FACT}]).decode(),
            )  # fmt: skip
    assert await worker.run_once() == 2  # first attempt: retried
    assert metrics.capture_jobs.labels("retry")._value.get() == 2
    assert await worker.run_once() == 2  # second: failed for good
    jobs = await jobs_of(stores, t.org_id)
    assert [(j["messages"], j["failed_at"] is not None, "facts" in j["last_error"]) for j in jobs] == [
        (None, True, True), (None, True, True)
    ]  # fmt: skip
    assert metrics.capture_jobs.labels("failed")._value.get() == 2

    # Housekeeping: text still queued past its expiry goes (workers were down), failed jobs after their retention.
    async with stores.admin_pool.acquire() as conn:
        await conn.execute(
            "INSERT INTO capture_jobs (org_id, agent_id, session_id, turn, request_id, mode, messages, expires_at)"
            " VALUES ($1, $2, 'stale', 3, 'req', 'turns', '[]'::jsonb, now() - interval '1 second')",
            t.org_id, t.agents["alpha"],
        )  # fmt: skip
    removed = await MemoryRepository(stores.db).capture_housekeeping(failed_age=3600.0)
    assert removed >= 1
    assert len(await jobs_of(stores, t.org_id)) == 2  # the failed ones stay for their retention (an hour here)
    async with stores.admin_pool.acquire() as conn:
        await conn.execute("UPDATE capture_jobs SET failed_at = now() - interval '2 hours' WHERE org_id = $1", t.org_id)
    await MemoryRepository(stores.db).capture_housekeeping(failed_age=3600.0)
    assert await jobs_of(stores, t.org_id) == []


async def test_the_trace_row_says_whether_the_turn_was_queued_for_capture(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores
) -> None:
    t = await tenants.create(agent_specs={"alpha": CAPTURE_TURNS, "beta": {}}, directive=None)
    async with ClientSession() as http:
        for agent in ("alpha", "beta"):
            assert (await chat(http, proxy, headers(t, agent, "traced"), {"role": "user", "content": FACT}))[0] == 200

    async def traced() -> bool:
        rows = await stores.clickhouse.admin_query(
            "SELECT count() FROM llm_traces WHERE org_id = {org:UUID}", org=str(t.org_id)
        )
        return bool(rows and rows[0][0] == 2)

    await until(traced, "both trace rows")
    rows = await stores.clickhouse.admin_query(
        "SELECT agent_id, captured FROM llm_traces WHERE org_id = {org:UUID}", org=str(t.org_id)
    )
    assert {(str(a), int(c)) for a, c in rows} == {(str(t.agents["alpha"]), 1), (str(t.agents["beta"]), 0)}


async def test_turns_through_the_responses_and_messages_routes_are_captured_like_chat(
    proxy: RunningProxy, tenants: TenantFactory
) -> None:
    t = await tenants.create(agents=("alpha",), agent_spec=CAPTURE_TURNS, directive=None)
    said = {"responses": "My bicycle is a green Gazelle from 1987.", "messages": "My cat Orzo hates thunder."}
    async with ClientSession() as http:
        body: dict[str, Any] = {"model": "echo", "input": said["responses"], "instructions": "Be brief."}
        async with http.post(proxy.v1 + "/responses", json=body, headers=headers(t, "alpha", "r")) as r:
            assert r.status == 200, await r.text()
        body = {"model": "echo", "max_tokens": 64, "messages": [{"role": "user", "content": said["messages"]}]}
        async with http.post(proxy.v1 + "/messages", json=body, headers=headers(t, "alpha", "m")) as r:
            assert r.status == 200, await r.text()

        async def both() -> bool:
            return len(await extracted(http, proxy, t, "alpha")) == 2

        await until(both, "the captured turns of both routes")
        captured = {m["session_id"]: m["content"] for m in await extracted(http, proxy, t, "alpha")}
    assert captured == {"r": said["responses"], "m": said["messages"]}  # the instructions are not the user's words
