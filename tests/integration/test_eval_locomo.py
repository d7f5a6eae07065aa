"""`ibex eval locomo`'s measurement over the real proxy and memory stage, on a tiny synthetic conversation."""

from __future__ import annotations

from pathlib import Path

from ibex_dataplane.cli import CAPTURE_DRAINED_SQL
from ibex_dataplane.evaluation.dataset import load_locomo
from ibex_dataplane.evaluation.locomo import Agent, evaluate
from ibex_dataplane.runtime.stores import Stores
from tests.support.proxy import RunningProxy
from tests.support.tenants import TenantFactory

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "locomo_tiny.json"


async def test_the_evaluation_writes_every_turn_and_scores_findable_evidence_as_found(
    proxy: RunningProxy, tenants: TenantFactory
) -> None:
    provisioned: list[str] = []

    async def provision(name: str) -> Agent:
        tenant = await tenants.create(agents=("alpha",), directive=None)
        provisioned.append(name)
        return Agent(str(tenant.agents["alpha"]), tenant.keys["alpha"])

    report = await evaluate(load_locomo(FIXTURE), proxy.base_url, provision, ks=(1, 5, 20))
    summary = report.to_json()
    assert provisioned == ["tiny-1"]
    assert set(summary) == {
        "questions", "turns", "recall", "by_category", "ingest_s", "search_p50_ms", "search_p95_ms",
    }  # fmt: skip
    assert summary["turns"] == 6 and report.ingest.created == 6 and report.ingest.quarantined == 0
    assert summary["questions"] == 3 and report.skipped == 1  # category 5 left out; one question has no evidence
    assert set(summary["by_category"]) == {"1", "2", "4"}
    # "What is the name of Ava's greyhound?": the only turn naming a greyhound.
    assert summary["by_category"]["4"]["1"] == 1.0
    assert summary["by_category"]["1"]["20"] == 1.0  # both evidence turns among six
    assert summary["search_p95_ms"] >= summary["search_p50_ms"] > 0


async def test_the_evaluation_can_replay_conversations_as_chats_that_capture_their_turns(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores
) -> None:
    """`--capture turns`: the same conversation replayed through chat completions and captured by the memory
    stage's worker is found exactly as well as when written through the memory route."""

    async def provision(name: str) -> Agent:
        tenant = await tenants.create(agents=("alpha",), agent_spec={"memory": {"capture": "turns"}}, directive=None)

        async def drained(turns: int) -> bool:
            assert stores.admin_pool is not None
            async with stores.admin_pool.acquire() as conn:
                done: bool = await conn.fetchval(CAPTURE_DRAINED_SQL, tenant.org_id, turns)
                return done

        return Agent(str(tenant.agents["alpha"]), tenant.keys["alpha"], drained)

    direct = await evaluate(load_locomo(FIXTURE), proxy.base_url, provision, ks=(1, 5, 20))
    replayed = await evaluate(load_locomo(FIXTURE), proxy.base_url, provision, ks=(1, 5, 20), capture=True)
    assert replayed.ingest.turns == 6 and replayed.ingest.created == 6 and replayed.ingest.quarantined == 0
    # The same evidence is found; the order of the first hits may differ by the access-frequency component, which
    # each search's retrieval bookkeeping updates after its answer.
    for k in ("5", "20"):
        assert replayed.to_json()["recall"][k] == direct.to_json()["recall"][k] == 1.0
