"""Conflict classification for the refinery's conflict stage (architecture section 9.2, stage 6).

Owns the :class:`ConflictClassifier` seam and the deterministic default. The refinery asks only when the interval
rule could not decide (validity overlaps, or a ``valid_from`` is missing); any exception or timeout from a
classifier is handled by the refinery, which then records the pair for review and changes nothing else.

The default classifier needs no model. On two memories of the same subject (the refinery only asks about close
neighbours) it decides, in this order:

1. they share most of their words (Jaccard >= 0.5) and one says it with a negation and the other without (``not``,
   ``no longer``, ``never``, ``n't``...): contradiction;
2. the new one says everything the old one says and more (its words are a strict superset): it specializes it;
3. both carry a ``valid_from``, the new one starts later and they say it in mostly the same words (Jaccard >= 0.5,
   "The user lives in Paris" / "... in Berlin"): it supersedes the old one. Without the shared wording a later
   start says nothing about the old memory: in a conversation most short turns are close neighbours of each other
   ("That's great!"), and superseding them would hide all but the last from search;
4. the same words with different numbers ("floor 3" / "floor 5"): contradiction;
5. similar enough (``overlap_similarity``): overlap; otherwise unrelated.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol


class Verdict(enum.StrEnum):
    CONTRADICTION = "contradiction"
    OVERLAP = "overlap"
    SUPERSEDES = "supersedes"
    SPECIALIZES = "specializes"
    UNRELATED = "unrelated"


@dataclass(frozen=True, slots=True)
class ConflictQuestion:
    """A new memory and an existing neighbour of it: redacted texts, their similarity and validity."""

    new_content: str
    old_content: str
    similarity: float
    new_valid_from: datetime | None
    new_valid_until: datetime | None
    old_valid_from: datetime | None
    old_valid_until: datetime | None


class ConflictClassifier(Protocol):
    async def classify(self, question: ConflictQuestion) -> Verdict: ...


_WORD = re.compile(r"[^\W_]+(?:'[^\W_]+)?", re.UNICODE)
_NUMBER = re.compile(r"^\d+(?:[.,]\d+)?$")
_NEGATIONS = frozenset({"not", "no", "never", "none", "nobody", "nothing", "neither", "nor", "cannot"})
_STOPWORDS = frozenset(
    [
        "a",
        "an",
        "the",
        "is",
        "are",
        "was",
        "were",
        "be",
        "been",
        "being",
        "am",
        "to",
        "of",
        "in",
        "on",
        "at",
        "for",
        "with",
        "by",
        "from",
        "as",
        "and",
        "or",
        "but",
        "it",
        "its",
        "this",
        "that",
        "these",
        "those",
        "he",
        "she",
        "they",
        "we",
        "you",
        "i",
        "my",
        "your",
        "his",
        "her",
        "their",
        "our",
        "has",
        "have",
        "had",
        "do",
        "does",
        "did",
        "will",
        "would",
        "shall",
        "should",
        "can",
        "could",
        "may",
        "might",
        "must",
        "so",
        "very",
        "just",
        "also",
        "too",
    ]
)


def _words(text: str) -> list[str]:
    return [w.casefold() for w in _WORD.findall(text)]


def _negated(words: list[str]) -> bool:
    return any(w in _NEGATIONS or w.endswith("n't") for w in words)


def _content_words(words: list[str]) -> frozenset[str]:
    return frozenset(w for w in words if w not in _STOPWORDS and w not in _NEGATIONS and not w.endswith("n't"))


class DeterministicClassifier:
    """The default: rules over words, numbers, negations and validity; the same inputs always give the same verdict."""

    def __init__(self, *, overlap_similarity: float = 0.85) -> None:
        self._overlap = overlap_similarity

    async def classify(self, question: ConflictQuestion) -> Verdict:
        return self.decide(question)

    def decide(self, q: ConflictQuestion) -> Verdict:
        new_words, old_words = _words(q.new_content), _words(q.old_content)
        new_set, old_set = _content_words(new_words), _content_words(old_words)
        shared = len(new_set & old_set) / max(len(new_set | old_set), 1)
        if shared >= 0.5 and _negated(new_words) != _negated(old_words):
            return Verdict.CONTRADICTION
        if old_set and old_set < new_set:
            return Verdict.SPECIALIZES
        if (
            shared >= 0.5
            and q.new_valid_from is not None
            and q.old_valid_from is not None
            and q.new_valid_from > q.old_valid_from
        ):
            return Verdict.SUPERSEDES
        new_numbers = {w for w in new_set if _NUMBER.match(w)}
        old_numbers = {w for w in old_set if _NUMBER.match(w)}
        if (
            (new_numbers or old_numbers)
            and new_numbers != old_numbers
            and new_set - new_numbers == old_set - old_numbers
        ):
            return Verdict.CONTRADICTION
        if q.similarity >= self._overlap:
            return Verdict.OVERLAP
        return Verdict.UNRELATED
