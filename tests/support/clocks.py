"""A clock a test moves by hand."""

from __future__ import annotations


class HandClock:
    """Seconds (since the epoch, or since any origin the test picks) that change only when the test sets ``now``."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
