"""How many active memories each agent holds, as BM25's idf needs it, counted at most once per ``ttl`` seconds.

The text leg's idf divides by the agent's memory count N. Counting it is a scan of the agent's active rows (up to a
cap): at 10,000 memories about half of the text statement's time, for a figure that moves by a few memories a
minute and matters only to its order of magnitude (a term's idf is ``ln(1 + (N - df + 0.5) / (df + 0.5))``). So
the memory stage keeps each agent's last count for ``ttl`` seconds (default 60) and the statement takes it as a
parameter. Keyed by organization and agent: one tenant's count is never used for another. At most ``size`` agents
are kept, least recently used out first.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from uuid import UUID


class Populations:
    def __init__(self, *, ttl: float = 60.0, size: int = 10_000, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl < 0 or size < 0:
            raise ValueError("the population cache's ttl and size cannot be negative")
        self._ttl = ttl
        self._size = size
        self._clock = clock
        self._entries: OrderedDict[tuple[UUID, UUID], tuple[float, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, org_id: UUID, agent_id: UUID) -> int | None:
        """The agent's count if one was kept less than ``ttl`` seconds ago."""
        key = (org_id, agent_id)
        found = self._entries.get(key)
        if found is None:
            return None
        counted_at, count = found
        if self._clock() - counted_at >= self._ttl:
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return count

    def put(self, org_id: UUID, agent_id: UUID, count: int) -> None:
        if self._size == 0 or self._ttl == 0:
            return
        key = (org_id, agent_id)
        self._entries[key] = (self._clock(), count)
        self._entries.move_to_end(key)
        while len(self._entries) > self._size:
            self._entries.popitem(last=False)
