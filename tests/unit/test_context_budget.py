"""The context budget: subtraction in the documented order, the reserve and buffer rules, and no mixed estimates."""

from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ibex_dataplane.context.budget import (
    CONSTRAINED_BELOW,
    SAFETY_BUFFER_PER_MILLE,
    MixedEstimateError,
    compute_budget,
    response_reserve,
    safety_buffer,
)
from ibex_dataplane.providers.catalog import ModelInfo
from ibex_dataplane.providers.tokens import TokenEstimate, TokenEstimateKind, TokenizerFamily

HEURISTIC = TokenEstimateKind.HEURISTIC_UPPER_BOUND
O200K = TokenizerFamily.OPENAI_O200K


def model(window: int = 128_000, max_out: int = 16_384, family: TokenizerFamily = O200K) -> ModelInfo:
    return ModelInfo("m", "openai", window, max_out, family, Decimal("1"), Decimal("1"))


def est(tokens: int, kind: TokenEstimateKind = HEURISTIC, family: TokenizerFamily = O200K) -> TokenEstimate:
    return TokenEstimate(tokens, kind, family)


@pytest.mark.parametrize(
    ("window", "max_out", "reserve"),
    [
        (128_000, 16_384, 4096),  # 15% is 19,200: capped at 4096
        (10_000, 8_000, 1500),  # 15% exactly
        (10_001, 8_000, 1501),  # rounded up
        (2_000, 2_000, 500),  # 15% is 300: at least 500
        (2_000, 256, 256),  # never above what the model can emit
        (20_000, 1_000, 1000),
    ],
)
def test_response_reserve_is_fifteen_percent_within_bounds_and_never_above_max_output(
    window: int, max_out: int, reserve: int
) -> None:
    assert response_reserve(window, max_out) == reserve


def test_safety_buffer_is_larger_for_families_whose_estimates_are_less_certain() -> None:
    assert safety_buffer(100_000, O200K) == 2000
    assert safety_buffer(100_000, TokenizerFamily.OPENAI_CL100K) == 2000
    assert safety_buffer(100_000, TokenizerFamily.GENERIC) == 4000
    assert safety_buffer(100_000, TokenizerFamily.ANTHROPIC) == 6000
    assert safety_buffer(1001, O200K) == 21  # rounded up
    assert set(SAFETY_BUFFER_PER_MILLE) == set(TokenizerFamily)


def test_usable_is_the_window_minus_every_section() -> None:
    b = compute_budget(
        model(), directive=est(300), messages=est(5000), tools=est(700), formatter_overhead=est(80), cap=None
    )
    assert (b.response_reserve, b.safety_buffer) == (4096, 2560)
    assert b.usable == 128_000 - 4096 - 2560 - 300 - 5000 - 700 - 80
    assert b.uncapped == b.usable
    assert (b.directive, b.messages, b.tools, b.formatter_overhead) == (300, 5000, 700, 80)
    assert (b.kind, b.family, b.constrained, b.cap) == (HEURISTIC, O200K, False, None)


def test_the_agents_context_cap_limits_usable_tokens() -> None:
    b = compute_budget(model(), directive=est(0), messages=est(100), tools=est(0), formatter_overhead=est(80), cap=2000)
    assert b.usable == 2000
    assert b.uncapped > 2000


def test_a_full_window_leaves_zero_usable_tokens_and_is_constrained() -> None:
    b = compute_budget(
        model(window=8000, max_out=4096),
        directive=est(0),
        messages=est(9000),
        tools=est(0),
        formatter_overhead=est(80),
        cap=None,
    )
    assert b.usable == 0
    assert b.constrained is True


def test_constrained_means_fewer_than_256_usable_tokens() -> None:
    assert CONSTRAINED_BELOW == 256
    m = model(window=10_000, max_out=8000)  # reserve 1500, buffer 200: 8300 before sections
    at = compute_budget(m, directive=est(0), messages=est(8044), tools=est(0), formatter_overhead=est(0), cap=None)
    below = compute_budget(m, directive=est(0), messages=est(8045), tools=est(0), formatter_overhead=est(0), cap=None)
    assert (at.usable, at.constrained) == (256, False)
    assert (below.usable, below.constrained) == (255, True)


@pytest.mark.parametrize("section", ["directive", "messages", "tools", "formatter_overhead"])
def test_an_estimate_of_another_kind_is_an_error_not_an_average(section: str) -> None:
    sections = {name: est(10) for name in ("directive", "messages", "tools", "formatter_overhead")}
    sections[section] = est(10, kind=TokenEstimateKind.BYTE_UPPER_BOUND)
    with pytest.raises(MixedEstimateError):
        compute_budget(model(), cap=None, **sections)


@pytest.mark.parametrize("section", ["directive", "messages", "tools", "formatter_overhead"])
def test_an_estimate_for_another_tokenizer_family_is_an_error(section: str) -> None:
    sections = {name: est(10) for name in ("directive", "messages", "tools", "formatter_overhead")}
    sections[section] = est(10, family=TokenizerFamily.OPENAI_CL100K)
    with pytest.raises(MixedEstimateError):
        compute_budget(model(), cap=None, **sections)


def test_estimates_for_a_family_other_than_the_models_are_an_error() -> None:
    anthropic = est(10, family=TokenizerFamily.ANTHROPIC)
    with pytest.raises(MixedEstimateError, match="tokenizer family"):
        compute_budget(
            model(), directive=anthropic, messages=anthropic, tools=anthropic, formatter_overhead=anthropic, cap=None
        )


def test_mixed_estimates_are_a_value_error_for_callers_that_only_know_bad_input() -> None:
    assert issubclass(MixedEstimateError, ValueError)


@pytest.mark.parametrize(("cap", "tokens", "message"), [(-1, 10, "cap"), (None, -1, "directive")])
def test_negative_caps_and_estimates_are_refused(cap: int | None, tokens: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        compute_budget(
            model(), directive=est(tokens), messages=est(0), tools=est(0), formatter_overhead=est(0), cap=cap
        )


@given(
    st.integers(1, 2_000_000),
    st.integers(1, 200_000),
    st.sampled_from(list(TokenizerFamily)),
    st.lists(st.integers(0, 300_000), min_size=4, max_size=4),
    st.one_of(st.none(), st.integers(0, 100_000)),
)
def test_usable_is_never_negative_never_above_the_cap_and_leaves_the_reserve_free(
    window: int, max_out: int, family: TokenizerFamily, sections: list[int], cap: int | None
) -> None:
    m = model(window, min(max_out, window), family)
    kind = TokenEstimateKind.BYTE_UPPER_BOUND if family is TokenizerFamily.GENERIC else HEURISTIC
    d, msg, t, o = (TokenEstimate(n, kind, family) for n in sections)
    b = compute_budget(m, directive=d, messages=msg, tools=t, formatter_overhead=o, cap=cap)
    assert b.usable >= 0
    assert cap is None or b.usable <= cap
    assert b.constrained == (b.usable < CONSTRAINED_BELOW)
    if b.usable > 0:
        assert b.usable + sum(sections) + b.response_reserve + b.safety_buffer <= window
