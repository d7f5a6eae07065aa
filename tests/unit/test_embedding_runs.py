"""padded_runs: how the encoders cut a call's texts into model runs (every text once, runs never over the size
limit, and the least padded cost; checked against every possible split of small inputs)."""

from __future__ import annotations

import itertools
import random

import pytest

from ibex_dataplane.embedding.runs import padded_runs


def cost(lengths: list[int], runs: list[list[int]], overhead: int) -> int:
    return sum(len(run) * max(lengths[i] for i in run) + overhead for run in runs)


def cheapest_split(lengths: list[int], max_size: int, overhead: int) -> int:
    """Brute force over every way to cut the length-sorted texts into contiguous runs."""
    ordered = sorted(lengths)
    n = len(ordered)
    best = None
    for cuts in itertools.product([False, True], repeat=max(0, n - 1)):
        runs, start = [], 0
        for k, cut in enumerate(cuts, start=1):
            if cut:
                runs.append(ordered[start:k])
                start = k
        runs.append(ordered[start:])
        if any(len(r) > max_size for r in runs):
            continue
        total = sum(len(r) * r[-1] + overhead for r in runs)
        best = total if best is None else min(best, total)
    assert best is not None
    return best


@pytest.mark.parametrize("seed", range(40))
def test_runs_cover_every_text_once_within_the_size_limit_at_the_least_cost(seed: int) -> None:
    rng = random.Random(seed)
    lengths = [rng.choice([rng.randint(5, 12), rng.randint(20, 120)]) for _ in range(rng.randint(1, 11))]
    max_size, overhead = rng.randint(1, 5), rng.choice([0, 4, 8, 24])
    runs = padded_runs(lengths, max_size=max_size, overhead=overhead)
    assert sorted(i for run in runs for i in run) == list(range(len(lengths)))
    assert all(1 <= len(run) <= max_size for run in runs)
    widths = [max(lengths[i] for i in run) for run in runs]
    assert widths == sorted(widths)  # shortest texts first
    assert cost(lengths, runs, overhead) == cheapest_split(lengths, max_size, overhead)


def test_alike_texts_share_full_runs_and_mixed_ones_are_not_padded_to_the_longest() -> None:
    assert sorted(len(run) for run in padded_runs([20] * 70, max_size=32)) == [6, 32, 32]
    runs = padded_runs([8, 120, 9, 118, 10, 121], max_size=32)
    assert runs == [[0, 2, 4], [3, 1, 5]]
    assert padded_runs([], max_size=4) == []
    with pytest.raises(ValueError, match="at least 1"):
        padded_runs([1], max_size=0)
