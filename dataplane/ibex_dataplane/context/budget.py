"""The token budget of one context assembly: how many tokens are left for memory entries.

Owns the budget-by-subtraction rule. The context stage's service calls ``compute_budget`` once per assembly,
after estimating the directive, the conversation, the tool schemas and the formatter's fixed text with the
project's one estimation rule (:mod:`ibex_dataplane.providers.tokens`), and hands ``ContextBudget.usable`` to the
packer. Pure: no I/O, no clock, no state.

The rule::

    usable = context_window - response_reserve - safety_buffer
             - directive - messages - tools - formatter_overhead        clamped at 0
    usable = min(usable, cap)                                           when the agent caps its memory context

* ``response_reserve``: 15% of the window, at least 500, at most 4096, and never more than the model can emit.
* ``safety_buffer``: a fraction of the window per tokenizer family (``SAFETY_BUFFER_PER_MILLE``), larger where
  the estimates are less certain.
* ``constrained``: fewer than ``CONSTRAINED_BELOW`` tokens are usable, whatever the reason (a full window or a
  small cap); the assembly still runs and reports it.

Every estimate must share one kind and one tokenizer family, the model's: an estimate of another kind or family
is not comparable, so combining them raises ``MixedEstimateError``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from ibex_dataplane.context.errors import MixedEstimateError
from ibex_dataplane.providers.catalog import ModelInfo
from ibex_dataplane.providers.tokens import TokenEstimate, TokenEstimateKind, TokenizerFamily

__all__ = [
    "CONSTRAINED_BELOW",
    "RESPONSE_RESERVE_MAX",
    "RESPONSE_RESERVE_MIN",
    "RESPONSE_RESERVE_PERCENT",
    "SAFETY_BUFFER_PER_MILLE",
    "ContextBudget",
    "MixedEstimateError",
    "compute_budget",
    "response_reserve",
    "safety_buffer",
]

CONSTRAINED_BELOW: Final = 256
RESPONSE_RESERVE_PERCENT: Final = 15
RESPONSE_RESERVE_MIN: Final = 500
RESPONSE_RESERVE_MAX: Final = 4096

# Thousandths of the context window kept free on top of the conservative estimates, per tokenizer family.
# - OpenAI families (2%): the estimate is a fitted upper bound checked against the real encoders, so the buffer
#   only absorbs what the estimate cannot see (provider-side framing changes, tool-schema rendering).
# - Generic (4%): the byte bound is proven for byte-level tokenizers, but an unknown model's chat template and
#   special tokens are not, and it may not be byte-level at all.
# - Anthropic (6%): the rule is the OpenAI one scaled, never checked against the real tokenizer, and the provider
#   adds its own hidden framing (a tool-use system prompt when tools are present).
SAFETY_BUFFER_PER_MILLE: Final[Mapping[TokenizerFamily, int]] = {
    TokenizerFamily.OPENAI_O200K: 20,
    TokenizerFamily.OPENAI_CL100K: 20,
    TokenizerFamily.GENERIC: 40,
    TokenizerFamily.ANTHROPIC: 60,
}


@dataclass(frozen=True, slots=True)
class ContextBudget:
    """Every term of the subtraction, and what is left for memory entries (``usable``, never negative).

    ``uncapped`` is what the window alone would allow (before the agent's cap), so a report can tell "the window
    is full" from "the agent asked for less".
    """

    context_window: int
    response_reserve: int
    safety_buffer: int
    directive: int
    messages: int
    tools: int
    formatter_overhead: int
    cap: int | None
    usable: int
    constrained: bool
    kind: TokenEstimateKind
    family: TokenizerFamily
    uncapped: int


def _ceil_fraction(value: int, numerator: int, denominator: int) -> int:
    return -(-value * numerator // denominator)


def response_reserve(context_window: int, max_output_tokens: int) -> int:
    """Tokens kept for the model's answer: 15% of the window (rounded up), within [500, 4096], at most max output."""
    if context_window <= 0 or max_output_tokens <= 0:
        raise ValueError("context window and max output must be positive")
    share = _ceil_fraction(context_window, RESPONSE_RESERVE_PERCENT, 100)
    return min(max(share, RESPONSE_RESERVE_MIN), RESPONSE_RESERVE_MAX, max_output_tokens)


def safety_buffer(context_window: int, family: TokenizerFamily) -> int:
    """Tokens kept free against estimation error: the family's fraction of the window, rounded up."""
    if context_window <= 0:
        raise ValueError("context window must be positive")
    return _ceil_fraction(context_window, SAFETY_BUFFER_PER_MILLE[family], 1000)


def compute_budget(
    model: ModelInfo,
    *,
    directive: TokenEstimate,
    messages: TokenEstimate,
    tools: TokenEstimate,
    formatter_overhead: TokenEstimate,
    cap: int | None,
) -> ContextBudget:
    """The budget for memory entries when ``model`` answers a request whose other sections are estimated.

    Raises ``MixedEstimateError`` when the estimates differ in kind or family or are not for the model's
    tokenizer family, and ``ValueError`` for a negative estimate or cap.
    """
    family = model.tokenizer_family
    estimates = {"directive": directive, "messages": messages, "tools": tools, "formatter_overhead": formatter_overhead}
    kind = directive.kind
    for name, estimate in estimates.items():
        if estimate.family is not family:
            raise MixedEstimateError(
                f"{name} is estimated for tokenizer family {estimate.family}, the model {model.name!r} uses {family}"
            )
        if estimate.kind is not kind:
            raise MixedEstimateError(f"{name} is a {estimate.kind} estimate, directive is a {kind} estimate")
        if estimate.tokens < 0:
            raise ValueError(f"{name} estimate must not be negative")
    if cap is not None and cap < 0:
        raise ValueError("the memory context cap must not be negative")
    reserve = response_reserve(model.context_window, model.max_output_tokens)
    buffer = safety_buffer(model.context_window, family)
    left = model.context_window - reserve - buffer - sum(e.tokens for e in estimates.values())
    uncapped = max(left, 0)
    usable = uncapped if cap is None else min(uncapped, cap)
    return ContextBudget(
        context_window=model.context_window,
        response_reserve=reserve,
        safety_buffer=buffer,
        directive=directive.tokens,
        messages=messages.tokens,
        tools=tools.tokens,
        formatter_overhead=formatter_overhead.tokens,
        cap=cap,
        usable=usable,
        constrained=usable < CONSTRAINED_BELOW,
        kind=kind,
        family=family,
        uncapped=uncapped,
    )
