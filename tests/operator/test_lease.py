"""Leader election logic on a fake clock and an in-memory Lease (the real Lease is covered by test_leadership)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from ibex_operator.errors import KubeApiError, LeaseConflict, LeaseLost
from ibex_operator.lease import LeaderElector, LeaseRecord, LeaseTiming

TIMING = LeaseTiming(lease_duration=15, renew_deadline=10, retry_period=2)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def monotonic(self) -> float:
        return self.t

    def wall(self) -> datetime:
        # a node whose wall clock is an hour off: must not matter
        return datetime(2030, 1, 1, tzinfo=UTC) + timedelta(seconds=self.t)


class MemoryLease:
    """Compare-and-swap semantics of the apiserver, in memory."""

    def __init__(self) -> None:
        self.record: LeaseRecord | None = None
        self.version = 0
        self.down = False

    async def get(self) -> LeaseRecord | None:
        if self.down:
            raise KubeApiError("apiserver unreachable")
        return self.record

    async def create(self, record: LeaseRecord) -> LeaseRecord:
        if self.record is not None:
            raise LeaseConflict("exists")
        return self._store(record)

    async def replace(self, record: LeaseRecord) -> LeaseRecord:
        if self.down:
            raise KubeApiError("apiserver unreachable")
        if self.record is None or record.resource_version != self.record.resource_version:
            raise LeaseConflict("moved")
        return self._store(record)

    def _store(self, record: LeaseRecord) -> LeaseRecord:
        self.version += 1
        self.record = replace(record, resource_version=str(self.version))
        return self.record


def elector(store: MemoryLease, identity: str, clock: Clock) -> LeaderElector:
    return LeaderElector(store, identity, TIMING, monotonic=clock.monotonic, wall_clock=clock.wall)


async def test_the_first_candidate_creates_the_lease_and_the_second_waits_for_it_to_expire() -> None:
    store, clock = MemoryLease(), Clock()
    a, b = elector(store, "a", clock), elector(store, "b", clock)
    assert await a.try_acquire_or_renew()
    assert not await b.try_acquire_or_renew()
    clock.t += 14  # a is silent, but the lease has not expired from b's point of view
    assert not await b.try_acquire_or_renew()
    clock.t += 1.5
    assert await b.try_acquire_or_renew()
    assert store.record is not None and store.record.holder == "b" and store.record.transitions == 1


async def test_a_renewing_holder_keeps_the_lease_however_long_the_candidate_waits() -> None:
    store, clock = MemoryLease(), Clock()
    a, b = elector(store, "a", clock), elector(store, "b", clock)
    assert await a.try_acquire_or_renew()
    for _ in range(20):
        clock.t += 2
        assert await a.try_acquire_or_renew()
        assert not await b.try_acquire_or_renew()
    assert store.record is not None and store.record.holder == "a" and store.record.transitions == 0


async def test_a_restarted_holder_with_the_same_identity_takes_its_lease_back_at_once() -> None:
    store, clock = MemoryLease(), Clock()
    assert await elector(store, "pod-1", clock).try_acquire_or_renew()
    assert await elector(store, "pod-1", clock).try_acquire_or_renew()  # a new process, same pod name
    assert store.record is not None and store.record.transitions == 0


async def test_release_hands_over_without_waiting_for_expiry() -> None:
    store, clock = MemoryLease(), Clock()
    a, b = elector(store, "a", clock), elector(store, "b", clock)
    assert await a.acquire(asyncio.Event())
    await a.release()
    assert store.record is not None and store.record.holder is None
    assert await b.try_acquire_or_renew()


async def test_two_candidates_racing_for_an_expired_lease_cannot_both_win() -> None:
    store, clock = MemoryLease(), Clock()
    assert await elector(store, "old", clock).try_acquire_or_renew()
    b, c = elector(store, "b", clock), elector(store, "c", clock)
    assert not await b.try_acquire_or_renew() and not await c.try_acquire_or_renew()
    clock.t += 16
    results = await asyncio.gather(b.try_acquire_or_renew(), c.try_acquire_or_renew())
    assert sorted(results) == [False, True]


async def test_keep_gives_up_when_renewal_fails_for_the_renew_deadline_before_the_lease_expires() -> None:
    store = MemoryLease()
    a = LeaderElector(store, "a", LeaseTiming(lease_duration=0.6, renew_deadline=0.3, retry_period=0.05))
    assert await a.acquire(asyncio.Event())
    store.down = True  # the apiserver is unreachable from this replica
    started = time.monotonic()
    with pytest.raises(LeaseLost, match="could not be renewed"):
        await asyncio.wait_for(a.keep(asyncio.Event()), timeout=5)
    assert 0.3 <= time.monotonic() - started < 0.6  # stopped before anyone else may take the lease
    assert not a.is_leader


async def test_keep_raises_at_once_when_someone_else_holds_the_lease() -> None:
    store, clock = MemoryLease(), Clock()
    a = LeaderElector(store, "a", LeaseTiming(3, 2, 0.01), monotonic=clock.monotonic, wall_clock=clock.wall)
    assert await a.acquire(asyncio.Event())
    assert store.record is not None
    store.record = replace(store.record, holder="intruder")  # e.g. a very long pause let it expire
    with pytest.raises(LeaseLost, match="intruder"):
        await asyncio.wait_for(a.keep(asyncio.Event()), timeout=5)


def test_timing_must_leave_room_to_renew() -> None:
    with pytest.raises(ValueError, match="retry_period < renew_deadline < lease_duration"):
        LeaseTiming(lease_duration=10, renew_deadline=10, retry_period=2)
