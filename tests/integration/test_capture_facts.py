"""``capture: facts``: an extraction model turns a chat turn into facts, each billed call and each fact accounted.

The chat itself is served by ``echo``; the extraction model (``extractor``) by the session's fake upstream, which
speaks the OpenAI wire format and is scripted per test to answer valid JSON, malformed JSON, slowly, or with an
error. The session stack's memory stage runs the only capture worker (tests/integration/conftest.py).
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any
from uuid import UUID

import orjson
import pytest
from aiohttp import ClientSession

from ibex_dataplane.memory.extraction import SYSTEM_PROMPT
from ibex_dataplane.runtime.stores import Stores
from tests.integration.conftest import EXTRACTION_MODEL
from tests.support.capture import chat, extracted, headers, jobs_of, until
from tests.support.proxy import RunningProxy
from tests.support.tenants import Tenant, TenantFactory
from tests.support.upstream import UPSTREAM_USAGE, Script, Upstream

FACTS = {"memory": {"capture": "facts", "extractionModel": EXTRACTION_MODEL}}
SAID = "We moved to Lisbon in March, and my daughter Ottilie starts school there in September."
EARLIER = [
    {"role": "user", "content": "Can you help me plan a family move?"},
    {"role": "assistant", "content": "Of course. Where are you moving?"},
]
OBSERVED = "2023-05-08T13:00:00+00:00"
# prices of the extraction model in the session's providers file: 3 and 15 USD per million tokens
CALL_COST = (Decimal(UPSTREAM_USAGE["prompt_tokens"]) * 3 + Decimal(UPSTREAM_USAGE["completion_tokens"]) * 15) / 10**6


def answer(*facts: tuple[str, str | None]) -> str:
    return orjson.dumps({"facts": [{"content": c, "valid_from": v} for c, v in facts]}).decode()


async def facts_turn(http: ClientSession, proxy: RunningProxy, t: Tenant, session: str, text: str = SAID) -> None:
    h = headers(t, "alpha", session, **{"X-IBEX-Observed-At": OBSERVED})
    status, body, _ = await chat(http, proxy, h, *EARLIER, {"role": "user", "content": text})
    assert status == 200, body


async def ledger(stores: Stores, org_id: UUID) -> list[dict[str, Any]]:
    assert stores.admin_pool is not None
    async with stores.admin_pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT model, prompt_tokens, completion_tokens, cost_usd FROM budget_ledger"
            " WHERE org_id = $1 AND model = $2 ORDER BY id", org_id, EXTRACTION_MODEL,
        )  # fmt: skip
    return [dict(r) for r in rows]


async def holds(stores: Stores, org_id: UUID) -> list[str]:
    assert stores.admin_pool is not None
    async with stores.admin_pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT status FROM budget_holds WHERE org_id = $1 AND request_id LIKE '%.facts-%' ORDER BY created_at",
            org_id,
        )
    return [r["status"] for r in rows]


def extraction_calls(upstream: Upstream) -> list[dict[str, Any]]:
    return [b for b in upstream.bodies if b.get("model") == EXTRACTION_MODEL]


async def test_facts_are_extracted_billed_and_reach_a_later_sessions_context(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores, extraction_upstream: Upstream
) -> None:
    t = await tenants.create(agent_spec=FACTS, directive=None)
    other = await tenants.create(agent_spec=FACTS, directive=None)
    lisbon_facts = answer(
        ("The user moved to Lisbon in March 2023.", "2023-03-01"),
        ("The user's daughter Ottilie starts school in Lisbon in September 2023.", None),
    )
    # The three later questions are facts turns too: the model finds nothing in them.
    extraction_upstream.reset(Script(answers=[lisbon_facts, answer(), answer(), answer()]))  # fmt: skip
    async with ClientSession() as http:
        await facts_turn(http, proxy, t, "move")

        async def stored() -> bool:
            return len(await extracted(http, proxy, t, "alpha")) == 2

        await until(stored, "the extracted facts")
        memories = {m["content"]: m for m in await extracted(http, proxy, t, "alpha")}
        lisbon = memories["The user moved to Lisbon in March 2023."]
        school = memories["The user's daughter Ottilie starts school in Lisbon in September 2023."]
        assert lisbon["valid_from"].startswith("2023-03-01") and school["valid_from"].startswith("2023-05-08T13:00")
        for m in (lisbon, school):
            assert m["source"] == "extracted" and m["session_id"] == "move"
            assert m["observed_at"].startswith("2023-05-08T13:00")
            capture = m["metadata"]["capture"]
            assert capture["mode"] == "facts" and capture["model"] == EXTRACTION_MODEL and capture["turn"] == 1

        # One call, of the documented shape, carrying this turn and its context, and nothing of anyone else.
        [call] = extraction_calls(extraction_upstream)
        assert call["response_format"]["type"] == "json_schema" and call["response_format"]["json_schema"]["strict"]
        system, user = call["messages"]
        assert system == {"role": "system", "content": SYSTEM_PROMPT}
        document = orjson.loads(user["content"])
        assert document == {"conversation_date": "2023-05-08", "earlier": EARLIER,
                            "latest": [{"role": "user", "content": SAID}]}  # fmt: skip

        # Billed like a chat: the hold settled to the priced usage, in the ledger and in /v1/usage.
        assert await ledger(stores, t.org_id) == [
            {"model": EXTRACTION_MODEL, "prompt_tokens": UPSTREAM_USAGE["prompt_tokens"],
             "completion_tokens": UPSTREAM_USAGE["completion_tokens"], "cost_usd": CALL_COST}
        ]  # fmt: skip
        assert await holds(stores, t.org_id) == ["settled"]
        async with http.get(proxy.v1 + "/usage", params={"group_by": "model"},
                            headers=headers(t, "alpha", "usage")) as r:  # fmt: skip
            assert r.status == 200, await r.text()
            by_model = {row["key"]: row for row in (await r.json())["data"]}
        assert by_model[EXTRACTION_MODEL]["requests"] == 1
        assert Decimal(by_model[EXTRACTION_MODEL]["cost_usd"]) == CALL_COST

        # The facts are in the context of a later session of the same agent, and nowhere else.
        question = {"role": "user", "content": "Which city did we move to?"}
        status, body, h = await chat(http, proxy, headers(t, "alpha", "later"), question)
        assert status == 200 and int(h["X-IBEX-Memories-Injected"]) >= 1
        assert "Lisbon in March 2023" in orjson.loads(body)["choices"][0]["message"]["content"]
        for tenant, agent in ((t, "beta"), (other, "alpha")):
            status, body, _ = await chat(http, proxy, headers(tenant, agent, "later"), question)
            assert status == 200 and "Lisbon" not in body
            assert await extracted(http, proxy, tenant, agent) == []

        async def drained() -> bool:
            return await jobs_of(stores, t.org_id) == [] and await jobs_of(stores, other.org_id) == []

        await until(drained, "the later questions' jobs")
    assert len(extraction_calls(extraction_upstream)) == 4


async def test_a_newer_fact_supersedes_the_older_one(
    proxy: RunningProxy, tenants: TenantFactory, extraction_upstream: Upstream
) -> None:
    t = await tenants.create(agent_spec=FACTS, directive=None)
    extraction_upstream.reset(Script(answers=[answer(("The user lives in Paris.", "2020-01-01")),
                                              answer(("The user lives in Berlin.", "2023-06-01"))]))  # fmt: skip
    async with ClientSession() as http:
        await facts_turn(http, proxy, t, "first", "I live in Paris.")

        async def count(n: int) -> bool:
            return len(await extracted(http, proxy, t, "alpha")) == n

        await until(lambda: count(1), "the first fact")
        await facts_turn(http, proxy, t, "second", "I moved to Berlin.")

        async def superseded() -> bool:
            memories = await extracted(http, proxy, t, "alpha")
            return [m["content"] for m in memories] == ["The user lives in Berlin."]

        await until(superseded, "the newer fact to supersede the older one")
        async with http.get(proxy.v1 + "/memories", params={"status": "superseded"},
                            headers=headers(t, "alpha", "listing")) as r:  # fmt: skip
            old = (await r.json())["data"]
        assert [m["content"] for m in old] == ["The user lives in Paris."]
        assert old[0]["valid_until"].startswith("2023-06-01")


async def test_a_malformed_answer_is_asked_once_more_and_both_calls_are_billed(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores, extraction_upstream: Upstream
) -> None:
    t = await tenants.create(agent_spec=FACTS, directive=None)
    extraction_upstream.reset(
        Script(
            answers=[
                "Sure! Here are the facts: Lisbon.",
                answer(("The user moved to Lisbon in March 2023.", "2023-03-01")),
            ]
        )
    )
    async with ClientSession() as http:
        await facts_turn(http, proxy, t, "move")

        async def stored() -> bool:
            return len(await extracted(http, proxy, t, "alpha")) == 1

        await until(stored, "the fact of the second answer")
    first, second = extraction_calls(extraction_upstream)
    assert second["messages"][:2] == first["messages"]
    assert second["messages"][2] == {"role": "assistant", "content": "Sure! Here are the facts: Lisbon."}
    assert "not valid: the answer is not JSON" in second["messages"][3]["content"]
    assert len(await ledger(stores, t.org_id)) == 2
    assert await holds(stores, t.org_id) == ["settled", "settled"]


@pytest.mark.parametrize(
    "answers",
    [["not json at all", '{"facts": "none"}'],
     ['{"facts": [{"content": "x"}]}', '{"facts": [], "note": "extra"}']],
    ids=["not-json-then-wrong-type", "missing-field-then-extra-field"],
)  # fmt: skip
async def test_two_malformed_answers_fail_the_job_visibly_and_store_nothing(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores, extraction_upstream: Upstream, answers: list[str]
) -> None:
    t = await tenants.create(agent_spec=FACTS, directive=None)
    extraction_upstream.reset(Script(answers=list(answers)))
    async with ClientSession() as http:
        await facts_turn(http, proxy, t, "move")

        async def failed() -> bool:
            return any(j["failed_at"] is not None for j in await jobs_of(stores, t.org_id))

        await until(failed, "the job to fail")
        [job] = await jobs_of(stores, t.org_id)
        assert job["messages"] is None and "malformed JSON twice" in job["last_error"]
        assert await extracted(http, proxy, t, "alpha") == []
    assert len(extraction_calls(extraction_upstream)) == 2
    assert len(await ledger(stores, t.org_id)) == 2  # what the model answered was served, so it is billed


@pytest.mark.parametrize(
    ("script", "error"),
    [(Script(delay=30.0), "PROVIDER_TIMEOUT"), (Script(fail_first=10**6, fail_status=500), "PROVIDER_")],
    ids=["slow", "failing"],
)
async def test_a_slow_or_failing_model_defers_the_job_bills_nothing_and_a_later_attempt_stores_the_facts(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores, extraction_upstream: Upstream,
    script: Script, error: str,
) -> None:  # fmt: skip
    t = await tenants.create(agent_spec=FACTS, directive=None)
    extraction_upstream.reset(script)
    async with ClientSession() as http:
        await facts_turn(http, proxy, t, "move")

        async def deferred() -> bool:
            return any(j["last_error"] for j in await jobs_of(stores, t.org_id))

        await until(deferred, "the job to be deferred")
        [job] = await jobs_of(stores, t.org_id)
        assert job["failed_at"] is None and job["messages"] is not None and error in job["last_error"]
        assert await ledger(stores, t.org_id) == [] and set(await holds(stores, t.org_id)) == {"released"}
        # The model is back: the retry (after a backoff of a few seconds) stores the facts.
        extraction_upstream.reset(Script(answers=[answer(("The user moved to Lisbon in March 2023.", None))]))

        async def stored() -> bool:
            return len(await extracted(http, proxy, t, "alpha")) == 1

        await until(stored, "the retried job's fact")

        async def dequeued() -> bool:  # the job goes right after its memories are stored
            return await jobs_of(stores, t.org_id) == []

        await until(dequeued, "the processed job to leave the queue")
    assert len(await ledger(stores, t.org_id)) == 1


async def test_a_denied_model_or_an_exhausted_budget_fails_the_job_without_calling_the_model(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores, extraction_upstream: Upstream
) -> None:
    denied = await tenants.create(
        org_spec={"models": {"default": "echo", "deny": [EXTRACTION_MODEL]}}, agent_spec=FACTS, directive=None
    )
    # An echo chat's worst case (4096 output tokens at 2 USD per million) fits; an extraction's (1024 at 15) not.
    poor = await tenants.create(
        org_spec={"models": {"default": "echo"}, "budget": {"monthlyLimitUSD": "0.012", "enforcement": "HardCap"}},
        agent_spec=FACTS, directive=None,
    )  # fmt: skip
    extraction_upstream.reset(Script(answers=[answer(("The user moved to Lisbon.", None))] * 2))
    async with ClientSession() as http:
        for t in (denied, poor):
            await facts_turn(http, proxy, t, "move")
        for t, error in ((denied, "MODEL_NOT_ALLOWED"), (poor, "BUDGET_EXCEEDED")):

            async def failed(t: Tenant = t) -> bool:
                return any(j["failed_at"] is not None for j in await jobs_of(stores, t.org_id))

            await until(failed, f"the job to fail with {error}")
            [job] = await jobs_of(stores, t.org_id)
            assert error in job["last_error"] and job["messages"] is None
            assert await extracted(http, proxy, t, "alpha") == []
    assert extraction_calls(extraction_upstream) == []
