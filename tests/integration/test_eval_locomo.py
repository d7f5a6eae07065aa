"""`ibex eval locomo`'s measurement over the real proxy and memory stage, on a tiny synthetic conversation."""

from __future__ import annotations

from pathlib import Path

from ibex_dataplane.evaluation.dataset import load_locomo
from ibex_dataplane.evaluation.locomo import Agent, evaluate
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
