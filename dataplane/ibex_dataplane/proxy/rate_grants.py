"""Rate-limit grants one proxy process holds: requests (and their tokens) counted in Redis ahead of time, drawn here.

Pure bookkeeping, no I/O: :class:`ibex_dataplane.proxy.ratelimit.RateLimiter` asks the admit script for a grant
when an agent is busy, draws later requests from it through this book, and gives back what was not drawn. A grant
belongs to one agent, one set of limits and one window; it is drawn from only before that window ends (less a
margin for the clock) and for at most ``seconds``, and never for more requests or tokens than it has left.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from ibex_dataplane.shared.pacing import Pacing, checked_most

CLOCK_MARGIN = 0.05
"""Seconds before the end of its window from which a grant is not drawn from: the window end was measured by the
Redis server a round trip ago."""


@dataclass(frozen=True)
class GrantSettings:
    """``requests``: a grant counts at least that many requests, and as many times the tokens of the request that
    asked. ``most``: and at most that many; between the two, an agent's grant counts what it drew in the last
    ``pace_seconds`` at the pace of its previous grant (0: ``requests``, always). ``seconds``: an agent with two
    requests this close together is busy enough for a grant, and a grant is drawn from for at most this long before
    its rest goes back. ``reserve``: multiples of a grant every limited tier must keep free beside it."""

    requests: int
    seconds: float = 1.0
    reserve: int = 3
    most: int = 0  # 0: ``requests``
    pace_seconds: float = 0.5

    def __post_init__(self) -> None:
        if self.requests < 2:
            raise ValueError("a grant must count at least 2 requests")
        object.__setattr__(self, "most", checked_most("a grant", self.requests, self.most, self.pace_seconds))
        if self.seconds <= 0:
            raise ValueError("grant seconds must be positive")
        if self.reserve < 0:
            raise ValueError("the grant reserve must not be negative")


@dataclass(eq=False)
class Grant:
    key: Hashable  # agent and limits
    window: int
    requests: int  # left to draw
    tokens: int  # left to draw
    limit: int | None  # of the tightest request tier, for X-RateLimit-Limit
    remaining: int | None  # that tier's requests left beside the whole grant when it was counted
    window_ends: float  # local clock
    drawn_until: float  # local clock
    size: int = 0  # requests counted for it (a quarter of it left: time for the next one)
    placed_at: float = 0.0  # local clock
    draws: int = 0  # requests drawn from it: its agent's pace


class GrantBook:
    """This process's grants, one per agent and limits."""

    def __init__(self, settings: GrantSettings) -> None:
        self.settings = settings
        self._grants: dict[Hashable, Grant] = {}
        self._seen: dict[Hashable, float] = {}
        self._pacing = Pacing(settings.requests, settings.most, settings.pace_seconds, settings.seconds)

    def draw(self, key: Hashable, tokens: int, now: float) -> Grant | None:
        """Take one request of ``tokens`` from the grant of ``key``, or None when it has not enough or may not be
        drawn from any more."""
        grant = self._grants.get(key)
        if grant is None or grant.requests < 1 or grant.tokens < tokens:
            return None
        if now >= grant.drawn_until or now >= grant.window_ends - CLOCK_MARGIN:
            return None
        grant.requests -= 1
        grant.tokens -= tokens
        grant.draws += 1
        return grant

    def low(self, key: Hashable, now: float) -> bool:
        """Whether the grant of ``key`` has a quarter of its requests left or fewer: time for the next one, whose
        size this grant's pace so far decides."""
        grant = self._grants.get(key)
        if grant is None or grant.requests > (grant.size or self.settings.requests) // 4:
            return False
        self._pacing.note(key, grant.draws, now - grant.placed_at)
        return True

    def requests_for(self, key: Hashable, now: float) -> int:
        """How many requests the next grant of ``key`` counts: what the agent drew in ``pace_seconds`` at the pace
        of its last grant, within ``requests`` and ``most``. A busy agent's grant lasts while its next one is
        counted, however many requests arrive at once; a quiet agent's holds little of a limit."""
        return self._pacing.size(key, now)

    def refused(self, key: Hashable, requests: int, now: float) -> None:
        """A grant of ``requests`` for ``key`` did not fit beside a limit: after a larger one than the settings'
        ``requests``, the agent's grants count just those for ``seconds``."""
        self._pacing.refused(key, requests, now)

    def seen(self, key: Hashable, now: float) -> bool:
        """Note a request of ``key``; True when another came within ``seconds`` (busy enough for a grant)."""
        last = self._seen.get(key)
        self._seen[key] = now
        if len(self._seen) > 4 * len(self._grants) + 1024:  # forget agents idle for a while; the book stays small
            horizon = 2 * self.settings.seconds
            self._seen = {k: t for k, t in self._seen.items() if now - t < horizon}
            self._pacing.forget(now, lambda k: k in self._seen or k in self._grants)
        return last is not None and now - last < self.settings.seconds

    def add(self, grant: Grant) -> Grant | None:
        """Keep ``grant`` for its key; returns the grant it replaces, whose rest is to go back."""
        old = self._grants.get(grant.key)
        self._grants[grant.key] = grant
        return old

    def take(self, grant: Grant, now: float) -> bool:
        """Remove ``grant`` (its time is up: its pace sizes the next one); False when it was replaced or taken
        already."""
        if self._grants.get(grant.key) is not grant:
            return False
        del self._grants[grant.key]
        self._pacing.note(grant.key, grant.draws, now - grant.placed_at)
        return True

    @property
    def open(self) -> int:
        return len(self._grants)

    def take_all(self) -> list[Grant]:
        grants = list(self._grants.values())
        self._grants.clear()
        return grants
