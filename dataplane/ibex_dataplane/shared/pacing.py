"""How many requests the next budget lease or rate-limit grant of an agent covers: pure bookkeeping, no I/O.

Budget leases (:mod:`ibex_dataplane.shared.budget_leases`) and rate-limit grants
(:mod:`ibex_dataplane.proxy.rate_grants`) both count many requests of one agent ahead, in one store round trip. A busy
agent should take few, large ones (each is a round trip, a lease also a commit); a quiet one small ones (each keeps
part of a limit from the other replicas while it is not used). So the next one covers what the agent drew in
``pace_seconds`` at the pace of its previous one, between ``least`` and ``most``; after one larger than ``least`` did
not fit beside a limit, the agent's next ones cover ``least`` again for ``shrink_seconds``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable


def checked_most(what: str, least: int, most: int, pace_seconds: float) -> int:
    """The ``most`` of ``what``'s settings (0: ``least``), checked with its ``pace_seconds``."""
    most = most or least
    if most < least:
        raise ValueError(f"the most requests {what} covers must not be fewer than its requests")
    if pace_seconds < 0:
        raise ValueError(f"{what}'s pace seconds must not be negative")
    return most


class Pacing:
    """Each key's pace (draws per second of its last lease or grant) and when a larger one last did not fit."""

    def __init__(self, least: int, most: int, pace_seconds: float, shrink_seconds: float) -> None:
        self._least = least
        self._most = most
        self._pace_seconds = pace_seconds
        self._shrink_seconds = shrink_seconds
        self._pace: dict[Hashable, float] = {}
        self._shrunk: dict[Hashable, float] = {}

    def note(self, key: Hashable, draws: int, age: float) -> None:
        """``draws`` requests drew from the lease or grant of ``key`` in its ``age`` seconds."""
        if draws:
            self._pace[key] = draws / max(age, 1e-3)

    def size(self, key: Hashable, now: float) -> int:
        """How many requests the next lease or grant of ``key`` covers."""
        pace = self._pace.get(key)
        shrunk = self._shrunk.get(key)
        if pace is None or (shrunk is not None and now - shrunk < self._shrink_seconds):
            return self._least
        return max(self._least, min(self._most, math.ceil(pace * self._pace_seconds)))

    def refused(self, key: Hashable, size: int, now: float) -> bool:
        """One of ``size`` requests for ``key`` did not fit. True when it was larger than ``least``: the next ones
        cover ``least`` for ``shrink_seconds``; False when it was of ``least`` already (the caller's to handle)."""
        if size <= self._least:
            return False
        self._shrunk[key] = now
        return True

    def forget(self, now: float, active: Callable[[Hashable], bool]) -> None:
        """Drop marks that no longer change a size, and the pace of keys no longer ``active``."""
        for key in [k for k, t in self._shrunk.items() if now - t >= self._shrink_seconds]:
            del self._shrunk[key]
        for key in [k for k in self._pace if not active(k)]:
            del self._pace[key]
