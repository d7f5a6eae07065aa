"""The grant book alone: draws within what is left, before the grant's time and its window's end."""

from __future__ import annotations

import pytest

from ibex_dataplane.proxy.rate_grants import CLOCK_MARGIN, Grant, GrantBook, GrantSettings


def grant(key: str = "a", requests: int = 3, tokens: int = 30) -> Grant:
    return Grant(key, 7, requests, tokens, 100, 50, window_ends=60.0, drawn_until=10.0)


def test_draws_take_requests_and_tokens_and_stop_when_either_runs_out() -> None:
    book = GrantBook(GrantSettings(4))
    g = grant()
    book.add(g)
    assert book.draw("a", 10, 0.0) is g and book.draw("a", 15, 0.0) is g
    assert book.draw("a", 10, 0.0) is None  # 5 tokens left
    assert book.draw("a", 5, 0.0) is g and (g.requests, g.tokens) == (0, 0)
    assert book.draw("a", 0, 0.0) is None  # no request left
    assert book.draw("b", 0, 0.0) is None


def test_no_draw_after_the_grants_time_or_within_the_margin_of_its_window() -> None:
    book = GrantBook(GrantSettings(4))
    book.add(grant())
    assert book.draw("a", 1, 10.0) is None
    late = Grant("b", 7, 3, 30, None, None, window_ends=5.0, drawn_until=10.0)
    book.add(late)
    assert book.draw("b", 1, 5.0 - CLOCK_MARGIN - 0.001) is late
    assert book.draw("b", 1, 5.0 - CLOCK_MARGIN) is None


def test_a_new_grant_replaces_the_old_one_which_is_handed_back() -> None:
    book = GrantBook(GrantSettings(4))
    old, new = grant(), grant()
    book.add(old)
    assert book.add(new) is old
    assert book.take(old, 0.0) is False and book.take(new, 0.0) is True and book.open == 0


def test_busy_means_a_second_request_within_the_grant_seconds() -> None:
    book = GrantBook(GrantSettings(4, seconds=1.0))
    assert book.seen("a", 0.0) is False
    assert book.seen("a", 0.9) is True
    assert book.seen("a", 2.0) is False


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"requests": 1}, "at least 2"),
        ({"requests": 4, "seconds": 0}, "seconds"),
        ({"requests": 4, "reserve": -1}, "reserve"),
        ({"requests": 4, "most": 3}, "most requests"),
        ({"requests": 4, "pace_seconds": -1}, "pace"),
    ],
)
def test_settings_are_checked(kw: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GrantSettings(**kw)  # type: ignore[arg-type]


def paced(key: str, size: int, placed_at: float) -> Grant:
    return Grant(key, 7, size, size * 10, None, None, window_ends=60.0, drawn_until=placed_at + 30, size=size,
                 placed_at=placed_at)  # fmt: skip


def test_the_next_grant_counts_what_the_agent_drew_in_half_a_second_within_the_bounds() -> None:
    book = GrantBook(GrantSettings(4, seconds=30, most=40, pace_seconds=0.5))
    assert book.requests_for("a", 0.0) == 4  # no pace yet: the least
    g = paced("a", 4, 0.0)
    book.add(g)
    for _ in range(3):
        assert book.draw("a", 10, 0.05) is g
    assert book.low("a", 0.1)  # a quarter left; 3 drawn in 0.1 s: 30 a second
    assert book.requests_for("a", 0.1) == 15
    fast = paced("a", 15, 0.1)
    book.add(fast)
    for _ in range(12):
        assert book.draw("a", 10, 0.1) is fast
    assert book.low("a", 0.101)  # 12 in a millisecond: half a second of that is far above the most
    assert book.requests_for("a", 0.101) == 40
    quiet = paced("a", 40, 1.0)
    book.add(quiet)
    assert book.draw("a", 10, 1.5) is quiet and not book.low("a", 1.5)  # low at a quarter of its own size
    assert book.take(quiet, 31.0)  # its time is up with one draw in 30 s: the next grant counts the least
    assert book.requests_for("a", 31.0) == 4
    assert book.requests_for("b", 31.0) == 4  # another agent's pace is its own


def test_after_a_larger_grant_did_not_fit_the_agent_counts_the_least_for_the_grants_seconds() -> None:
    book = GrantBook(GrantSettings(4, seconds=1.0, most=40))
    g = paced("a", 4, 0.0)
    book.add(g)
    for _ in range(3):
        book.draw("a", 10, 0.001)
    assert book.low("a", 0.001) and book.requests_for("a", 0.001) == 40
    book.refused("a", 40, 5.0)
    assert book.requests_for("a", 5.5) == 4
    assert book.requests_for("a", 6.0) == 40  # a second later: the pace again
    book.refused("a", 4, 7.0)  # one of the least not fitting changes no size (the request was counted alone)
    assert book.requests_for("a", 7.1) == 40
