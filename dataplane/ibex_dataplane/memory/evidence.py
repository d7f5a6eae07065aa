"""Evidence that a memory answers a query, on absolute scales: what the relevance floor judges.

Pure functions of one query's candidates (:class:`~ibex_dataplane.memory.repository.SearchRow`, every leg's raw
score):

1. fusion: each leg's evidence on an absolute scale (cosine between ``similarity_zero`` and ``similarity_full``;
   term evidence ``s / (s + text_half)`` with ``s`` = BM25 + ``sparse_weight`` x SPLADE dot product), weighted and
   summed, plus a bonus when both agree;
2. time: a query naming a day, a month or a year lifts memories whose validity starts inside it;
   names: a memory holding a name the query mentions (a capitalized word not starting a sentence) is lifted;
3. neighbours: a memory observed within ``neighbour_seconds`` of a strong hit in the same session, and every
   memory of a session that holds strong hits, is lifted by a share of their evidence (turns of one conversation
   explain each other: a question matches a reply, the fact sits in the turn before).

The search drops candidates whose evidence is below the floor, so junk finds nothing; the learned ranker
(:mod:`~ibex_dataplane.memory.ranker`) orders the rest and reuses these pieces as its features.
"""

from __future__ import annotations

import calendar
import re
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import lru_cache

from ibex_dataplane.memory.models import Memory
from ibex_dataplane.memory.repository import SearchRow
from ibex_dataplane.memory.tuning import SearchTuning

_MONTHS = {name.lower(): i for i, name in enumerate(calendar.month_name) if name} | {
    name.lower(): i for i, name in enumerate(calendar.month_abbr) if name
}
_MONTH = "|".join(sorted(_MONTHS, key=len, reverse=True))
_DAY_MONTH_YEAR = re.compile(rf"\b(\d{{1,2}})(?:st|nd|rd|th)?\s+({_MONTH})\.?,?\s+((?:19|20)\d\d)\b", re.I)
_MONTH_DAY_YEAR = re.compile(rf"\b({_MONTH})\.?\s+(\d{{1,2}})(?:st|nd|rd|th)?,?\s+((?:19|20)\d\d)\b", re.I)
_MONTH_YEAR = re.compile(rf"\b({_MONTH})\.?,?\s+(?:of\s+)?((?:19|20)\d\d)\b", re.I)
_ISO_DATE = re.compile(r"\b((?:19|20)\d\d)-(\d\d)-(\d\d)\b")
_YEAR = re.compile(r"\b((?:19|20)\d\d)\b")


@dataclass(frozen=True, slots=True)
class Period:
    """A half-open stretch of time a query names: [start, end)."""

    start: datetime
    end: datetime

    def holds(self, instant: datetime | None) -> bool:
        return instant is not None and self.start <= instant < self.end


def _month(year: int, month: int) -> Period:
    start = datetime(year, month, 1, tzinfo=UTC)
    end = datetime(year + (month == 12), month % 12 + 1, 1, tzinfo=UTC)
    return Period(start, end)


def _day(year: int, month: int, day: int) -> Period | None:
    try:
        start = datetime(year, month, day, tzinfo=UTC)
    except ValueError:
        return None
    # A day spoken of is a day somewhere: a day either side covers every time zone and "the night before".
    return Period(start - timedelta(days=1), start + timedelta(days=2))


def periods_named(query: str) -> list[Period]:
    """The days, months and years a query names explicitly ("on 8 May 2023", "in June 2022", "2021")."""
    found: list[Period] = []
    spans: list[tuple[int, int]] = []

    def take(match: re.Match[str], period: Period | None) -> None:
        if period is not None and not any(a < match.end() and match.start() < b for a, b in spans):
            found.append(period)
            spans.append((match.start(), match.end()))

    for m in _ISO_DATE.finditer(query):
        take(m, _day(int(m.group(1)), int(m.group(2)), int(m.group(3))))
    for m in _DAY_MONTH_YEAR.finditer(query):
        take(m, _day(int(m.group(3)), _MONTHS[m.group(2).lower()], int(m.group(1))))
    for m in _MONTH_DAY_YEAR.finditer(query):
        take(m, _day(int(m.group(3)), _MONTHS[m.group(1).lower()], int(m.group(2))))
    for m in _MONTH_YEAR.finditer(query):
        take(m, _month(int(m.group(2)), _MONTHS[m.group(1).lower()]))
    for m in _YEAR.finditer(query):
        year = int(m.group(1))
        take(m, Period(datetime(year, 1, 1, tzinfo=UTC), datetime(year + 1, 1, 1, tzinfo=UTC)))
    return found


_CAPITALIZED = re.compile(r"\b([A-Z][A-Za-z]+)\b")
_SENTENCE_START = re.compile(r"(?:^|[.?!:;\"(]\s*)$")


def names_in(query: str) -> frozenset[str]:
    """Capitalized words of the query that do not start a sentence: names ("What did Maria paint?" -> Maria)."""
    found = set()
    for m in _CAPITALIZED.finditer(query):
        if not _SENTENCE_START.search(query[: m.start()]):
            found.add(m.group(1))
    return frozenset(found)


@lru_cache(maxsize=1024)
def _name_patterns(names: frozenset[str]) -> tuple[re.Pattern[str], re.Pattern[str]]:
    """A name counts as a whole run of letters: "Maria's" holds Maria, "Marianne" does not."""
    alternatives = "|".join(re.escape(name) for name in sorted(names))
    anywhere = re.compile(rf"(?<![A-Za-z])(?:{alternatives})(?![A-Za-z])")
    first = re.compile(rf"[^A-Za-z]*(?:{alternatives})(?![A-Za-z])")
    return anywhere, first


def holds_a_name(content: str, names: frozenset[str]) -> bool:
    """The text holds one of the names as a word."""
    return bool(names) and _name_patterns(names)[0].search(content) is not None


def starts_with_a_name(content: str, names: frozenset[str]) -> bool:
    """The text's first word is one of the names ("Maria: I painted...")."""
    return bool(names) and _name_patterns(names)[1].match(content) is not None


def vector_evidence(similarity: float | None, t: SearchTuning) -> float:
    if similarity is None:
        return 0.0
    return max(0.0, min(1.0, (similarity - t.similarity_zero) / (t.similarity_full - t.similarity_zero)))


def text_evidence(score: float | None, t: SearchTuning, sparse: float | None = None) -> float:
    """BM25 plus ``sparse_weight`` times the SPLADE dot product, on the scale ``s / (s + text_half)``."""
    total = (score or 0.0) + t.sparse_weight * (sparse or 0.0)
    if total <= 0:
        return 0.0
    return total / (total + t.text_half)


def observed(memory: Memory) -> datetime:
    """When a memory was said: ``observed_at``, else the start of its validity, else its write time."""
    return memory.observed_at or memory.valid_from or memory.created_at


NEIGHBOURHOOD = 8  # turns either side, in observed order, looked at for a neighbour


def by_session(rows: Sequence[SearchRow]) -> list[list[int]]:
    """The candidates (indexes, in the order given) of each session; candidates without a session in none."""
    sessions: dict[str, list[int]] = defaultdict(list)
    for i, row in enumerate(rows):
        if row.memory.session_id is not None:
            sessions[row.memory.session_id].append(i)
    return list(sessions.values())


def neighbours(rows: Sequence[SearchRow], members: Sequence[int], window: float) -> Iterator[tuple[int, int, float]]:
    """``(i, j, seconds from i to j)`` for each candidate ``i`` of one session and each other candidate ``j`` of it
    observed within ``window`` seconds, among the :data:`NEIGHBOURHOOD` either side in observed order."""
    at = {i: observed(rows[i].memory).timestamp() for i in members}
    ordered = sorted(members, key=at.__getitem__)
    for pos, i in enumerate(ordered):
        for j in ordered[max(0, pos - NEIGHBOURHOOD) : pos + NEIGHBOURHOOD + 1]:
            gap = at[j] - at[i]
            if j != i and -window <= gap <= window:
                yield i, j, gap


def evidence_of(
    rows: Sequence[SearchRow],
    tuning: SearchTuning,
    periods: Sequence[Period] = (),
    names: frozenset[str] = frozenset(),
) -> list[float]:
    """Evidence in [0, 1] that each candidate answers the query, in the order given (the floor is the caller's)."""
    t = tuning
    own: list[float] = []
    named: list[bool] = []
    for row in rows:
        v, x = vector_evidence(row.similarity, t), text_evidence(row.text_score, t, row.sparse_score)
        fused = t.vector_weight * v + t.text_weight * x + (t.agreement_bonus if v > 0 and x > 0 else 0.0)
        if periods and any(p.holds(row.memory.valid_from) or p.holds(row.memory.observed_at) for p in periods):
            fused += t.time_weight
        own.append(fused)
        named.append(holds_a_name(row.memory.content or "", names))
    lifted = list(own)
    if t.neighbour_weight > 0 or t.session_weight > 0:
        for members in by_session(rows):
            best = max(own[i] for i in members)
            near = dict.fromkeys(members, 0.0)
            for i, j, _ in neighbours(rows, members, t.neighbour_seconds):
                near[i] = max(near[i], own[j])
            for i in members:
                lifted[i] += t.neighbour_weight * near[i] + t.session_weight * best
    # Names are the sharpest words of a question, yet a name an agent hears often has a low idf in BM25.
    lifted = [r + (t.name_weight if n else 0.0) for r, n in zip(lifted, named, strict=True)]
    return [max(0.0, min(1.0, r)) for r in lifted]
