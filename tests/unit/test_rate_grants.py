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
    assert book.take(old) is False and book.take(new) is True and book.open == 0


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
    ],
)
def test_settings_are_checked(kw: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GrantSettings(**kw)  # type: ignore[arg-type]
