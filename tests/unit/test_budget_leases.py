"""The lease book alone (docs/budget-leases.md): draws, aging, policies, when a lease is to go back."""

from __future__ import annotations

from datetime import date
from decimal import Decimal
from uuid import uuid4

import pytest

from ibex_dataplane.shared.budget_leases import Lease, LeaseBook, LeaseKey, LeaseSettings
from tests.support.clocks import HandClock

D = Decimal
KEY: LeaseKey = (uuid4(), uuid4(), date(2026, 12, 1))


def book_with_lease(amount: str = "1.00", policy: str = "p") -> tuple[LeaseBook, Lease, HandClock]:
    tick = HandClock()
    book = LeaseBook(LeaseSettings(10, seconds=5), tick)
    lease = Lease(uuid4(), KEY, policy, D(amount), tick())
    book.add(lease)
    return book, lease, tick


def test_a_draw_takes_from_the_balance_and_never_more_than_is_left() -> None:
    book, lease, _ = book_with_lease("0.25")
    assert book.draw(KEY, "p", D("0.10")) == (lease, [])
    assert book.draw(KEY, "p", D("0.10")) == (lease, [])
    assert (lease.balance, lease.outstanding) == (D("0.05"), 2)
    # 0.05 left, less than a request like the last one: the lease is spent, and goes back after its two draws
    assert lease.retired and book.draw(KEY, "p", D("0.05")) == (None, [])
    assert book.done(lease.id) is None and book.done(lease.id) is lease and book.open == 0


def test_another_agent_or_month_draws_nothing() -> None:
    book, lease, _ = book_with_lease()
    org, agent, month = KEY
    assert book.draw((org, uuid4(), month), "p", D("0.01")) == (None, [])
    assert book.draw((uuid4(), agent, month), "p", D("0.01")) == (None, [])
    assert book.draw((org, agent, date(2027, 1, 1)), "p", D("0.01")) == (None, [])
    assert lease.balance == D("1.00")


def test_an_aged_lease_is_retired_and_goes_back_once_its_draws_are_done() -> None:
    book, lease, tick = book_with_lease()
    assert book.draw(KEY, "p", D("0.10"))[0] is lease
    tick.now = 5.0
    assert book.draw(KEY, "p", D("0.10")) == (None, [])  # too old; one draw still out, so not back yet
    assert lease.retired and not lease.returned and book.open == 1
    assert book.done(lease.id) is lease and lease.returned and book.open == 0
    assert book.done(lease.id) is None  # reported twice: nothing more


def test_a_lease_under_another_policy_is_retired_and_an_idle_one_goes_back_at_once() -> None:
    book, lease, _ = book_with_lease()
    assert book.draw(KEY, "new policy", D("0.10")) == (None, [lease])
    assert lease.returned and book.open == 0


def test_retire_all_returns_the_idle_leases_and_keeps_the_busy_ones_until_done() -> None:
    book, busy, tick = book_with_lease()
    idle = Lease(uuid4(), KEY, "p", D("1.00"), tick())
    book.add(idle)
    assert book.draw(KEY, "p", D("0.10"))[0] is busy
    assert book.retire_all() == [idle]
    assert book.draw(KEY, "p", D("0.10")) == (None, [])  # retired leases are drawn from no more
    assert book.done(busy.id) is busy and book.open == 0


def test_an_agent_is_busy_after_a_second_hold_within_the_window_unless_a_lease_was_refused() -> None:
    tick = HandClock()
    book = LeaseBook(LeaseSettings(10, seconds=5), tick)
    assert book.seen(KEY) is False
    tick.now = 4.9
    assert book.seen(KEY) is True
    book.refused(KEY, 10)
    tick.now = 6.0
    assert book.seen(KEY) is False  # refused 1.1 s ago
    tick.now = 10.0
    assert book.seen(KEY) is True


def test_low_means_under_a_quarter_left_and_no_next_lease_yet() -> None:
    book, lease, _ = book_with_lease("1.00")
    book.draw(KEY, "p", D("0.25"))
    book.draw(KEY, "p", D("0.25"))
    book.draw(KEY, "p", D("0.25"))
    assert not book.low(lease) and not lease.retired  # 0.25 left: a quarter
    book.draw(KEY, "p", D("0.01"))
    assert book.low(lease)
    book.add(Lease(uuid4(), KEY, "p", D("1.00"), 0.0))
    assert not book.low(lease)  # the next one is there already


def paced_book(tick: HandClock) -> LeaseBook:
    return LeaseBook(LeaseSettings(10, seconds=5, most=40, pace_seconds=0.5), tick)


def drain_at(book: LeaseBook, tick: HandClock, lease: Lease, step: float) -> None:
    """Draw ``lease`` below a quarter, one request every ``step`` seconds."""
    while not book.low(lease):
        tick.now += step
        assert book.draw(KEY, "p", D("0.10"))[0] is lease


def test_a_busy_agents_next_lease_covers_half_a_second_of_its_pace_within_the_bounds() -> None:
    tick = HandClock()
    book = paced_book(tick)
    assert book.requests_for(KEY) == 10  # nothing known of the agent yet
    first = Lease(uuid4(), KEY, "p", D("1.00"), tick())
    book.add(first)
    drain_at(book, tick, first, 0.02)  # 8 draws in 0.16 s: 50 per second, 25 in half a second
    assert book.requests_for(KEY) == 25
    second = Lease(uuid4(), KEY, "p", D("2.50"), tick())
    book.add(second)
    assert [book.draw(KEY, "p", D("0.10"))[0] for _ in range(3)] == [first, first, second]
    drain_at(book, tick, second, 0.0001)  # thousands per second: the most, 40
    assert book.requests_for(KEY) == 40


def test_a_quiet_agents_leases_stay_at_the_least_and_a_lease_that_goes_back_slowly_shrinks_the_next() -> None:
    tick = HandClock()
    book = paced_book(tick)
    slow = Lease(uuid4(), KEY, "p", D("1.00"), tick())
    book.add(slow)
    drain_at(book, tick, slow, 0.5)  # 2 per second
    assert book.requests_for(KEY) == 10
    fast = Lease(uuid4(), KEY, "p", D("1.00"), tick())
    book.add(fast)
    assert [book.draw(KEY, "p", D("0.10"))[0] for _ in range(2)] == [slow, slow]
    drain_at(book, tick, fast, 0.0001)
    assert book.requests_for(KEY) == 40
    last = Lease(uuid4(), KEY, "p", D("4.00"), tick())
    book.add(last)
    assert [book.draw(KEY, "p", D("0.10"))[0] for _ in range(5)] == [fast, fast, last, last, last]
    tick.now += 5.0  # then the agent went quiet: its lease ages, and goes back with three draws in five seconds
    assert book.draw(KEY, "p", D("0.10"))[0] is None and last.retired
    assert [book.done(last.id) for _ in range(3)] == [None, None, last]
    assert book.requests_for(KEY) == 10


def test_a_refused_large_lease_makes_the_next_ones_small_and_a_refused_small_one_stops_leasing() -> None:
    tick = HandClock()
    book = paced_book(tick)
    lease = Lease(uuid4(), KEY, "p", D("1.00"), tick())
    book.add(lease)
    drain_at(book, tick, lease, 0.0001)
    assert book.requests_for(KEY) == 40
    book.refused(KEY, 40)
    assert book.requests_for(KEY) == 10 and book.low(lease)  # the agent still leases, smaller
    tick.now += 5.0
    assert book.requests_for(KEY) == 40  # the refusal is forgotten after the lease seconds
    book.refused(KEY, 10)
    assert not book.low(lease) and not book.seen(KEY)  # no next lease, in the background or not


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"requests": 0}, "one request"),
        ({"requests": 5, "seconds": 0}, "seconds"),
        ({"requests": 5, "reserve": -1}, "reserve"),
        ({"requests": 5, "most": 4}, "most requests"),
        ({"requests": 5, "pace_seconds": -1}, "pace"),
    ],
)
def test_settings_are_checked(kw: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LeaseSettings(**kw)  # type: ignore[arg-type]
