"""A per-provider circuit breaker.

Owned by each network provider adapter (``openai_compat``): consecutive upstream failures (connection errors,
5xx, timeouts, broken streams) open it for a cool-down, during which calls fail fast with
``PROVIDER_UNAVAILABLE`` instead of piling onto a sick upstream. After the cool-down one probe call is let
through (half-open): success closes the breaker, failure opens it for another cool-down. A probe that never
reports back (its caller was cancelled) stops blocking others after one more cool-down.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable

__all__ = ["BreakerState", "CircuitBreaker"]


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Consecutive-failure breaker; not thread-safe (one event loop owns it)."""

    def __init__(
        self,
        *,
        failure_threshold: int = 5,
        cooldown: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failure_threshold < 1 or cooldown <= 0:
            raise ValueError("failure_threshold must be >= 1 and cooldown > 0")
        self._threshold = failure_threshold
        self._cooldown = cooldown
        self._clock = clock
        self._failures = 0
        self._opened_at: float | None = None
        self._probe_started: float | None = None

    @property
    def state(self) -> BreakerState:
        if self._opened_at is None:
            return BreakerState.CLOSED
        if self._clock() - self._opened_at < self._cooldown:
            return BreakerState.OPEN
        return BreakerState.HALF_OPEN

    def allow(self) -> float | None:
        """``None`` if a call may proceed now, else the seconds until one may."""
        if self._opened_at is None:
            return None
        now = self._clock()
        reopen = self._opened_at + self._cooldown
        if now < reopen:
            return reopen - now
        if self._probe_started is not None and now - self._probe_started < self._cooldown:
            return self._probe_started + self._cooldown - now
        self._probe_started = now
        return None

    def record_success(self) -> None:
        self._failures = 0
        self._opened_at = None
        self._probe_started = None

    def record_failure(self) -> None:
        self._probe_started = None
        if self._opened_at is not None:
            self._opened_at = self._clock()  # a failed probe (or a straggler) restarts the cool-down
            return
        self._failures += 1
        if self._failures >= self._threshold:
            self._opened_at = self._clock()
