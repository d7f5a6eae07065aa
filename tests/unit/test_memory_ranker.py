"""The learned order of memory search: its features on small fixed candidate sets, the weight file, and how the
search uses it (the floor still decides what may answer; the ranker only orders)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import pytest

from ibex_dataplane.memory.evidence import names_in, periods_named
from ibex_dataplane.memory.models import Memory
from ibex_dataplane.memory.ranker import FEATURES, Ranker, RankerError, default_ranker, features
from ibex_dataplane.memory.repository import SearchRow
from ibex_dataplane.memory.search import rank
from ibex_dataplane.memory.tuning import SearchTuning
from tests.support.records import stored_memory

T0 = datetime(2023, 5, 8, 13, 56, tzinfo=UTC)
NOW = datetime(2026, 1, 1, tzinfo=UTC)
TUNING = SearchTuning()
COLUMN = {name: i for i, name in enumerate(FEATURES)}


def memory(content: str, **overrides: object) -> Memory:
    return stored_memory(content, T0, **overrides)


def row(content: str, similarity: float | None = None, text: float | None = None, **fields: object) -> SearchRow:
    return SearchRow(memory(content, **fields), similarity, text, 1 if text else 0)


def feature(x: np.ndarray[Any, Any], i: int, name: str) -> float:
    return float(x[i, COLUMN[name]])


def one_hot(name: str, lo: float = 0.0, hi: float = 1.0) -> Ranker:
    """A ranker that scores by one feature alone."""
    n = len(FEATURES)
    weights = np.zeros(n)
    weights[COLUMN[name]] = 1.0
    return Ranker(weights, np.zeros(n), np.ones(n), lo, hi, {})


def test_names_count_as_the_first_word_or_anywhere() -> None:
    rows = [row("Maria: I painted a lake."), row("John: Maria painted a lake."), row("John: I painted a lake.")]
    x = features(rows, TUNING, names=names_in("What did Maria paint?"))
    assert [feature(x, i, "starts_with_name") for i in range(3)] == [1.0, 0.0, 0.0]
    assert [feature(x, i, "holds_name") for i in range(3)] == [1.0, 1.0, 0.0]
    # A name is a whole run of letters: a possessive holds it, a longer name does not.
    x = features([row("(Maria's turn) ok"), row("Marianne: hi"), row("Hi Maria2")], TUNING, names=frozenset({"Maria"}))
    assert [feature(x, i, "starts_with_name") for i in range(3)] == [1.0, 0.0, 0.0]
    assert [feature(x, i, "holds_name") for i in range(3)] == [1.0, 0.0, 1.0]


def test_each_leg_is_ranked_and_scaled_to_the_best_of_the_query() -> None:
    rows = [row("a", 0.7, None), row("b", 0.35, 8.0), row("c", None, 4.0)]
    x = features(rows, TUNING)
    assert [feature(x, i, "vector_rank") for i in range(3)] == [1.0, 0.5, 0.0]
    assert [feature(x, i, "bm25_rank") for i in range(3)] == [0.0, 1.0, 0.5]
    assert [feature(x, i, "similarity_of_best") for i in range(3)] == pytest.approx([1.0, 0.5, 0.0])
    assert [feature(x, i, "bm25_of_best") for i in range(3)] == pytest.approx([0.0, 1.0, 0.5])


def test_neighbours_are_turns_close_in_time_in_the_same_session_before_or_after() -> None:
    question = row("Which team did you sign with?", 0.7, 9.0, session_id="s1", observed_at=T0)
    reply = row("The Minnesota Wolves!", None, None, session_id="s1", observed_at=T0 + timedelta(seconds=60))
    later = row("Unrelated, much later", None, None, session_id="s1", observed_at=T0 + timedelta(hours=2))
    other = row("Another session", None, None, session_id="s2", observed_at=T0 + timedelta(seconds=30))
    x = features([question, reply, later, other], TUNING)
    fused_question = feature(x, 0, "fused")
    assert fused_question > 0
    assert feature(x, 1, "neighbour") == feature(x, 1, "neighbour_before") == pytest.approx(fused_question)
    assert feature(x, 1, "neighbour_after") == 0.0
    assert feature(x, 0, "neighbour") == 0.0  # its neighbour holds no evidence
    assert feature(x, 2, "neighbour") == 0.0  # same session, too far
    assert feature(x, 2, "session_best") == pytest.approx(fused_question)
    assert feature(x, 3, "session_best") == 0.0 and feature(x, 3, "neighbour") == 0.0


def test_periods_questions_and_length() -> None:
    inside = row("We went camping?", 0.5, None, valid_from=datetime(2022, 4, 9, tzinfo=UTC))
    june = datetime(2022, 6, 1, tzinfo=UTC)
    outside = row("We went camping near the lake with the kids.", 0.5, None, valid_from=june)
    x = features([inside, outside], TUNING, periods=periods_named("What did they do in April 2022?"))
    assert (feature(x, 0, "in_period"), feature(x, 1, "in_period")) == (1.0, 0.0)
    assert (feature(x, 0, "is_question"), feature(x, 1, "is_question")) == (1.0, 0.0)
    assert feature(x, 1, "length") > feature(x, 0, "length")


def test_the_ranker_orders_but_the_floor_still_decides_what_may_answer() -> None:
    junk = row("Maria: nothing at all like it", None, None)  # no leg found it: evidence 0
    weak = row("Maria: something", 0.5, 4.0)  # evidence above the floor, below the strong one
    strong = row("John: a lake", 0.75, 10.0)
    by_name = one_hot("starts_with_name")
    hits = rank([junk, weak, strong], "What did Maria paint?", 10, NOW, TUNING, by_name)
    assert junk.memory.id not in {h.memory.id for h in hits}  # below the floor whatever the ranker says
    assert [h.memory.id for h in rank([junk], "What did Maria paint?", 10, NOW, TUNING, by_name)] == []
    chosen = rank([weak, strong], "What did Maria paint?", 1, NOW, TUNING, by_name)
    assert [h.memory.id for h in chosen] == [weak.memory.id]  # the ranker picks the `limit` best
    assert chosen[0].components.relevance == 1.0  # its score mapped: lo 0 -> 0, hi 1 -> 1
    assert [h.memory.id for h in rank([weak, strong], "What did Maria paint?", 1, NOW, TUNING)] == [strong.memory.id]


def test_relevance_is_a_fixed_linear_map_of_the_score_clipped_to_0_1() -> None:
    ranker = one_hot("fused", lo=2.0, hi=6.0)
    assert ranker.relevance(np.array([0.0, 2.0, 3.0, 6.0, 9.0])).tolist() == [0.0, 0.0, 0.25, 1.0, 1.0]


def test_a_weight_file_round_trips_and_one_for_other_features_is_refused() -> None:
    ranker = default_ranker()
    again = Ranker.from_json(json.loads(json.dumps(ranker.to_json())))
    assert np.allclose(again.weights, ranker.weights) and again.lo == ranker.lo and again.hi == ranker.hi
    shuffled = ranker.to_json()
    for key in ("features", "weights", "mean", "scale"):
        shuffled[key] = list(reversed(shuffled[key]))  # matched by name, not position
    assert np.allclose(Ranker.from_json(shuffled).weights, ranker.weights)
    other = ranker.to_json()
    other["features"] = [*other["features"][:-1], "something_else"]
    with pytest.raises(RankerError, match="other features"):
        Ranker.from_json(other)
    flat = ranker.to_json() | {"hi": ranker.lo}
    with pytest.raises(RankerError):
        Ranker.from_json(flat)
    with pytest.raises(RankerError):
        Ranker.from_json({"features": list(FEATURES)})


def test_the_shipped_weights_say_where_they_come_from_and_prefer_what_the_question_asks() -> None:
    ranker = default_ranker()
    provenance = ranker.provenance
    assert provenance["trained_on"].endswith(".json") and provenance["questions"] > 0
    assert 0 < provenance["leave_one_conversation_out_recall"]["10"] <= 1
    # Equal term and vector evidence: the memory said by the person the question names comes first.
    said = row("Maria: I painted a sunrise over the lake last week.", 0.6, 8.0)
    mentioned = row("John: I saw that Maria painted a sunrise over the lake.", 0.6, 8.0)
    hits = rank([mentioned, said], "What did Maria paint?", 2, NOW, TUNING, ranker)
    assert [h.memory.id for h in hits] == [said.memory.id, mentioned.memory.id]
    assert hits[0].components.relevance > hits[1].components.relevance
