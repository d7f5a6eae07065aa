"""Rate-limit grants one proxy process holds: requests (and their tokens) counted in Redis ahead of time, drawn here.

Pure bookkeeping, no I/O: :class:`ibex_dataplane.proxy.ratelimit.RateLimiter` asks the admit script for a grant
when an agent is busy, draws later requests from it through this book, and gives back what was not drawn. A grant
belongs to one agent, one set of limits and one window; it is drawn from only before that window ends (less a
margin for the clock) and for at most ``seconds``, and never for more requests or tokens than it has left.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

CLOCK_MARGIN = 0.05
"""Seconds before the end of its window from which a grant is not drawn from: the window end was measured by the
Redis server a round trip ago."""


@dataclass(frozen=True)
class GrantSettings:
    """``requests``: a grant counts that many requests, and as many times the tokens of the request that asked.
    ``seconds``: an agent with two requests this close together is busy enough for a grant, and a grant is drawn
    from for at most this long before its rest goes back. ``reserve``: multiples of a grant every limited tier must
    keep free beside it."""

    requests: int
    seconds: float = 1.0
    reserve: int = 3

    def __post_init__(self) -> None:
        if self.requests < 2:
            raise ValueError("a grant must count at least 2 requests")
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


class GrantBook:
    """This process's grants, one per agent and limits."""

    def __init__(self, settings: GrantSettings) -> None:
        self.settings = settings
        self._grants: dict[Hashable, Grant] = {}
        self._seen: dict[Hashable, float] = {}

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
        return grant

    def low(self, key: Hashable) -> bool:
        """Whether the grant of ``key`` has a quarter of its requests left or fewer (time for the next one)."""
        grant = self._grants.get(key)
        return grant is not None and grant.requests <= self.settings.requests // 4

    def seen(self, key: Hashable, now: float) -> bool:
        """Note a request of ``key``; True when another came within ``seconds`` (busy enough for a grant)."""
        last = self._seen.get(key)
        self._seen[key] = now
        if len(self._seen) > 4 * len(self._grants) + 1024:  # forget agents idle for a while; the book stays small
            horizon = 2 * self.settings.seconds
            self._seen = {k: t for k, t in self._seen.items() if now - t < horizon}
        return last is not None and now - last < self.settings.seconds

    def add(self, grant: Grant) -> Grant | None:
        """Keep ``grant`` for its key; returns the grant it replaces, whose rest is to go back."""
        old = self._grants.get(grant.key)
        self._grants[grant.key] = grant
        return old

    def take(self, grant: Grant) -> bool:
        """Remove ``grant`` (its time is up); False when it was replaced or taken already."""
        if self._grants.get(grant.key) is not grant:
            return False
        del self._grants[grant.key]
        return True

    @property
    def open(self) -> int:
        return len(self._grants)

    def take_all(self) -> list[Grant]:
        grants = list(self._grants.values())
        self._grants.clear()
        return grants
