"""Budget holds: reserve the worst-case cost before the provider call, settle to the actual cost after it.

Owns the domain side of architecture section 7: monthly periods in UTC, the policy a hold is checked against,
money rounding, the errors the proxy maps (``BudgetExceeded`` -> 402 ``BUDGET_EXCEEDED``; ``StoreUnavailable``
-> 503, budgets fail closed), and the sweeper of holds left behind by crashed requests. Called by the proxy's
budget gate (:meth:`BudgetService.hold`), its response path (:meth:`~BudgetService.settle`,
:meth:`~BudgetService.release`), its periodic sweeper (:meth:`~BudgetService.sweep_expired`) and usage reads
(:meth:`~BudgetService.spend`), and by the memory stage's fact extraction, whose model calls are billed to the
same budgets. Every SQL statement is in :mod:`ibex_dataplane.shared.budget_repository`.

Settlement is durable against store outages: a settle that cannot reach Postgres (an outage, a restart) is retried
with backoff until it lands, for up to ``settle_retry_for``; it is idempotent by hold, and a hold the sweeper
expired in the meantime is still charged, once, late. So the ledger, the spend counters and the usage facts agree
for every request a provider served, including across a Postgres restart. (A proxy process that dies between
the answer and the settle loses that settle; its hold expires.)

Guarantees, under any concurrency and any number of proxy replicas: a ``HardCap`` scope never has
``spent + held`` above its limit because of a hold (settling to more than was held records the truth and may);
a hold is placed on the org and the agent or on neither; each request's spend is counted once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from decimal import ROUND_CEILING, ROUND_HALF_EVEN, Decimal
from enum import StrEnum
from typing import Any, TypeVar
from uuid import UUID, uuid4

from ibex_dataplane.shared.budget_leases import Lease, LeaseBook, LeaseKey, LeaseSettings
from ibex_dataplane.shared.budget_repository import (
    BudgetRepository,
    DuplicateBudgetHold,
    HoldOutcome,
    HoldStatus,
)
from ibex_dataplane.shared.waits import woken
from ibex_dataplane.store.errors import StoreUnavailable
from ibex_dataplane.store.postgres import Database

__all__ = [
    "BudgetExceeded",
    "BudgetHold",
    "BudgetPolicy",
    "BudgetScope",
    "BudgetService",
    "BudgetSnapshot",
    "DuplicateBudgetHold",
    "Enforcement",
    "LeaseSettings",
    "month_start",
    "utc_now",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

_QUANTUM = Decimal("0.00000001")  # numeric(18, 8): money is kept to 1e-8 USD
_MAX_USD = Decimal("9999999999.99999999")


def utc_now() -> datetime:
    """The default clock."""
    return datetime.now(UTC)


def month_start(moment: datetime) -> date:
    """The budget period containing ``moment``: the first day of its calendar month in UTC."""
    if moment.tzinfo is None:
        raise ValueError("budget clocks must return timezone-aware datetimes")
    utc = moment.astimezone(UTC)
    return date(utc.year, utc.month, 1)


def _usd(value: Decimal, what: str, rounding: str) -> Decimal:
    if not isinstance(value, Decimal) or not value.is_finite():
        raise ValueError(f"{what} must be a finite Decimal")
    if value < 0 or value > _MAX_USD:
        raise ValueError(f"{what} must be between 0 and {_MAX_USD}")
    return value.quantize(_QUANTUM, rounding=rounding)


class Enforcement(StrEnum):
    """What happens when a hold would go over a limit: refuse it, or hold it and record that it went over."""

    HARD_CAP = "HardCap"
    ALERT_ONLY = "AlertOnly"


class BudgetScope(StrEnum):
    ORG = "org"
    AGENT = "agent"


@dataclass(frozen=True)
class BudgetPolicy:
    """The limits a hold is checked against, from the policy snapshot of the moment (the newest one applies)."""

    org_limit_usd: Decimal | None  # None: no org budget
    agent_limit_usd: Decimal | None  # None: no agent budget
    enforcement: Enforcement  # the org's enforcement applies to both scopes

    def __post_init__(self) -> None:
        for what, limit in (("org_limit_usd", self.org_limit_usd), ("agent_limit_usd", self.agent_limit_usd)):
            if limit is not None:
                _usd(limit, what, ROUND_HALF_EVEN)
        object.__setattr__(self, "enforcement", Enforcement(self.enforcement))


@dataclass(frozen=True)
class BudgetHold:
    """A durable reservation for one request; hand it back to settle or release."""

    id: UUID
    org_id: UUID
    agent_id: UUID
    request_id: str
    amount_usd: Decimal
    period_start: date
    over_budget: bool  # AlertOnly holds that went over a limit (recorded, not blocked)
    lease: bool = False  # drawn from the lease ``id`` (docs/budget-leases.md) instead of held alone


@dataclass(frozen=True)
class Settlement:
    """What settling one hold writes: its actual cost (validated and rounded) and the usage behind it."""

    hold: BudgetHold
    actual_usd: Decimal
    model: str
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class BudgetSnapshot:
    """One scope's totals for the current period; ``limit_usd`` is the newest limit a hold saw (None: no limit)."""

    scope: BudgetScope
    scope_id: UUID
    period_start: date
    limit_usd: Decimal | None
    enforcement: Enforcement | None  # None until the scope's first hold of the period
    spent_usd: Decimal
    held_usd: Decimal

    @property
    def remaining_usd(self) -> Decimal | None:
        """What a HardCap would still let through (never negative); None without a limit."""
        if self.limit_usd is None:
            return None
        return max(Decimal(0), self.limit_usd - self.spent_usd - self.held_usd)


class BudgetExceeded(Exception):
    """A HardCap scope cannot take the hold; nothing was held anywhere. The proxy answers 402 BUDGET_EXCEEDED."""

    def __init__(self, scope: BudgetScope, limit: Decimal, spent: Decimal, held: Decimal, requested: Decimal) -> None:
        super().__init__(
            f"the {scope} budget for this month is exhausted: limit {limit} USD, spent {spent}, held {held},"
            f" requested {requested}"
        )
        self.scope = scope
        self.limit = limit
        self.spent = spent
        self.held = held
        self.requested = requested


class BudgetService:
    """Holds, settles, releases and sweeps budget reservations in Postgres. One per process; safe to share."""

    def __init__(
        self,
        db: Database,
        *,
        hold_ttl: timedelta = timedelta(minutes=10),
        settle_retry_for: timedelta = timedelta(hours=1),
        clock: Callable[[], datetime] = utc_now,
        leases: LeaseSettings | None = None,
        lease_clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if hold_ttl < timedelta(0):
            raise ValueError("hold_ttl must not be negative")
        self._repo = BudgetRepository(db)
        self._hold_ttl = hold_ttl
        self._settle_retry_for = settle_retry_for.total_seconds()
        self._clock = clock
        self._inflight: set[asyncio.Task[Any]] = set()
        self.retrying = 0  # settles waiting for Postgres to come back
        self._closing = asyncio.Event()  # set at shutdown: waiting settles give up (their holds expire)
        self._leases = LeaseBook(leases, lease_clock) if leases is not None else None
        self._placing: dict[LeaseKey, asyncio.Task[None]] = {}  # leases being placed, one per agent and month

    async def hold(
        self, org_id: UUID, agent_id: UUID, request_id: str, amount_usd: Decimal, policy: BudgetPolicy
    ) -> BudgetHold:
        """Reserve ``amount_usd`` (rounded up to 1e-8) on the org and the agent for the current month.

        Raises :class:`BudgetExceeded` when a HardCap scope would go over its limit, :class:`DuplicateBudgetHold`
        when the org already has a hold for ``request_id``, and ``StoreUnavailable`` when Postgres cannot be
        reached. Not shielded from cancellation on purpose: a hold nobody will use is better rolled back; one that
        committed just before the caller vanished expires after ``hold_ttl``.

        With leases on, the hold is drawn from this process's lease for the agent when one has enough left (no
        round trip; the returned hold says ``lease``), and a busy agent gets a lease (docs/budget-leases.md).
        """
        if not request_id:
            raise ValueError("a budget hold needs a request id")
        amount = _usd(amount_usd, "amount_usd", ROUND_CEILING)
        period = month_start(self._clock())
        if self._leases is not None and amount > 0 and not self._closing.is_set():
            lease = await self._draw((org_id, agent_id, period), amount, policy)
            if lease is not None:
                return BudgetHold(lease.id, org_id, agent_id, request_id, amount, period, False, lease=True)
        hold_id = uuid4()
        result = await self._repo.place_hold(
            org_id,
            agent_id,
            hold_id=hold_id,
            request_id=request_id,
            period_start=period,
            amount_usd=amount,
            org_limit_usd=policy.org_limit_usd,
            agent_limit_usd=policy.agent_limit_usd,
            enforcement=policy.enforcement.value,
            ttl=self._hold_ttl,
        )
        if result.outcome is HoldOutcome.DUPLICATE:
            raise DuplicateBudgetHold(request_id)
        if result.outcome is HoldOutcome.REFUSED:
            assert result.scope is not None and result.limit_usd is not None
            assert result.spent_usd is not None and result.held_usd is not None
            raise BudgetExceeded(BudgetScope(result.scope), result.limit_usd, result.spent_usd, result.held_usd, amount)
        over = result.outcome is HoldOutcome.OVER_BUDGET
        if over:
            log.warning(
                "budget hold over the %s limit, allowed by AlertOnly (request_id=%s org=%s agent=%s limit=%s"
                " spent=%s held=%s requested=%s)",
                result.scope,
                request_id,
                org_id,
                agent_id,
                result.limit_usd,
                result.spent_usd,
                result.held_usd,
                amount,
            )
        return BudgetHold(hold_id, org_id, agent_id, request_id, amount, period, over)

    async def _draw(self, key: LeaseKey, amount: Decimal, policy: BudgetPolicy) -> Lease | None:
        """Draw ``amount`` from a lease of ``key``, placing one first when the agent is busy; None: hold alone."""
        book = self._leases
        assert book is not None
        busy = book.seen(key)
        lease = self._draw_now(key, amount, policy)
        if lease is None:
            placing = self._placing.get(key)
            if placing is None and busy:
                placing = self._place_lease(key, amount, policy)
            if placing is not None:
                await asyncio.shield(placing)  # one round trip, as a hold would take; it outlives a cancellation
                lease = self._draw_now(key, amount, policy)  # None when refused: the caller holds alone
        if lease is not None and book.low(lease) and key not in self._placing:
            self._place_lease(key, amount, policy)  # the next one, in the background: a steady stream never waits
        return lease

    def _draw_now(self, key: LeaseKey, amount: Decimal, policy: BudgetPolicy) -> Lease | None:
        assert self._leases is not None
        lease, retired = self._leases.draw(key, policy, amount)
        for old in retired:
            self._return(old)
        return lease

    def _place_lease(self, key: LeaseKey, amount: Decimal, policy: BudgetPolicy) -> asyncio.Task[None]:
        task = self._track(self._lease(key, amount, policy))
        self._placing[key] = task
        return task

    async def _lease(self, key: LeaseKey, amount: Decimal, policy: BudgetPolicy) -> None:
        book = self._leases
        assert book is not None
        org_id, agent_id, period = key
        requests = book.requests_for(key)
        size = min(amount * requests, _MAX_USD)
        lease_id = uuid4()
        try:
            held = await self._repo.place_lease(
                org_id, agent_id, lease_id=lease_id, period_start=period, amount_usd=size,
                reserve_usd=size * book.settings.reserve, org_limit_usd=policy.org_limit_usd,
                agent_limit_usd=policy.agent_limit_usd, enforcement=policy.enforcement.value, ttl=self._hold_ttl,
            )  # fmt: skip
        except Exception as e:  # a lease is an optimisation: whatever failed, the requests hold alone
            log.warning("budget lease not placed: %s; holding alone", type(e).__name__)
            held = False
        finally:
            del self._placing[key]
        if not held:
            book.refused(key, requests)
            return
        lease = Lease(lease_id, key, policy, size, book.now())
        book.add(lease)
        asyncio.get_running_loop().call_later(book.settings.seconds, self._retire, lease_id)

    def _retire(self, lease_id: UUID) -> None:
        if self._leases is not None and (lease := self._leases.retire(lease_id)) is not None:
            self._return(lease)

    def _draw_done(self, hold: BudgetHold) -> None:
        """A drawn request was settled, released or given up on: its lease may now go back."""
        if hold.lease and self._leases is not None and (lease := self._leases.done(hold.id)) is not None:
            self._return(lease)

    def _return(self, lease: Lease) -> None:
        """Give back what ``lease`` has left (every draw of it settled or released)."""
        org_id, agent_id, _ = lease.key

        async def give_back() -> None:
            # Retried while Postgres is away, as settles are: an unreturned lease keeps its remainder from every
            # other request until it expires. Shutdown stops the retries (the sweeper then frees it).
            delay = 0.05
            give_up = asyncio.get_running_loop().time() + self._settle_retry_for
            while True:
                try:
                    await self._repo.release_hold(org_id, agent_id, lease.id)
                    return
                except StoreUnavailable as e:
                    if self._closing.is_set() or asyncio.get_running_loop().time() + delay > give_up:
                        log.warning("budget lease not returned (%s); it expires after the hold ttl", type(e).__name__)
                        return
                except Exception as e:
                    log.warning("budget lease not returned (%s); it expires after the hold ttl", type(e).__name__)
                    return
                await woken(self._closing, delay)
                delay = min(delay * 2, 5.0)

        self._track(give_back())

    @property
    def open_leases(self) -> int:
        """Leases of this process not returned yet."""
        return self._leases.open if self._leases is not None else 0

    def settlement(
        self, hold: BudgetHold, actual_usd: Decimal, *, model: str, prompt_tokens: int, completion_tokens: int
    ) -> Settlement:
        """The settle of ``hold`` to ``actual_usd`` (which may exceed the hold), validated and rounded, for
        :meth:`settle` or for a statement that settles along with other work (the proxy's session checkpoint)."""
        actual = _usd(actual_usd, "actual_usd", ROUND_HALF_EVEN)
        if prompt_tokens < 0 or completion_tokens < 0:
            raise ValueError("token counts must not be negative")
        return Settlement(hold, actual, model, prompt_tokens, completion_tokens)

    async def settle(
        self, hold: BudgetHold, actual_usd: Decimal, *, model: str, prompt_tokens: int, completion_tokens: int
    ) -> None:
        """Turn the hold into spend of ``actual_usd`` (which may exceed the hold) and write the ledger row.

        Idempotent: a second settle changes nothing; a hold the sweeper expired is counted once, late. Runs to
        completion even if the caller is cancelled, retrying while Postgres is unavailable.
        """
        settlement = self.settlement(
            hold, actual_usd, model=model, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens
        )
        await self.settle_again(settlement)

    async def settle_again(self, settlement: Settlement) -> None:
        """:meth:`settle` for a settlement already made (also after a statement carrying it failed: settling is
        idempotent, so whether that statement committed does not matter)."""
        hold = settlement.hold
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self._settle_retry_for
        delay = 0.05
        while True:
            try:
                before = await self._complete(self._settle_write(settlement))
                break
            except StoreUnavailable:
                if loop.time() + delay > give_up or self._closing.is_set():
                    log.error("settle gave up after retrying (request_id=%s hold=%s)", hold.request_id, hold.id)
                    self._draw_done(hold)
                    raise
                log.warning("settle deferred, Postgres unavailable (request_id=%s); retrying", hold.request_id)
                self.retrying += 1
                try:  # back off before the next attempt; shutdown cuts the wait short
                    await woken(self._closing, delay)
                finally:
                    self.retrying -= 1
                delay = min(delay * 2, 5.0)
        self.settled(settlement, before)

    def _settle_write(self, settlement: Settlement) -> Coroutine[Any, Any, HoldStatus | None]:
        hold = settlement.hold
        if hold.lease:
            return self._repo.settle_draw(
                hold.org_id, hold.agent_id, hold.id, request_id=hold.request_id, drawn_usd=hold.amount_usd,
                actual_usd=settlement.actual_usd, model=settlement.model, prompt_tokens=settlement.prompt_tokens,
                completion_tokens=settlement.completion_tokens,
            )  # fmt: skip
        return self._repo.settle_hold(
            hold.org_id, hold.agent_id, hold.id, actual_usd=settlement.actual_usd, model=settlement.model,
            prompt_tokens=settlement.prompt_tokens, completion_tokens=settlement.completion_tokens,
        )  # fmt: skip

    def settled(self, settlement: Settlement, before: HoldStatus | None) -> None:
        """Report a settle that was written: ``before`` is the status the hold had (None: no such hold)."""
        hold = settlement.hold
        self._draw_done(hold)
        if before is None:
            log.warning("settle of an unknown budget hold ignored (request_id=%s hold=%s)", hold.request_id, hold.id)
        elif before is HoldStatus.SETTLED:
            log.debug("budget hold already settled (request_id=%s)", hold.request_id)
        elif before is not HoldStatus.HELD:
            log.info("budget hold settled after it was %s (request_id=%s)", before, hold.request_id)

    async def release(self, hold: BudgetHold) -> None:
        """Give the whole hold back (the provider failed before any usage). Idempotent; runs to completion. A
        drawn amount stays in its lease, which goes back whole once its draws are done: no round trip here."""
        if hold.lease:
            self._draw_done(hold)
            return
        before = await self._complete(self._repo.release_hold(hold.org_id, hold.agent_id, hold.id))
        if before is None:
            log.warning("release of an unknown budget hold ignored (request_id=%s hold=%s)", hold.request_id, hold.id)

    async def spend(self, org_id: UUID, agent_id: UUID | None = None) -> BudgetSnapshot:
        """Spent, held and limit of the org (or of one of its agents) for the current month."""
        scope, scope_id = (BudgetScope.ORG, org_id) if agent_id is None else (BudgetScope.AGENT, agent_id)
        period = month_start(self._clock())
        row = await self._repo.read_period(org_id, scope_id, period)
        if row is None:
            return BudgetSnapshot(scope, scope_id, period, None, None, Decimal(0), Decimal(0))
        return BudgetSnapshot(
            scope, scope_id, period, row.limit_usd, Enforcement(row.enforcement), row.spent_usd, row.held_usd
        )

    async def sweep_expired(self, *, batch_size: int = 500, max_batches: int = 20) -> int:
        """Expire holds past their TTL in every org (requests that crashed); returns how many.

        Each batch is its own short transaction; concurrent sweepers on other replicas skip each other's rows.
        """
        if batch_size < 1 or max_batches < 1:
            raise ValueError("batch_size and max_batches must be positive")
        total = 0
        for _ in range(max_batches):
            swept = await self._repo.sweep_expired(batch_size)
            total += swept
            if swept < batch_size:
                break
        if total:
            log.info("expired %d budget holds past their ttl", total)
        return total

    def stop_retrying(self) -> None:
        """At shutdown: settles waiting for Postgres stop waiting (a process that stops cannot retry)."""
        self._closing.set()

    async def drain(self) -> None:
        """Wait for settles and releases whose callers went away, and return the leases whose draws are done
        (call at shutdown, after the settles were handed over and before closing the pool)."""
        self.stop_retrying()
        if self._leases is not None:
            for lease in self._leases.retire_all():
                self._return(lease)
        while self._inflight:
            await asyncio.gather(*self._inflight, return_exceptions=True)

    def _track(self, write: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run ``write`` as a task that :meth:`drain` waits for."""
        task = asyncio.create_task(write)
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        return task

    async def _complete(self, write: Coroutine[Any, Any, T]) -> T:
        """Run a write that must finish even if the awaiting request is cancelled (a client disconnect)."""
        task = self._track(write)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(_log_orphan_failure)
            raise


def _log_orphan_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and (error := task.exception()) is not None:
        log.warning("budget write failed after its caller was cancelled: %s", type(error).__name__)
