"""The learned order of memory search: a linear model over features of one query's candidates.

The evidence of :mod:`~ibex_dataplane.memory.evidence` is a hand-made sum on absolute scales, good at telling a real
match from junk (the floor judges it) but not at ordering real matches. The ranker scores every candidate of the
query with ``w . (x - mean) / scale`` (those below the floor too, as in training: they are part of what "the best
of the query" means; the search then keeps only those that passed), where ``x`` holds :data:`FEATURES`: each leg's
evidence and raw score relative to the best of the query, its rank in each leg, the fused evidence and what the
candidate's neighbours and session hold, whether it starts with or holds a name the query mentions, whether a
period the query names holds it, its length, whether it is a question. The score becomes the ``relevance``
component by a fixed linear map (``lo`` -> 0, ``hi`` -> 1, clipped), so the composite score can order the answer
(see :meth:`Ranker.relevance`).

The weights are data, not code: ``ranker.json`` beside this module, written by ``bench/train_ranker.py`` (pairwise
logistic loss over the candidates of real searches on the LoCoMo development split, evaluated leave one
conversation out first) with the commit, data and cross-validated recall that produced them. Features and weights
are matched by name, so a weight file for other features is refused at load.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import numpy as np

from ibex_dataplane.memory.evidence import Period, by_session, holds_a_name, neighbours, starts_with_a_name
from ibex_dataplane.memory.repository import SearchRow
from ibex_dataplane.memory.tuning import SearchTuning

FEATURES: tuple[str, ...] = (
    "vector_evidence",  # cosine on the absolute scale of the evidence
    "term_evidence",  # BM25 + weighted SPLADE on the absolute scale
    "bm25_evidence",  # BM25 alone on that scale
    "splade_evidence",  # SPLADE alone on that scale
    "similarity_of_best",  # cosine / the best cosine of the query's candidates
    "bm25_of_best",
    "splade_of_best",
    "vector_rank",  # 1 / (1 + rank) among the candidates, 0 when the leg did not find it
    "bm25_rank",
    "splade_rank",
    "fused",  # vector_weight x vector evidence + text_weight x term evidence
    "fused_of_best",
    "neighbour",  # best fused of a turn within neighbour_seconds in the same session
    "neighbour_before",
    "neighbour_after",
    "session_best",  # best fused among the candidates of the same session
    "session_best_of_best",
    "session_candidates",  # log(1 + candidates of the same session)
    "holds_name",  # holds a name the query mentions
    "starts_with_name",  # its first word is such a name (it is said by, or about, that person)
    "in_period",  # valid from, or observed, inside a period the query names
    "length",  # log(1 + whitespace-separated words) / 5
    "is_question",  # ends with "?"
    "has_question",  # holds a "?"
    "query_terms",  # query lexemes it holds / 5
)


class RankerError(ValueError):
    """A weight file that does not fit these features."""


Vector = np.ndarray[Any, np.dtype[np.float64]]


def _column(values: Sequence[float | None]) -> Vector:
    """The values, missing ones as 0."""
    return np.array([0.0 if v is None else v for v in values], dtype=np.float64)


def _ranks(values: Sequence[float | None]) -> Vector:
    """1 / (1 + rank) by decreasing value (ties in the order given); 0 where the value is missing."""
    present = np.array([v is not None for v in values])
    keyed = np.where(present, _column(values), -np.inf)
    order = np.argsort(-keyed, kind="stable")
    out = np.empty(len(values))
    out[order] = 1.0 / (1.0 + np.arange(len(values)))
    return np.where(present, out, 0.0)


def _of_best(values: Vector) -> Vector:
    best = float(values.max(initial=0.0))
    return values / best if best > 0 else values


def _curve(total: Vector, half: float) -> Vector:
    """``s / (s + half)`` where ``s > 0``, else 0 (the term evidence scale)."""
    positive = np.maximum(total, 0.0)
    return np.where(positive > 0, positive / (positive + half), 0.0)


def features(
    rows: Sequence[SearchRow],
    tuning: SearchTuning,
    periods: Sequence[Period] = (),
    names: frozenset[str] = frozenset(),
) -> Vector:
    """One row of :data:`FEATURES` per candidate, in the order given."""
    t = tuning
    n = len(rows)
    if n == 0:
        return np.zeros((0, len(FEATURES)))
    similarity = [r.similarity for r in rows]
    bm25 = _column([r.text_score for r in rows])
    splade = t.sparse_weight * _column([r.sparse_score for r in rows])
    span = t.similarity_full - t.similarity_zero
    vector = np.where(
        [s is not None for s in similarity], np.clip((_column(similarity) - t.similarity_zero) / span, 0.0, 1.0), 0.0
    )
    term = _curve(bm25 + splade, t.text_half)
    fused = t.vector_weight * vector + t.text_weight * term

    near, before, after = np.zeros(n), np.zeros(n), np.zeros(n)
    session_best, session_size = np.zeros(n), np.zeros(n)
    for members in by_session(rows):
        best = max(fused[i] for i in members)
        for i in members:
            session_best[i], session_size[i] = best, len(members)
        for i, j, gap in neighbours(rows, members, t.neighbour_seconds):
            near[i] = max(near[i], fused[j])
            if gap < 0:
                before[i] = max(before[i], fused[j])
            else:
                after[i] = max(after[i], fused[j])
    top = float(fused.max(initial=0.0))

    contents = [(r.memory.content or "").rstrip() for r in rows]
    holds_name, starts_with_name, in_period = np.zeros(n), np.zeros(n), np.zeros(n)
    if names:
        for i, content in enumerate(contents):
            holds_name[i] = holds_a_name(content, names)
            starts_with_name[i] = holds_name[i] and starts_with_a_name(content, names)
    if periods:
        for i, r in enumerate(rows):
            in_period[i] = any(p.holds(r.memory.valid_from) or p.holds(r.memory.observed_at) for p in periods)
    columns = (
        vector, term, _curve(bm25, t.text_half), _curve(splade, t.text_half),
        _of_best(_column(similarity)), _of_best(bm25), _of_best(splade),
        _ranks(similarity), _ranks([r.text_score for r in rows]), _ranks([r.sparse_score for r in rows]),
        fused, _of_best(fused), near, before, after, session_best, session_best / top if top > 0 else session_best,
        np.log1p(session_size), holds_name, starts_with_name, in_period,
        np.log1p([len(c.split()) for c in contents]) / 5,
        np.array([c.endswith("?") for c in contents], dtype=np.float64),
        np.array(["?" in c for c in contents], dtype=np.float64),
        np.array([r.text_terms for r in rows], dtype=np.float64) / 5.0,
    )  # fmt: skip
    return np.stack(columns, axis=1)


@dataclass(frozen=True)
class Ranker:
    """``w . (x - mean) / scale`` per candidate; :meth:`relevance` maps scores to [0, 1]."""

    weights: Vector
    mean: Vector
    scale: Vector
    lo: float
    hi: float
    provenance: Mapping[str, Any]

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Ranker:
        try:
            names = list(data["features"])
            if sorted(names) != sorted(FEATURES) or len(names) != len(FEATURES):
                raise RankerError(f"the weights are for other features: {sorted(set(names) ^ set(FEATURES))}")
            position = {name: i for i, name in enumerate(names)}

            def ordered(key: str) -> Vector:
                values = [float(data[key][position[name]]) for name in FEATURES]
                return np.array(values, dtype=np.float64)

            scale = ordered("scale")
            lo, hi = float(data["lo"]), float(data["hi"])
        except (KeyError, TypeError, IndexError) as e:
            raise RankerError(f"not a ranker weight file: {type(e).__name__} {e}") from e
        if not (np.all(scale > 0) and hi > lo):
            raise RankerError("every scale must be positive and hi above lo")
        return cls(ordered("weights"), ordered("mean"), scale, lo, hi, dict(data.get("provenance") or {}))

    def to_json(self) -> dict[str, Any]:
        return {
            "features": list(FEATURES),
            "weights": [round(float(w), 6) for w in self.weights],
            "mean": [round(float(m), 6) for m in self.mean],
            "scale": [round(float(s), 6) for s in self.scale],
            "lo": round(self.lo, 6),
            "hi": round(self.hi, 6),
            "provenance": dict(self.provenance),
        }

    def scores(self, x: Vector) -> Vector:
        result: Vector = ((x - self.mean) / self.scale) @ self.weights
        return result

    def relevance(self, scores: Vector) -> Vector:
        """A fixed linear map, the same for every query: ``lo`` (the median score of the training candidates) is 0,
        ``hi`` (their 99.9th percentile) is 1. Linear so that the composite's other components, worth at most a
        few tenths, reorder only near-equal candidates."""
        mapped: Vector = np.clip((scores - self.lo) / (self.hi - self.lo), 0.0, 1.0)
        return mapped


@cache
def default_ranker() -> Ranker:
    """The weights shipped with the package (``ranker.json``)."""
    text = resources.files("ibex_dataplane.memory").joinpath("ranker.json").read_text(encoding="utf-8")
    return Ranker.from_json(json.loads(text))
