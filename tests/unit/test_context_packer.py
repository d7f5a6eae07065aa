"""The memory packer: never over budget, never worse than greedy by score, order-independent, honest reports."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ibex_dataplane.context.packer import PackCandidate, PackPath, PackResult, pack_memories


def candidate_lists(*, max_size: int = 40, integer_scores: bool = False) -> st.SearchStrategy[list[PackCandidate]]:
    scores = (
        st.integers(0, 100).map(float) if integer_scores else st.floats(0, 1, allow_nan=False, allow_infinity=False)
    )
    # Small entries too: many of them rounding down to one bucket is where the DP undercounts tokens.
    entry = st.tuples(scores, st.one_of(st.integers(1, 400), st.integers(1, 30)))
    return st.lists(entry, max_size=max_size).flatmap(
        lambda rows: st.permutations(range(len(rows))).map(
            lambda ids: [PackCandidate(f"m{ids[i]:03d}", s, t) for i, (s, t) in enumerate(rows)]
        )
    )


budgets = st.integers(0, 3000)
buckets = st.sampled_from([1, 7, 16, 32])
limits = st.one_of(st.none(), st.integers(0, 12))


def greedy_by_score(candidates: list[PackCandidate], budget: int, max_items: int | None) -> list[PackCandidate]:
    """The plain greedy solution, written independently of the packer: best score first, take whatever fits."""
    chosen: list[PackCandidate] = []
    room = budget
    for c in sorted(candidates, key=lambda c: (-c.score, c.id)):
        if max_items is not None and len(chosen) >= max_items:
            break
        if c.tokens <= room:
            chosen.append(c)
            room -= c.tokens
    return chosen


def best_value_by_brute_force(candidates: list[PackCandidate], budget: int, max_items: int | None) -> float:
    limit = len(candidates) if max_items is None else max_items
    best = 0.0
    for r in range(min(limit, len(candidates)) + 1):
        for subset in itertools.combinations(candidates, r):
            if sum(c.tokens for c in subset) <= budget:
                best = max(best, math.fsum(c.score for c in subset))
    return best


def assert_consistent(result: PackResult, candidates: list[PackCandidate]) -> None:
    assert result.tokens == sum(c.tokens for c in result.chosen)
    assert result.value == math.fsum(c.score for c in result.chosen)
    assert list(result.chosen) == sorted(result.chosen, key=lambda c: (-c.score, c.id))
    assert result.evaluated == len(candidates)
    assert len(result.chosen) + result.excluded_for_budget + result.excluded_for_limit == len(candidates)
    assert result.budget_reached == (result.excluded_for_budget > 0)


@settings(max_examples=300, deadline=None)
@given(candidate_lists(), budgets, buckets, limits)
def test_chosen_memories_never_exceed_the_budget_in_exact_tokens(
    candidates: list[PackCandidate], budget: int, bucket: int, max_items: int | None
) -> None:
    result = pack_memories(candidates, budget, bucket=bucket, max_items=max_items)
    assert result.tokens <= budget
    assert_consistent(result, candidates)


@settings(max_examples=300, deadline=None)
@given(candidate_lists(), budgets, buckets, limits)
def test_packed_value_is_at_least_the_greedy_solutions(
    candidates: list[PackCandidate], budget: int, bucket: int, max_items: int | None
) -> None:
    result = pack_memories(candidates, budget, bucket=bucket, max_items=max_items)
    greedy = greedy_by_score(candidates, budget, max_items)
    assert result.value >= math.fsum(c.score for c in greedy)


@settings(max_examples=200, deadline=None)
@given(candidate_lists(), budgets, limits, st.randoms(use_true_random=False))
def test_any_order_of_the_same_candidates_gives_the_same_result(
    candidates: list[PackCandidate], budget: int, max_items: int | None, rnd: random.Random
) -> None:
    shuffled = list(candidates)
    rnd.shuffle(shuffled)
    assert pack_memories(shuffled, budget, max_items=max_items) == pack_memories(
        candidates, budget, max_items=max_items
    )


@settings(max_examples=200, deadline=None)
@given(candidate_lists(max_size=8, integer_scores=True), st.integers(0, 1200), st.one_of(st.none(), st.integers(2, 8)))
def test_one_token_buckets_find_the_optimum_when_the_pretrim_keeps_every_candidate(
    candidates: list[PackCandidate], budget: int, max_items: int | None
) -> None:
    result = pack_memories(candidates, budget, bucket=1, max_items=max_items)
    assert result.path is PackPath.DP
    assert result.value == best_value_by_brute_force(candidates, budget, max_items)


@settings(max_examples=200, deadline=None)
@given(candidate_lists(), budgets, buckets, st.integers(0, 12))
def test_max_items_caps_how_many_memories_are_chosen(
    candidates: list[PackCandidate], budget: int, bucket: int, max_items: int
) -> None:
    result = pack_memories(candidates, budget, bucket=bucket, max_items=max_items)
    assert len(result.chosen) <= max_items


@settings(max_examples=100, deadline=None)
@given(candidate_lists(), budgets, limits)
def test_greedy_path_above_the_cell_ceiling_still_keeps_every_guarantee(
    candidates: list[PackCandidate], budget: int, max_items: int | None
) -> None:
    result = pack_memories(candidates, budget, cell_ceiling=0, max_items=max_items)
    assert result.tokens <= budget
    assert list(result.chosen) == greedy_by_score(candidates, budget, max_items)
    assert_consistent(result, candidates)


def test_no_candidates_is_not_a_truncation() -> None:
    result = pack_memories([], 1000)
    assert result.chosen == ()
    assert result.budget_reached is False
    assert (result.evaluated, result.excluded_for_budget, result.tokens, result.value) == (0, 0, 0, 0.0)


@given(candidate_lists().filter(bool), st.sampled_from([0, 1, 2, 5]))
def test_candidates_with_no_room_is_a_truncation(candidates: list[PackCandidate], budget: int) -> None:
    tight = [PackCandidate(c.id, c.score, c.tokens + budget) for c in candidates]
    result = pack_memories(tight, budget)
    assert result.chosen == ()
    assert result.budget_reached is True
    assert result.excluded_for_budget == len(tight)


def test_two_medium_memories_beat_one_big_memory_with_the_top_score() -> None:
    big = PackCandidate("big", 1.0, 100)
    medium = [PackCandidate("m1", 0.7, 50), PackCandidate("m2", 0.6, 50)]
    result = pack_memories([big, *medium], 100)
    assert [c.id for c in greedy_by_score([big, *medium], 100, None)] == ["big"]
    assert result.path is PackPath.DP
    assert [c.id for c in result.chosen] == ["m1", "m2"]
    assert result.value == pytest.approx(1.3)
    assert result.budget_reached is True
    assert result.excluded_for_budget == 1


def test_the_greedy_path_is_taken_above_the_cell_ceiling() -> None:
    big = PackCandidate("big", 1.0, 100)
    medium = [PackCandidate("m1", 0.7, 50), PackCandidate("m2", 0.6, 50)]
    result = pack_memories([big, *medium], 100, cell_ceiling=3)
    assert result.path is PackPath.GREEDY
    assert [c.id for c in result.chosen] == ["big"]


def test_everything_that_fits_is_chosen_without_building_a_table() -> None:
    candidates = [PackCandidate("a", 0.1, 10), PackCandidate("b", 0.9, 20), PackCandidate("c", 0.5, 5000)]
    result = pack_memories(candidates, 100, cell_ceiling=0)
    assert result.path is PackPath.DP
    assert [c.id for c in result.chosen] == ["b", "a"]
    assert result.budget_reached is True


def test_rounding_down_to_buckets_is_repaired_to_the_exact_budget() -> None:
    # 23 tokens round to one 16-token bucket, so the DP sees four of them fit the 4 buckets of a 65-token budget;
    # their exact sum is 92, and repair must bring it back under 65.
    candidates = [PackCandidate(f"m{i}", 1.0, 23) for i in range(4)]
    result = pack_memories(candidates, 65)
    assert result.tokens <= 65
    assert len(result.chosen) == 2


def test_refill_adds_what_still_fits_after_the_dp() -> None:
    candidates = [PackCandidate("a", 1.0, 40), PackCandidate("b", 0.9, 40), PackCandidate("tiny", 0.0, 3)]
    result = pack_memories(candidates, 83, bucket=16)
    assert [c.id for c in result.chosen] == ["a", "b", "tiny"]
    assert result.budget_reached is False


def test_max_items_reached_is_reported_as_a_limit_not_a_truncation() -> None:
    candidates = [PackCandidate(f"m{i}", 1.0 - i / 10, 10) for i in range(5)]
    result = pack_memories(candidates, 1000, max_items=2)
    assert [c.id for c in result.chosen] == ["m0", "m1"]
    assert (result.excluded_for_budget, result.excluded_for_limit, result.budget_reached) == (0, 3, False)


@pytest.mark.parametrize(
    ("candidates", "message"),
    [
        ([PackCandidate("a", 0.5, 0)], "tokens"),
        ([PackCandidate("a", -0.1, 10)], "score"),
        ([PackCandidate("a", math.nan, 10)], "score"),
        ([PackCandidate("a", math.inf, 10)], "score"),
        ([PackCandidate("a", 0.5, 10), PackCandidate("a", 0.4, 20)], "duplicate"),
    ],
)
def test_invalid_candidates_are_a_caller_bug(candidates: list[PackCandidate], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pack_memories(candidates, 100)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"budget": -1}, "budget"),
        ({"budget": 10, "bucket": 0}, "bucket"),
        ({"budget": 10, "max_items": -1}, "max_items"),
    ],
)
def test_negative_arguments_are_refused(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pack_memories([PackCandidate("a", 0.5, 5)], **kwargs)
