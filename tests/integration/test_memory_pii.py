"""PII never reaches the embedding, the logs or a search result: planted values are checked in every output."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from ibex_dataplane.runtime.stores import Stores
from tests.support.memory import memory_client
from tests.support.proxy import MemoryDeps, RunningProxy
from tests.support.tenants import TenantFactory

# Valid values (Luhn-valid cards, mod-97-valid IBAN, a non-sample SSN) in sentences that give each its context.
EMAIL = "jane.doe@example.co.uk"
PHONE = "+44 20 7946 0958"
CARD = "4539 1488 0343 6467"
IBAN = "DE89 3704 0044 0532 0130 00"
SSN = "457-55-5462"
PLANTED = [EMAIL, PHONE, CARD, IBAN, SSN, CARD.replace(" ", ""), IBAN.replace(" ", ""), "7946 0958"]
CONTENT = (
    f"Vendor contact {EMAIL}, the London office phone is {PHONE}. Pay the renewal with the Visa card {CARD} "
    f"or to IBAN {IBAN}; her SSN is {SSN}."
)
REDACTED = (
    "Vendor contact [EMAIL_ADDRESS], the London office phone is [PHONE_NUMBER]. Pay the renewal with the Visa card "
    "[CREDIT_CARD] or to IBAN [IBAN_CODE]; her SSN is [US_SSN]."
)


def assert_clean(text: str, where: str) -> None:
    for value in PLANTED:
        assert value not in text, f"{value!r} leaked into {where}"


async def test_planted_pii_is_masked_in_every_output_and_in_the_embedding(
    proxy: RunningProxy,
    tenants: TenantFactory,
    stores: Stores,
    memory_deps: MemoryDeps,
    caplog: pytest.LogCaptureFixture,
) -> None:
    t = await tenants.create()
    caplog.set_level(logging.DEBUG)
    outputs: list[tuple[str, str]] = []
    async with memory_client(proxy, t) as client:
        created = await client.write(
            {
                "content": CONTENT,
                "labels": [f"billing {EMAIL}", "vendor"],
                "metadata": {"card": CARD, EMAIL: [f"SSN {SSN}"]},
            }
        )
        assert created.status == 201, created.body
        memory = created.body["memory"]
        assert memory["content"] == REDACTED
        assert memory["labels"] == ["billing [EMAIL_ADDRESS]", "vendor"]
        assert memory["metadata"] == {"card": "[CREDIT_CARD]", "[EMAIL_ADDRESS]": ["SSN [US_SSN]"]}
        mid = memory["id"]
        replies = [
            created,
            await client.write({"content": CONTENT}),  # exact duplicate after masking
            await client.batch([{"content": CONTENT}, {"content": f"Second note: write to {EMAIL}."}]),
            await client.get(mid),
            await client.list(),
            await client.search(f"card {CARD} of {EMAIL}"),
            await client.search("vendor contact renewal"),
            await client.feedback(mid, True),
            # A bare SSN without context is plausible but not confident: quarantined, and not echoed.
            await client.write({"content": f"Reference {SSN} for the file.", "metadata": {"raw": SSN}}),
        ]
        assert replies[-1].status == 202
        assert replies[1].status == 200 and replies[1].body["memory"]["id"] == mid
        assert replies[5].body["results"] and replies[6].body["results"]
        outputs += [(f"reply {i}", r.raw.decode()) for i, r in enumerate(replies)]
        outputs += [(f"headers {i}", str(r.headers)) for i, r in enumerate(replies)]
    assert proxy.memory is not None
    from ibex_dataplane.memory.app import METRICS

    outputs.append(("memory metrics", proxy.memory.app[METRICS].render().decode()))
    outputs += [(f"log {r.name}", r.getMessage()) for r in caplog.records]
    for where, text in outputs:
        assert_clean(text, where)

    async with stores.db.tenant(t.org_id, t.agents["alpha"]) as conn:
        rows = await conn.fetch(
            "SELECT content, metadata::text AS metadata, embedding FROM memories WHERE status = 'active'"
        )
        # The quarantined record keeps its low-confidence finding for human review, but never gets an embedding.
        assert (
            await conn.fetchval("SELECT count(*) FROM memories WHERE status = 'quarantined' AND embedding IS NULL") == 1
        )
        labels = await conn.fetch("SELECT label FROM memory_labels")
    for row in rows:
        assert_clean(str(row["content"]) + row["metadata"], "the memories table")
    assert_clean(" ".join(r["label"] for r in labels), "the labels table")
    stored = next(r["embedding"] for r in rows if r["content"] == REDACTED)
    vector = np.asarray(stored.to_numpy() if hasattr(stored, "to_numpy") else stored)
    masked, raw = await memory_deps.embedder.embed([REDACTED, CONTENT])
    # The stored vector is the embedding of the masked text, not of the original.
    assert float(vector @ masked) > 0.999
    assert float(vector @ raw) < 0.99


async def test_quarantined_memories_are_listed_for_review_only_when_asked_and_never_searched(
    proxy: RunningProxy, tenants: TenantFactory
) -> None:
    t = await tenants.create()
    async with memory_client(proxy, t) as client:
        held = await client.write({"content": f"Reference {SSN} for the file."})
        assert held.status == 202
        held_id = held.body["memory"]["id"]
        await client.write({"content": "An ordinary note about the file."})
        review = await client.list("status=quarantined")
        default = await client.list()
        found = await client.search(f"reference {SSN} file")
    assert review.status == 200
    assert [(m["id"], m["status"], m["content"]) for m in review.body["data"]] == [(held_id, "quarantined", None)]
    assert held_id not in {m["id"] for m in default.body["data"]}
    assert held_id not in {h["memory"]["id"] for h in found.body["results"]}
    assert SSN not in review.raw.decode()
