"""Choosing which memories fit the budget: a 0/1 knapsack over composite scores and token estimates.

Owns ``pack_memories``, a pure function the context stage's service calls once per assembly with the retrieved
candidates (score from the memory service, tokens from ``formatter.entry_tokens``) and ``ContextBudget.usable``.

Algorithm
---------
1. Validate (a non-positive token count, a negative or non-finite score, or a duplicate id is a caller bug) and
   sort by score descending, then id ascending. Every later step walks this canonical order, so the result does
   not depend on the order the candidates arrived in.
2. If every candidate fits (tokens and ``max_items``), take them all: that is optimal and needs no table.
3. Otherwise, when the dynamic-programming table stays within ``cell_ceiling`` cells, run the DP: weights are
   token counts rounded to ``bucket``-token buckets (at least one bucket), capacity is ``budget // bucket``
   buckets, and the table is updated with whole-row numpy operations (no Python loop over capacity). Without an
   item cap, candidates of equal bucketed weight are one step: of those, the best ``t`` are the ones to take,
   so each step picks the best ``t`` for every capacity at once (about 20 steps for 200 candidates). With
   ``max_items`` below the number of candidates that fit, the DP also counts items (a table of item count x
   capacity, one step per candidate) over the best ``MAX_ITEMS_PRETRIM`` x ``max_items`` candidates by score.
   Above the ceiling, the greedy solution is used and the path is ``greedy``.
4. Repair: rounding can undercount, so while the exact token sum exceeds the budget, drop the chosen candidate
   with the lowest score per token.
5. Refill: walk every candidate in canonical order and add what still fits in exact tokens (and under
   ``max_items``).
6. Keep the better of that and the plain greedy-by-score solution (walk in canonical order, take whatever fits,
   up to ``max_items``). Discretization can lose to greedy on some inputs; this makes "never worse than greedy"
   hold by construction. The path stays ``dp``: it names the search that ran, not which candidate set won.

``budget_reached`` means some candidate was left out because it did not fit in the room that was left: no
candidates is not a truncation, candidates with no room is one. Candidates left out only because
``max_items`` was reached count in ``excluded_for_limit``, not as a budget truncation.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

__all__ = [
    "DEFAULT_BUCKET",
    "DEFAULT_CELL_CEILING",
    "MAX_ITEMS_PRETRIM",
    "PackCandidate",
    "PackPath",
    "PackResult",
    "pack_memories",
]

DEFAULT_BUCKET: Final = 16
DEFAULT_CELL_CEILING: Final = 4_000_000
# With a max_items cap the DP considers only the best MAX_ITEMS_PRETRIM * max_items candidates by score: the
# count dimension multiplies the table, and a chosen set of at most k items rarely reaches far below the top 4k.
# Refill and the greedy comparison still see every candidate.
MAX_ITEMS_PRETRIM: Final = 4


class PackPath(enum.StrEnum):
    """Which search chose the memories."""

    DP = "dp"
    GREEDY = "greedy"


@dataclass(frozen=True, slots=True)
class PackCandidate:
    """A retrieved memory as the packer sees it: its composite score and the tokens its formatted entry costs."""

    id: str
    score: float
    tokens: int


@dataclass(frozen=True, slots=True)
class PackResult:
    """The chosen memories in emit order (score descending, then id ascending) and the packing report.

    ``evaluated`` is the number of candidates considered; ``excluded_for_budget`` those left out because they
    did not fit in the room left; ``excluded_for_limit`` those left out only because ``max_items`` was reached.
    ``tokens`` and ``value`` are the exact token sum and score sum of ``chosen``.
    """

    chosen: tuple[PackCandidate, ...]
    path: PackPath
    evaluated: int
    excluded_for_budget: int
    budget_reached: bool
    tokens: int
    value: float
    excluded_for_limit: int = 0


def _validate(candidates: Sequence[PackCandidate], budget: int, bucket: int, max_items: int | None) -> None:
    if budget < 0:
        raise ValueError("budget must not be negative")
    if bucket < 1:
        raise ValueError("bucket must be at least one token")
    if max_items is not None and max_items < 0:
        raise ValueError("max_items must not be negative")
    seen: set[str] = set()
    for c in candidates:
        if c.tokens <= 0:
            raise ValueError(f"candidate {c.id!r} has {c.tokens} tokens; every entry costs at least one")
        if not math.isfinite(c.score) or c.score < 0:
            raise ValueError(f"candidate {c.id!r} has score {c.score}; scores are finite and non-negative")
        if c.id in seen:
            raise ValueError(f"duplicate candidate id {c.id!r}")
        seen.add(c.id)


def _greedy(ordered: Sequence[PackCandidate], budget: int, limit: int) -> list[int]:
    """Indexes (into ``ordered``) taken by walking in order and keeping whatever still fits."""
    chosen: list[int] = []
    room = budget
    for i, c in enumerate(ordered):
        if len(chosen) >= limit:
            break
        if c.tokens <= room:
            chosen.append(i)
            room -= c.tokens
    return chosen


def _dp_plain(weights: npt.NDArray[np.int64], values: npt.NDArray[np.float64], capacity: int) -> list[int]:
    """Optimal 0/1 knapsack on bucketed weights; returns positions into ``weights`` (given in canonical order).

    Candidates of equal weight form one group: of those, taking ``t`` means taking the ``t`` best (they appear in
    canonical order, best first), and at most ``capacity // weight`` can fit. Each group is then one vectorized
    step over every (count taken, capacity) pair, about 20 steps for 200 candidates instead of 200.
    """
    groups: dict[int, list[int]] = {}
    for i, w in enumerate(weights.tolist()):
        if w <= capacity:
            groups.setdefault(w, []).append(i)
    best = np.zeros(capacity + 1, dtype=np.float64)  # best[c]: best value within c buckets
    columns = np.arange(capacity + 1)
    steps: list[tuple[list[int], int, npt.NDArray[np.intp]]] = []
    for w, group in sorted(groups.items()):
        members = group[: capacity // w]
        m = len(members)
        gains = np.zeros(m + 1)
        np.cumsum(values[members], out=gains[1:])
        padded = np.full(m * w + capacity + 1, -np.inf)
        padded[m * w :] = best
        shifted = padded[columns[None, :] + (m - np.arange(m + 1))[:, None] * w]  # shifted[t, c] = best[c - t*w]
        shifted += gains[:, None]
        taken = shifted.argmax(axis=0)  # first maximum: fewest items on ties
        best = shifted[taken, columns]
        steps.append((members, w, taken))
    chosen: list[int] = []
    c = capacity
    for members, w, taken in reversed(steps):
        t = int(taken[c])
        chosen.extend(members[:t])
        c -= t * w
    return sorted(chosen)


def _dp_counted(
    weights: npt.NDArray[np.int64], values: npt.NDArray[np.float64], capacity: int, limit: int
) -> list[int]:
    """Optimal 0/1 knapsack on bucketed weights with at most ``limit`` items; returns positions into ``weights``."""
    n = len(weights)
    best = np.zeros((limit + 1, capacity + 1), dtype=np.float64)  # best[j, c]: at most j items within c buckets
    scratch = np.empty((limit, capacity + 1), dtype=np.float64)
    take = np.zeros((n, limit + 1, capacity + 1), dtype=np.bool_)
    for i in range(n):
        w = int(weights[i])
        if w > capacity:
            continue
        span = capacity + 1 - w
        with_item = np.add(best[:-1, :span], values[i], out=scratch[:, :span])
        np.greater(with_item, best[1:, w:], out=take[i, 1:, w:])
        np.maximum(best[1:, w:], with_item, out=best[1:, w:])
    chosen: list[int] = []
    j, c = limit, capacity
    for i in range(n - 1, -1, -1):
        if j == 0:
            break
        if take[i, j, c]:
            chosen.append(i)
            j -= 1
            c -= int(weights[i])
    chosen.reverse()
    return chosen


def _repair_and_refill(ordered: Sequence[PackCandidate], picked: list[int], budget: int, limit: int) -> list[int]:
    chosen = set(picked)
    used = sum(ordered[i].tokens for i in chosen)
    while used > budget:
        # Lowest score per token first; ties drop the later candidate in canonical order.
        worst = min(chosen, key=lambda i: (ordered[i].score / ordered[i].tokens, -i))
        chosen.remove(worst)
        used -= ordered[worst].tokens
    for i, c in enumerate(ordered):
        if len(chosen) >= limit:
            break
        if i not in chosen and c.tokens <= budget - used:
            chosen.add(i)
            used += c.tokens
    return sorted(chosen)


def _value(ordered: Sequence[PackCandidate], chosen: Sequence[int]) -> float:
    return math.fsum(ordered[i].score for i in chosen)


def pack_memories(
    candidates: Sequence[PackCandidate],
    budget: int,
    *,
    bucket: int = DEFAULT_BUCKET,
    cell_ceiling: int = DEFAULT_CELL_CEILING,
    max_items: int | None = None,
) -> PackResult:
    """Choose the candidates to place in context: the most total score whose exact tokens fit ``budget``.

    Never over budget, never worse than greedy by score, and the same result for any order of the same input.
    Raises ``ValueError`` for invalid candidates (see the module docstring) or negative arguments.
    """
    _validate(candidates, budget, bucket, max_items)
    ordered = sorted(candidates, key=lambda c: (-c.score, c.id))
    limit = len(ordered) if max_items is None else min(max_items, len(ordered))
    fitting = [i for i, c in enumerate(ordered) if c.tokens <= budget]
    path = PackPath.DP

    if sum(ordered[i].tokens for i in fitting) <= budget and len(fitting) <= limit:
        chosen = fitting
    else:
        counted = limit < len(fitting)
        pool = fitting[: MAX_ITEMS_PRETRIM * limit] if counted else fitting
        weights = np.array([max(1, (ordered[i].tokens + bucket // 2) // bucket) for i in pool], dtype=np.int64)
        capacity = min(budget // bucket, int(weights.sum()))
        if counted:
            capacity = min(capacity, int(np.sort(weights)[-limit:].sum()) if limit else 0)
        cells = len(pool) * (capacity + 1) * (limit + 1 if counted else 1)
        greedy = _greedy(ordered, budget, limit)
        if cells > cell_ceiling:
            path = PackPath.GREEDY
            chosen = greedy
        else:
            values = np.array([ordered[i].score for i in pool], dtype=np.float64)
            positions = (
                _dp_counted(weights, values, capacity, limit) if counted else _dp_plain(weights, values, capacity)
            )
            packed = _repair_and_refill(ordered, [pool[p] for p in positions], budget, limit)
            chosen = packed if _value(ordered, packed) >= _value(ordered, greedy) else greedy

    tokens = sum(ordered[i].tokens for i in chosen)
    taken = set(chosen)
    left_out = [c for i, c in enumerate(ordered) if i not in taken]
    excluded_for_budget = sum(1 for c in left_out if c.tokens > budget - tokens)
    return PackResult(
        chosen=tuple(ordered[i] for i in chosen),
        path=path,
        evaluated=len(ordered),
        excluded_for_budget=excluded_for_budget,
        budget_reached=excluded_for_budget > 0,
        tokens=tokens,
        value=_value(ordered, chosen),
        excluded_for_limit=len(left_out) - excluded_for_budget,
    )
