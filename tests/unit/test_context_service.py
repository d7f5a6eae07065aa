"""Pure pieces of the context service: the cold-search query, degradation levels, the proxy's hold allowance."""

from __future__ import annotations

import pytest

from ibex_dataplane.context.formatter import formatter_overhead
from ibex_dataplane.context.service import BranchReport, BranchStatus, Degradation, _degradation, cold_query
from ibex_dataplane.providers.tokens import TokenizerFamily
from ibex_dataplane.proxy.generation import MEMORY_FRAMING_ALLOWANCE


def test_the_cold_query_is_the_latest_user_turn() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Where did Caroline go hiking last summer with her dog?"},
        {"role": "assistant", "content": "To the Rockies."},
        {"role": "user", "content": "What did she bring to the picnic at the lake?"},
    ]
    assert cold_query(messages) == "What did she bring to the picnic at the lake?"


def test_a_short_follow_up_also_searches_with_the_turn_before_it() -> None:
    messages = [
        {"role": "user", "content": "Where did Caroline go hiking last summer?"},
        {"role": "assistant", "content": "To the Rockies."},
        {"role": "user", "content": [{"type": "text", "text": "And when?"}, {"type": "image_url", "image_url": {}}]},
    ]
    assert cold_query(messages) == "Where did Caroline go hiking last summer?\nAnd when?"


def test_no_user_text_means_no_cold_query() -> None:
    assert cold_query([{"role": "system", "content": "x"}, {"role": "user", "content": [{"type": "image_url"}]}]) == ""


def test_the_cold_query_is_bounded() -> None:
    assert len(cold_query([{"role": "user", "content": "word " * 5000}])) == 1500


def _branch(status: BranchStatus) -> BranchReport:
    return BranchReport("x", status, 1.0)


@pytest.mark.parametrize(
    ("hot", "cold", "level"),
    [
        (BranchStatus.SUCCESS, BranchStatus.SUCCESS, Degradation.NONE),
        (BranchStatus.SKIPPED, BranchStatus.SKIPPED, Degradation.NONE),
        (BranchStatus.SUCCESS, BranchStatus.TIMEOUT, Degradation.PARTIAL),
        (BranchStatus.ERROR, BranchStatus.SUCCESS, Degradation.PARTIAL),
        (BranchStatus.TIMEOUT, BranchStatus.ERROR, Degradation.HISTORY_ONLY),
        (BranchStatus.SKIPPED, BranchStatus.TIMEOUT, Degradation.HISTORY_ONLY),
    ],
)
def test_degradation_levels_follow_the_retrieval_branches(
    hot: BranchStatus, cold: BranchStatus, level: Degradation
) -> None:
    assert _degradation(_branch(hot), _branch(cold)) is level


@pytest.mark.parametrize("family", list(TokenizerFamily))
def test_the_proxy_hold_allowance_covers_the_memory_framing_of_every_family(family: TokenizerFamily) -> None:
    # The budget hold is placed before assembly; it adds memory.contextTokens plus this allowance for the framing.
    assert formatter_overhead(family).tokens <= MEMORY_FRAMING_ALLOWANCE
