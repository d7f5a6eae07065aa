"""Leader election over a ``coordination.k8s.io/v1`` Lease, so two operator replicas never apply at the same time.

The operator acquires the lease before kopf starts watching anything and stops (exit code 1, the Deployment
restarts it) as soon as it cannot renew it within ``renew_deadline``. A candidate takes a lease over only after it
has seen the same lease record, unchanged, for ``lease_duration`` on its *own* monotonic clock (as client-go does),
so clock skew between nodes cannot cut a holder's term short. A holder that restarts with the same identity (the
chart uses the pod name) takes its lease back at once; a clean shutdown releases it so a standby takes over within
``retry_period``.

Owned here: the decision logic. The Kubernetes calls go through a :class:`LeaseStore`, which ``handlers``
implements (it is the only module that talks to the Kubernetes API); tests can drive this with an in-memory store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Protocol

from ibex_operator.errors import KubeApiError, LeaseConflict, LeaseLost

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeaseRecord:
    holder: str | None
    duration_s: int
    acquire_time: datetime | None = None
    renew_time: datetime | None = None
    transitions: int = 0
    resource_version: str | None = None  # None: not stored yet


class LeaseStore(Protocol):
    async def get(self) -> LeaseRecord | None: ...

    async def create(self, record: LeaseRecord) -> LeaseRecord: ...

    async def replace(self, record: LeaseRecord) -> LeaseRecord:
        """Compare-and-swap on ``record.resource_version``; raises :class:`LeaseConflict` when it moved."""
        ...


@dataclass(frozen=True)
class LeaseTiming:
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def __post_init__(self) -> None:
        if not (0 < self.retry_period < self.renew_deadline < self.lease_duration):
            raise ValueError("lease timing needs 0 < retry_period < renew_deadline < lease_duration")


class LeaderElector:
    """Acquire, keep and release one lease for one identity."""

    def __init__(
        self,
        store: LeaseStore,
        identity: str,
        timing: LeaseTiming = LeaseTiming(),
        *,
        monotonic: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._store = store
        self.identity = identity
        self._timing = timing
        self._monotonic = monotonic
        self._now = wall_clock
        self._observed: LeaseRecord | None = None
        self._observed_at = 0.0
        self._held: LeaseRecord | None = None
        self.is_leader = False

    async def try_acquire_or_renew(self) -> bool:
        """One attempt; True when this identity holds the lease afterwards."""
        now = self._now()
        current = await self._store.get()
        duration = max(1, round(self._timing.lease_duration))
        if current is None:
            try:
                self._held = await self._store.create(LeaseRecord(self.identity, duration, now, now, 0))
            except LeaseConflict:
                return False
            self._observe(self._held)
            return True
        self._observe(current)
        ours = current.holder == self.identity
        if current.holder and not ours and not self._observed_expired(current):
            return False
        wanted = replace(
            current,
            holder=self.identity,
            duration_s=duration,
            renew_time=now,
            acquire_time=current.acquire_time if ours and current.acquire_time else now,
            transitions=current.transitions if ours else current.transitions + 1,
        )
        try:
            self._held = await self._store.replace(wanted)
        except LeaseConflict:
            return False
        self._observe(self._held)
        return True

    def _observe(self, record: LeaseRecord) -> None:
        key = (record.holder, record.renew_time, record.resource_version)
        seen = self._observed
        if seen is None or (seen.holder, seen.renew_time, seen.resource_version) != key:
            self._observed, self._observed_at = record, self._monotonic()

    def _observed_expired(self, record: LeaseRecord) -> bool:
        return self._monotonic() - self._observed_at >= record.duration_s

    async def acquire(self, stop: asyncio.Event) -> bool:
        """Wait until this identity holds the lease (True) or ``stop`` is set (False)."""
        announced = False
        while not stop.is_set():
            try:
                if await self.try_acquire_or_renew():
                    self.is_leader = True
                    log.info("leader election: %s holds the lease", self.identity)
                    return True
            except KubeApiError as e:
                log.warning("leader election: cannot read or write the lease: %s", e)
            if not announced and self._observed is not None:
                log.info("leader election: waiting, the lease is held by %s", self._observed.holder)
                announced = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self._timing.retry_period)
        return False

    async def keep(self, stop: asyncio.Event) -> None:
        """Renew until ``stop`` is set; raises :class:`LeaseLost` when renewal fails for ``renew_deadline``."""
        last_renewal = self._monotonic()
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=self._timing.retry_period)
                return
            except TimeoutError:
                pass
            try:
                renewed = await self.try_acquire_or_renew()
            except KubeApiError as e:
                log.warning("leader election: renewal failed: %s", e)
                renewed = False
            if renewed:
                last_renewal = self._monotonic()
            elif self._observed is not None and self._observed.holder not in (None, self.identity):
                self.is_leader = False
                raise LeaseLost(f"the lease was taken over by {self._observed.holder}")
            elif self._monotonic() - last_renewal >= self._timing.renew_deadline:
                self.is_leader = False
                raise LeaseLost(f"the lease could not be renewed for {self._timing.renew_deadline:.0f} s")

    async def release(self) -> None:
        """Give the lease up (clean shutdown) so a standby does not wait for it to expire."""
        if not self.is_leader or self._held is None:
            return
        self.is_leader = False
        try:
            await self._store.replace(replace(self._held, holder=None, duration_s=1, renew_time=self._now()))
            log.info("leader election: %s released the lease", self.identity)
        except (LeaseConflict, KubeApiError) as e:
            log.warning("leader election: could not release the lease (it expires on its own): %s", e)
