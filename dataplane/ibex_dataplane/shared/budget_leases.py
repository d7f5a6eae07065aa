"""The budget leases one process holds (docs/budget-leases.md): what each has left to draw, and when it goes back.

Pure bookkeeping, no I/O and no awaits: :class:`ibex_dataplane.shared.budget.BudgetService` places leases in
Postgres, draws from them through this book, and returns a lease's remainder once the book says it is retired and
its last draw is done. A lease is drawn from only by the agent and month it was placed for, under the policy it was
placed under, while younger than ``seconds``; a draw never takes more than the lease has left.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from datetime import date
from decimal import Decimal
from uuid import UUID

from ibex_dataplane.shared.pacing import Pacing, checked_most

LeaseKey = tuple[UUID, UUID, date]  # org, agent, budget period


@dataclass(frozen=True)
class LeaseSettings:
    """How this process leases. ``requests``: a lease covers at least that many times the worst case of the request
    that asks for it. ``most``: and at most that many; between the two, an agent's lease covers what it drew in the
    last ``pace_seconds`` at its pace (0: ``requests``, always). ``seconds``: no draws from a lease older than this,
    and no leases for an agent that long after a lease of ``requests`` was refused. ``reserve``: multiples of a
    lease that every limited scope must keep free beside it."""

    requests: int
    seconds: float = 5.0
    reserve: int = 3
    most: int = 0  # 0: ``requests``
    pace_seconds: float = 0.5

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise ValueError("a lease must cover at least one request")
        object.__setattr__(self, "most", checked_most("a lease", self.requests, self.most, self.pace_seconds))
        if self.seconds <= 0:
            raise ValueError("lease seconds must be positive")
        if self.reserve < 0:
            raise ValueError("the lease reserve must not be negative")


@dataclass(eq=False)
class Lease:
    """One lease: a durable hold of ``amount`` of which ``balance`` is not drawn yet."""

    id: UUID
    key: LeaseKey
    policy: Hashable  # the budget policy it was placed under
    amount: Decimal
    placed_at: float
    balance: Decimal = field(init=False)
    outstanding: int = 0  # draws whose settle or release has not been reported
    draws: int = 0  # how many requests drew from it: its agent's pace
    retired: bool = False  # drawn from no more
    returned: bool = False  # its remainder is on its way back (or back)

    def __post_init__(self) -> None:
        self.balance = self.amount


class LeaseBook:
    """Every lease of this process, by agent and month."""

    def __init__(self, settings: LeaseSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._clock = clock
        self._leases: dict[LeaseKey, list[Lease]] = {}
        self._by_id: dict[UUID, Lease] = {}
        self._seen: dict[LeaseKey, float] = {}  # when the agent last asked for a hold
        self._refused: dict[LeaseKey, float] = {}  # when a lease of ``requests`` for it was last refused
        # The pace of its last lease that ran low or went back, and when a larger lease was last refused for it.
        self._pacing = Pacing(settings.requests, settings.most, settings.pace_seconds, settings.seconds)

    def draw(self, key: LeaseKey, policy: Hashable, amount: Decimal) -> tuple[Lease | None, list[Lease]]:
        """Take ``amount`` from a live lease of ``key`` placed under ``policy`` (None when none has enough), and
        the leases to return now: those that aged or were placed under another policy are retired on the way."""
        now = self._clock()
        drawn = None
        retired = []
        for lease in self._leases.get(key, ()):
            if lease.retired:
                continue
            if lease.policy != policy or now - lease.placed_at >= self.settings.seconds:
                lease.retired = True
                retired.append(lease)
            elif drawn is None and lease.balance >= amount:
                lease.balance -= amount
                lease.outstanding += 1
                lease.draws += 1
                drawn = lease
                if lease.balance < amount:  # spent for requests like this one: it goes back after its last draw
                    lease.retired = True
        return drawn, [lease for lease in retired if self._returnable(lease)]

    def now(self) -> float:
        return self._clock()

    def seen(self, key: LeaseKey) -> bool:
        """Note a hold for ``key``; True when it is busy enough for a lease: another hold came within ``seconds``
        and no lease was refused for it in that time."""
        now = self._clock()
        last = self._seen.get(key)
        self._seen[key] = now
        if self._refusing(key):
            return False
        return last is not None and now - last < self.settings.seconds

    def low(self, lease: Lease) -> bool:
        """True when ``lease`` has less than a quarter left and is its agent's last live lease: time to place the
        next one (once: the next one is live as soon as it is placed; never while the agent is refused leases)."""
        if lease.balance * 4 >= lease.amount:
            return False
        if any(other is not lease and not other.retired for other in self._leases.get(lease.key, ())):
            return False
        if self._refusing(lease.key):
            return False
        self._note_pace(lease)
        return True

    def add(self, lease: Lease) -> None:
        self._leases.setdefault(lease.key, []).append(lease)
        self._by_id[lease.id] = lease

    def requests_for(self, key: LeaseKey) -> int:
        """How many worst cases the next lease of ``key`` covers: what the agent drew in ``pace_seconds`` at the pace
        of its last lease, within ``requests`` and ``most``. A busy agent places fewer, larger leases (each is a
        round trip and a commit); a quiet one keeps small ones, which hold little of a budget."""
        return self._pacing.size(key, self._clock())

    def refused(self, key: LeaseKey, requests: int) -> None:
        """A lease of ``requests`` for ``key`` was refused. After a larger one than the settings' ``requests``, the
        agent's leases cover just those for ``seconds``; after one of that size, it takes none for ``seconds``."""
        now = self._clock()
        if not self._pacing.refused(key, requests, now):
            self._refused[key] = now

    def _refusing(self, key: LeaseKey) -> bool:
        refused = self._refused.get(key)
        return refused is not None and self._clock() - refused < self.settings.seconds

    def _note_pace(self, lease: Lease) -> None:
        self._pacing.note(lease.key, lease.draws, self._clock() - lease.placed_at)

    def lease(self, lease_id: UUID) -> Lease | None:
        return self._by_id.get(lease_id)

    def done(self, lease_id: UUID) -> Lease | None:
        """A draw of ``lease_id`` was settled or released. Returns the lease when it is now to be returned."""
        lease = self._by_id.get(lease_id)
        if lease is None:
            return None
        lease.outstanding = max(0, lease.outstanding - 1)
        return self._returnable(lease)

    def retire(self, lease_id: UUID) -> Lease | None:
        """Draw from ``lease_id`` no more. Returns the lease when it is now to be returned."""
        lease = self._by_id.get(lease_id)
        if lease is None:
            return None
        lease.retired = True
        return self._returnable(lease)

    def retire_all(self) -> list[Lease]:
        """Retire every lease (shutdown); returns those to be returned now."""
        out = []
        for lease_id in list(self._by_id):
            lease = self.retire(lease_id)
            if lease is not None:
                out.append(lease)
        return out

    def _returnable(self, lease: Lease) -> Lease | None:
        if not lease.retired or lease.outstanding or lease.returned:
            return None
        lease.returned = True
        self._note_pace(lease)
        del self._by_id[lease.id]
        leases = self._leases[lease.key]
        leases.remove(lease)
        if not leases:
            del self._leases[lease.key]
        self._forget_idle()
        return lease

    def _forget_idle(self) -> None:
        """Drop what is remembered about agents that have been idle for a while, so the book stays small."""
        now = self._clock()
        horizon = 2 * self.settings.seconds
        for marks in (self._seen, self._refused):
            for key in [k for k, t in marks.items() if now - t >= horizon and k not in self._leases]:
                del marks[key]
        self._pacing.forget(now, lambda k: k in self._seen or k in self._leases)

    @property
    def open(self) -> int:
        """Leases not returned yet."""
        return len(self._by_id)
