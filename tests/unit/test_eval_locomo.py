"""The pieces of `ibex eval locomo`: reading LoCoMo-format files, the write body of a turn, recall@k, the client."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from ibex_dataplane.evaluation.dataset import DatasetError, Question, load_locomo, parse_locomo, parse_session_time
from ibex_dataplane.evaluation.locomo import (
    Agent,
    EvaluationError,
    IngestStats,
    Scored,
    _Client,
    percentile,
    recall_at,
    summarize,
)

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "locomo_tiny.json"


def test_session_times_read_as_utc_instants() -> None:
    assert parse_session_time("1:56 pm on 8 May, 2023") == datetime(2023, 5, 8, 13, 56, tzinfo=UTC)
    assert parse_session_time("9:05  am on 21 September, 2023") == datetime(2023, 9, 21, 9, 5, tzinfo=UTC)
    with pytest.raises(DatasetError):
        parse_session_time("yesterday")


def test_fixture_reads_turns_in_order_and_cleans_evidence() -> None:
    [conversation] = load_locomo(FIXTURE)
    assert [t.dia_id for t in conversation.turns] == ["D1:1", "D1:2", "D1:3", "D2:1", "D2:2", "D2:3"]
    assert [t.position for t in conversation.turns] == [0, 1, 2, 0, 1, 2]
    multi = next(q for q in conversation.questions if q.category == 1)
    assert multi.evidence == ("D1:3", "D2:3")  # "D1:3; D2:3" in one entry
    unknown = next(q for q in conversation.questions if q.text.startswith("A question whose"))
    assert unknown.evidence == ()  # names no turn of the conversation


def test_a_turn_becomes_the_write_a_client_would_send() -> None:
    [conversation] = load_locomo(FIXTURE)
    body = conversation.turns[5].write_body()
    assert body["content"] == "Bruno: A teapot, glazed in cobalt blue. (shares a photo: a photo of a blue teapot)"
    assert body["valid_from"] == "2021-04-17T18:40:00+00:00"
    assert body["observed_at"] == "2021-04-17T18:42:00+00:00"  # third turn of the session
    assert body["session_id"] == "session-2"
    assert body["metadata"]["dia_id"] == "D2:3"


def test_files_that_are_not_locomo_are_refused() -> None:
    with pytest.raises(DatasetError):
        parse_locomo({"conversation": {}})
    with pytest.raises(DatasetError):
        parse_locomo([{"conversation": {"session_1": [{"speaker": "A", "text": "no id"}]}}])


def test_recall_counts_the_share_of_evidence_within_the_first_k_results() -> None:
    ranked = [["D1:1"], ["D1:5", "D1:6"], ["D2:2"]]  # a deduplicated memory stands for two turns
    assert recall_at(("D1:6", "D2:2"), ranked, 1) == 0.0
    assert recall_at(("D1:6", "D2:2"), ranked, 2) == 0.5
    assert recall_at(("D1:6", "D2:2"), ranked, 3) == 1.0
    assert recall_at(("D1:6",), [], 10) == 0.0
    with pytest.raises(ValueError, match="without evidence"):
        recall_at((), ranked, 5)


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 95) == 95.0
    assert percentile([7.0], 95) == 7.0
    assert percentile([], 50) == 0.0


def test_summary_has_the_documented_shape_and_averages_by_category() -> None:
    scored = [
        Scored(Question("a", ("D1:1",), 1), {5: 1.0, 10: 1.0}, 4.0, 3),
        Scored(Question("b", ("D1:2",), 1), {5: 0.0, 10: 0.5}, 6.0, 3),
        Scored(Question("c", ("D1:3",), 4), {5: 1.0, 10: 1.0}, 8.0, 3),
    ]
    summary = summarize(scored, (5, 10), IngestStats(turns=12, seconds=0.5))
    assert set(summary) == {
        "questions", "turns", "recall", "by_category", "ingest_s", "search_p50_ms", "search_p95_ms",
    }  # fmt: skip
    assert summary["questions"] == 3 and summary["turns"] == 12
    assert summary["recall"] == {"5": round(2 / 3, 4), "10": round(2.5 / 3, 4)}
    assert summary["by_category"] == {"1": {"5": 0.5, "10": 0.75}, "4": {"5": 1.0, "10": 1.0}}
    assert summary["search_p50_ms"] == 6.0 and summary["search_p95_ms"] == 8.0


async def test_the_client_retries_overload_with_the_same_idempotency_key_and_nothing_else() -> None:
    seen: list[tuple[str, str | None]] = []
    in_progress = {"error": {"code": "IDEMPOTENCY_IN_PROGRESS"}}
    answers = [(503, {"Retry-After": "0"}, {}), (409, {}, in_progress), (429, {"Retry-After": "0"}, {}), (200, {}, {})]

    async def handler(request: web.Request) -> web.Response:
        seen.append((request.path, request.headers.get("Idempotency-Key")))
        if request.path == "/bad":
            return web.json_response({"error": {"code": "VALIDATION_ERROR"}}, status=400)
        if request.path == "/conflict":
            return web.json_response({"error": {"code": "IDEMPOTENCY_CONFLICT"}}, status=409)
        status, headers, body = answers.pop(0)
        return web.json_response(body or {"ok": status == 200}, status=status, headers=headers)

    app = web.Application()
    app.router.add_post("/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        async with aiohttp.ClientSession() as http:
            client = _Client(http, f"http://127.0.0.1:{runner.addresses[0][1]}", Agent("a", "t"))
            assert await client.post("/write", {}, idempotent=True) == {"ok": True}
            with pytest.raises(EvaluationError, match="answered 400"):
                await client.post("/bad", {})
            with pytest.raises(EvaluationError, match="answered 409"):
                await client.post("/conflict", {}, idempotent=True)
    finally:
        await runner.cleanup()
    keys = {key for path, key in seen if path == "/write"}
    assert len([p for p, _ in seen if p == "/write"]) == 4 and len(keys) == 1 and None not in keys
    assert [p for p, _ in seen].count("/bad") == 1 and [p for p, _ in seen].count("/conflict") == 1
