"""The pure ranking of memory search: fusion of the two legs, the floor, named periods, neighbours, final order."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta

import pytest

from ibex_dataplane.memory.evidence import (
    evidence_of,
    names_in,
    periods_named,
    text_evidence,
    vector_evidence,
)
from ibex_dataplane.memory.models import Memory
from ibex_dataplane.memory.repository import SearchRow, merge_legs
from ibex_dataplane.memory.search import matched_by, rank
from ibex_dataplane.memory.tuning import SearchTuning
from tests.support.records import leg_row, stored_memory

T0 = datetime(2023, 5, 8, 13, 56, tzinfo=UTC)
NOW = datetime(2026, 1, 1, tzinfo=UTC)
TUNING = SearchTuning()


def memory(content: str = "c", **overrides: object) -> Memory:
    return stored_memory(content, T0, **overrides)


def row(similarity: float | None = None, text: float | None = None, **fields: object) -> SearchRow:
    return SearchRow(memory(**fields), similarity, text, 1 if text else 0)


def test_each_leg_counts_on_an_absolute_scale() -> None:
    assert vector_evidence(None, TUNING) == 0.0
    assert vector_evidence(TUNING.similarity_zero, TUNING) == 0.0
    assert vector_evidence(TUNING.similarity_full + 0.1, TUNING) == 1.0
    assert 0 < vector_evidence(0.5, TUNING) < 1
    assert text_evidence(None, TUNING) == 0.0
    assert text_evidence(TUNING.text_half, TUNING) == 0.5
    assert text_evidence(2 * TUNING.text_half, TUNING) > text_evidence(TUNING.text_half, TUNING)


def test_fusion_prefers_a_memory_both_legs_found() -> None:
    both = row(0.6, 6.0)
    vector_only = row(0.6)
    text_only = row(None, 6.0)
    r_both, r_vector, r_text = evidence_of([both, vector_only, text_only], TUNING)
    assert r_both > r_vector and r_both > r_text


def test_the_floor_drops_weak_candidates_and_keeps_strong_ones() -> None:
    weak = row(0.32)  # just above the ANN cutoff: almost no evidence
    strong = row(0.75, 9.0)
    hits = rank([weak, strong], "question", 10, NOW, TUNING)
    assert [h.memory.id for h in hits] == [strong.memory.id]
    assert hits[0].components.relevance >= TUNING.relevance_floor
    assert rank([weak], "question", 10, NOW, TUNING) == []


def test_a_named_month_or_day_becomes_a_period() -> None:
    [may] = periods_named("What did she paint in May 2023?")
    assert may.holds(datetime(2023, 5, 31, 23, tzinfo=UTC)) and not may.holds(datetime(2023, 6, 1, tzinfo=UTC))
    [day] = periods_named("What happened on 8 May, 2023?")
    assert day.holds(T0) and not day.holds(T0 + timedelta(days=3))
    [year] = periods_named("Where did they travel in 2022?")
    assert year.holds(datetime(2022, 7, 1, tzinfo=UTC)) and not year.holds(T0)
    assert periods_named("When did she paint the sunrise?") == []


def test_a_period_in_the_query_lifts_memories_valid_from_inside_it() -> None:
    inside = row(0.5, 3.0, valid_from=datetime(2022, 4, 10, tzinfo=UTC), observed_at=None)
    outside = row(0.5, 3.0, valid_from=datetime(2022, 9, 10, tzinfo=UTC), observed_at=None)
    plain = evidence_of([inside, outside], TUNING)
    timed = evidence_of([inside, outside], TUNING, periods_named("What did Nate do in April 2022?"))
    assert plain[0] == plain[1]
    assert timed[0] > timed[1] == plain[1]


def test_a_neighbouring_turn_of_a_strong_hit_is_lifted_above_a_lone_equal_one() -> None:
    question = row(0.78, 10.0, session_id="s1", observed_at=T0)
    answer = row(0.40, None, session_id="s1", observed_at=T0 + timedelta(minutes=1))
    lone = row(0.40, None, session_id="s2", observed_at=T0 + timedelta(minutes=1))
    far = row(0.40, None, session_id="s1", observed_at=T0 + timedelta(hours=2))
    r_question, r_answer, r_lone, r_far = evidence_of([question, answer, lone, far], TUNING)
    assert r_answer > r_far > r_lone  # the neighbour gets most; the rest of the session a little
    assert r_question >= r_answer
    without = evidence_of([question, answer, lone, far], SearchTuning(neighbour_weight=0, session_weight=0))
    assert without[1] == without[2] == without[3]


def test_an_old_answer_is_not_pushed_out_by_recent_unrelated_memories() -> None:
    old_answer = row(0.8, 9.0, valid_from=NOW - timedelta(days=900), observed_at=None)
    recent = [row(0.6, 3.0, valid_from=NOW - timedelta(hours=1), observed_at=None) for _ in range(3)]
    hits = rank([*recent, old_answer], "question", 1, NOW, TUNING)
    assert [h.memory.id for h in hits] == [old_answer.memory.id]
    every = rank([*recent, old_answer], "question", 4, NOW, TUNING)
    assert len(every) == 4  # the recent ones pass the floor too ...
    assert every[-1].memory.id == old_answer.memory.id  # ... and, far more recent, come first by composite score
    assert all(a.score >= b.score for a, b in itertools.pairwise(every))


def test_a_memory_both_legs_found_is_merged_into_one_row_with_both_scores() -> None:
    both, vector_only, text_only = memory("both"), memory("vector"), memory("text")
    merged = merge_legs(
        [leg_row(both, similarity=0.7), leg_row(vector_only, similarity=0.5)],
        [leg_row(both, text_score=3.0, text_terms=2), leg_row(text_only, text_score=1.0, text_terms=1)],
    )
    by_id = {r.memory.id: (r.similarity, r.text_score, r.text_terms) for r in merged}
    assert by_id == {both.id: (0.7, 3.0, 2), vector_only.id: (0.5, None, 0), text_only.id: (None, 1.0, 1)}
    assert [r.memory for r in merged] == [both, vector_only, text_only]  # decoded as stored, first found first
    assert [matched_by(r) for r in merged if r.memory.id == both.id] == ["both"]


def test_names_are_capitalized_words_that_do_not_start_a_sentence() -> None:
    assert names_in("What did Maria paint after Jonas's visit? Where is Oslo?") == {"Maria", "Jonas", "Oslo"}
    assert names_in("when did the user move") == frozenset()


def test_a_memory_holding_a_name_the_query_mentions_is_lifted_above_an_equal_one_without_it() -> None:
    with_name = row(text=3.0, content="Maria: I painted the lake last week.")
    without = row(text=3.0, content="Jonas: I painted the lake last week.")
    named, plain = evidence_of([with_name, without], TUNING, names=names_in("What did Maria paint?"))
    assert named == pytest.approx(plain + TUNING.name_weight)
    assert evidence_of([with_name, without], TUNING, names=names_in("What did Oskar paint?")) == [plain, plain]


def test_the_splade_score_adds_to_bm25_in_bm25_units() -> None:
    t = TUNING
    assert text_evidence(None, t, None) == 0.0
    assert text_evidence(None, t, t.text_half / t.sparse_weight) == pytest.approx(0.5)  # SPLADE alone
    assert text_evidence(2.0, t, 10.0) == pytest.approx(text_evidence(2.0 + t.sparse_weight * 10.0, t))
    off = SearchTuning(sparse_weight=0.0)
    assert text_evidence(2.0, off, 10.0) == text_evidence(2.0, off)


def test_a_memory_the_sparse_leg_also_found_outranks_an_equal_one_it_did_not() -> None:
    related = SearchRow(memory("John: The Minnesota Wolves!"), 0.5, 3.0, 1, 12.0)
    unrelated = SearchRow(memory("John: The weather is fine."), 0.5, 3.0, 1, None)
    strong = 4 * TUNING.text_half / TUNING.sparse_weight  # text evidence 0.8 from SPLADE alone
    only_sparse = SearchRow(memory("John: We won the game."), None, None, 0, strong)
    r_related, r_unrelated, r_sparse = evidence_of([related, unrelated, only_sparse], TUNING)
    assert r_related > r_unrelated
    assert r_sparse >= TUNING.relevance_floor  # a strong SPLADE match alone is an answer
    hits = rank([unrelated, related, only_sparse], "Which team did John sign with?", 2, NOW, TUNING)
    assert {h.memory.id for h in hits} == {related.memory.id, only_sparse.memory.id}
    assert [matched_by(r) for r in (related, only_sparse)] == ["both", "text"]


def test_three_legs_merge_into_one_row_per_memory() -> None:
    a, b, c = memory("a"), memory("b"), memory("c")
    merged = merge_legs(
        [leg_row(a, similarity=0.7)],
        [leg_row(a, text_score=3.0, text_terms=2), leg_row(b, text_score=1.0, text_terms=1)],
        [leg_row(a, text_score=9.0), leg_row(c, text_score=4.0)],
    )
    by_id = {r.memory.id: (r.similarity, r.text_score, r.text_terms, r.sparse_score) for r in merged}
    assert by_id == {a.id: (0.7, 3.0, 2, 9.0), b.id: (None, 1.0, 1, None), c.id: (None, None, 0, 4.0)}
