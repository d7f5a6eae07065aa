"""Pure parts of the memory stage: validation, dedup normalization, scoring, conflict rules, the wire shapes."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from ibex_dataplane.memory.classifier import ConflictQuestion, DeterministicClassifier, Verdict
from ibex_dataplane.memory.models import Memory, MemoryDraft, MemorySource, MemoryStatus, Neighbour
from ibex_dataplane.memory.refinery import closing_instant, content_hash, interval_supersedes, normalize
from ibex_dataplane.memory.search import frequency, recency, score
from ibex_dataplane.memory.tuning import SearchTuning
from ibex_dataplane.memory.validation import ListCursor, parse_feedback, parse_list, parse_search, parse_write
from ibex_dataplane.shared.errors import ValidationFailed
from ibex_dataplane.shared.idempotency import fingerprint, idempotency_key_of

T0 = datetime(2024, 1, 1, tzinfo=UTC)


def fields_of(error: ValidationFailed) -> list[str]:
    return [e["field"] for e in error.field_errors or []]


def memory(**overrides: object) -> Memory:
    base: dict[str, object] = dict(
        id=uuid.uuid4(), agent_id=uuid.uuid4(), content="c", status=MemoryStatus.ACTIVE, labels=("a",),
        source=MemorySource.USER_PROVIDED, confidence=0.8, usefulness=0.5, valid_from=None, valid_until=None,
        observed_at=None, session_id=None, metadata={"k": 1}, revision=1, retrieval_count=0, last_retrieved_at=None,
        created_at=T0, updated_at=T0,
    )  # fmt: skip
    base.update(overrides)
    return Memory(**base)  # type: ignore[arg-type]


def test_a_complete_write_body_validates() -> None:
    body = {"content": "x", "labels": ["a", "b"], "source": "imported", "confidence": 0}
    body |= {"valid_from": "2024-01-01T00:00:00Z", "valid_until": "2024-02-01T00:00:00+01:00"}
    body |= {"observed_at": "2023-12-31T23:00:00Z", "session_id": "s-1"}
    body |= {"metadata": {"nested": {"list": [1, "two", None]}}}
    draft = parse_write(body)
    assert draft.labels == ("a", "b") and draft.source is MemorySource.IMPORTED and draft.confidence == 0
    assert draft.valid_until == datetime(2024, 1, 31, 23, tzinfo=UTC)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"content": "   "}, "content"),
        ({"content": "é" * 5001}, "content"),  # 10002 bytes
        ({"content": 3}, "content"),
        ({"content": "x", "labels": []}, "labels"),
        ({"content": "x", "labels": "a"}, "labels"),
        ({"content": "x", "labels": ["a", "a"]}, "labels[1]"),
        ({"content": "x", "labels": [" a"]}, "labels[0]"),
        ({"content": "x", "labels": ["a" * 65]}, "labels[0]"),
        ({"content": "x", "labels": list("abcdef")}, "labels"),
        ({"content": "x", "confidence": True}, "confidence"),
        ({"content": "x", "valid_from": "2024-01-01"}, "valid_from"),
        ({"content": "x", "valid_from": "2024-01-01T00:00:00"}, "valid_from"),
        ({"content": "x", "valid_from": "2024-01-02T00:00:00Z", "valid_until": "2024-01-02T00:00:00Z"}, "valid_until"),
        ({"content": "x", "session_id": "has space"}, "session_id"),
        ({"content": "x", "metadata": []}, "metadata"),
        ({"content": "x", "metadata": {"a": {"b": {"c": {"d": {"e": {"f": {"g": 1}}}}}}}}, "metadata"),
        ({"content": "x", "agent_id": str(uuid.uuid4())}, "agent_id"),
    ],
)
def test_invalid_write_bodies_name_the_field(body: object, field: str) -> None:
    with pytest.raises(ValidationFailed) as caught:
        parse_write(body)
    assert field in fields_of(caught.value)


def test_validation_errors_never_echo_the_content() -> None:
    with pytest.raises(ValidationFailed) as caught:
        parse_write({"content": "secret-value " * 1000})
    assert "secret-value" not in str(caught.value.field_errors)


def test_search_list_and_feedback_parsing() -> None:
    assert parse_search({"query": "q"}, internal=False).limit == 10
    with pytest.raises(ValidationFailed):
        parse_search({"query": "q", "as_of": "2024-01-01T00:00:00Z"}, internal=False)
    assert parse_search({"query": "q", "as_of": "2024-01-01T00:00:00Z"}, internal=True).as_of == T0
    cursor = ListCursor(T0, uuid.uuid4())
    assert parse_list({"cursor": cursor.encode(), "limit": "5"}).cursor == cursor
    assert parse_list({}).status is MemoryStatus.ACTIVE
    assert parse_feedback({"signal": "negative"}).useful is False
    with pytest.raises(ValidationFailed):
        parse_feedback({"useful": True, "signal": "negative"})


def test_normalization_makes_trivially_different_writes_exact_duplicates() -> None:
    assert normalize("  The  Cafe\u0301\tis OPEN \n") == "the café is open"
    assert content_hash("The café is open") == content_hash("the  CAFÉ is open ")
    assert content_hash("The café is open") != content_hash("The cafe is open")


def test_idempotency_fingerprints_ignore_key_order_but_not_routes() -> None:
    assert fingerprint("r", b'{"a": 1, "b": 2}') == fingerprint("r", b'{"b":2,"a":1}')
    assert fingerprint("r", b'{"a": 1}') != fingerprint("s", b'{"a": 1}')
    assert idempotency_key_of({"X-Idempotency-Key": "k1"}) == "k1"
    assert idempotency_key_of({}) is None
    with pytest.raises(ValidationFailed):
        idempotency_key_of({"Idempotency-Key": "has space"})


def test_the_composite_score_weights_its_five_components() -> None:
    now = T0 + timedelta(days=30)
    m = memory(usefulness=0.75, confidence=0.5, retrieval_count=5, valid_from=T0)
    total, c = score(m, 0.9, now, SearchTuning())
    assert c.recency == pytest.approx(0.5)
    assert c.frequency == pytest.approx(0.5)
    assert total == pytest.approx(0.40 * 0.9 + 0.25 * 0.5 + 0.20 * 0.75 + 0.10 * 0.5 + 0.05 * 0.5)
    assert recency(now + timedelta(days=1), now, 30) == 1.0
    assert frequency(0, 5) == 0
    with pytest.raises(ValueError, match="floor"):
        SearchTuning(relevance_floor=1.0)
    with pytest.raises(ValueError, match="below"):
        SearchTuning(similarity_zero=0.8, similarity_full=0.8)


def test_the_interval_rule_and_where_the_old_validity_closes() -> None:
    old = Neighbour(uuid.uuid4(), 0.9, "old", 3, T0, T0 + timedelta(days=10))
    later = MemoryDraft("new", valid_from=T0 + timedelta(days=10))
    assert interval_supersedes(later, old)
    assert not interval_supersedes(MemoryDraft("new", valid_from=T0 + timedelta(days=5)), old)
    assert not interval_supersedes(MemoryDraft("new"), old)
    open_old = Neighbour(uuid.uuid4(), 0.9, "old", 1, T0, None)
    assert closing_instant(later, open_old, T0 + timedelta(days=99)) == T0 + timedelta(days=10)
    assert closing_instant(MemoryDraft("new", valid_from=T0), open_old, T0) is None  # would not be after its start
    assert closing_instant(later, old, T0) is None  # already closed by then


@pytest.mark.parametrize(
    ("new", "old", "similarity", "starts", "verdict"),
    [
        ("The user likes green tea.", "The user does not like green tea.", 0.86, None, Verdict.CONTRADICTION),
        ("The user isn't vegan.", "The user is vegan.", 0.9, None, Verdict.CONTRADICTION),
        ("The user likes green tea with honey.", "The user likes green tea.", 0.82, None, Verdict.SPECIALIZES),
        ("The user lives in Berlin.", "The user lives in Paris.", 0.64, (T0 + timedelta(1), T0), Verdict.SUPERSEDES),
        ("The office is on floor 5.", "The office is on floor 3.", 0.93, None, Verdict.CONTRADICTION),
        ("Standups happen daily at ten.", "Standups are daily and short.", 0.9, None, Verdict.OVERLAP),
        ("The user lives in Berlin.", "The user lives in Paris.", 0.64, None, Verdict.UNRELATED),
        # A later turn of a conversation that merely sounds alike does not replace an earlier one.
        (
            "Mia: That sounds great, enjoy the trip!",
            "Leo: That's great news about the job!",
            0.7,
            (T0 + timedelta(30), T0),
            Verdict.UNRELATED,
        ),
    ],
)
async def test_the_default_classifier_is_deterministic(
    new: str, old: str, similarity: float, starts: tuple[datetime, datetime] | None, verdict: Verdict
) -> None:
    q = ConflictQuestion(new, old, similarity, starts[0] if starts else None, None, starts[1] if starts else None, None)
    classifier = DeterministicClassifier()
    assert await classifier.classify(q) is verdict
    assert classifier.decide(q) is verdict


def test_quarantined_memories_never_show_content_on_the_wire() -> None:
    wire = memory(status=MemoryStatus.QUARANTINED, content="Reference 457-55-5462").to_wire()
    assert wire["content"] is None and wire["labels"] == [] and wire["metadata"] == {}
    active = memory().to_wire()
    assert active["content"] == "c" and active["created_at"] == "2024-01-01T00:00:00Z"
