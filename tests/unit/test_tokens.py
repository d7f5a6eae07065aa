"""Conservative token estimates: upper bounds against real tokenizer counts, proven bounds, and chat framing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ibex_dataplane.providers.tokens import (
    IMAGE_TOKENS,
    TokenEstimate,
    TokenEstimateKind,
    TokenizerFamily,
    directive_allowance,
    estimate_chat_tokens,
    estimate_text_tokens,
    truncate_to_tokens,
)
from ibex_dataplane.shared.directives import inject_directive

OPENAI_FAMILIES = (TokenizerFamily.OPENAI_O200K, TokenizerFamily.OPENAI_CL100K)

# True counts from the reference encoders (cl100k_base, o200k_base), counted when the rule was calibrated with
# the js-tiktoken package's bundled rank files. They are data, not something these tests can recompute offline.
VERIFIED_COUNTS: list[tuple[str, int, int]] = [
    ("The quick brown fox jumps over the lazy dog.", 10, 10),
    (
        "Agents call an OpenAI-compatible proxy. The proxy authenticates the API key, binds the call to one "
        "organization and one agent, applies policy, budget and rate limits, and hands the request to a model "
        "provider.",
        43,
        43,
    ),
    ("def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n", 35, 35),
    (
        '{"id":"chatcmpl-123","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant",'
        '"content":"Hi"}}]}',
        32,
        33,
    ),
    ("[1,2,3,4,5,6,7,8,9,0,1,2,3,4,5,6,7,8,9,0]", 41, 41),
    ("[0.0123456, -0.9876543, 0.5, 3.14159265, -2.71828182]", 33, 33),
    ("31415926535897932384626433832795028841971693993751", 17, 17),
    ("550e8400-e29b-41d4-a716-446655440000 6ba7b810-9dad-11d1-80b4-00c04fd430c8", 43, 43),
    (
        "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg==",
        53,
        52,
    ),
    ("我们的代理会在调用模型之前检查预算和速率限制。", 22, 14),
    ("エージェントはOpenAI互換のプロキシを呼び出します。", 24, 19),
    ("에이전트는 모델을 호출하기 전에 예산을 확인합니다.", 19, 16),
    ("Լոնդոնը Միացյալ Թագավորության մեծ քաղաք է։", 79, 15),
    ("👍🏽🚀🔥 ok 👨‍👩‍👧‍👦", 30, 18),
    ("qzxwvkjhpmbtrgfdlnsc", 12, 11),
    ("\n\n    \t  \n        x\n", 6, 6),
]


@pytest.mark.parametrize(("text", "cl100k", "o200k"), VERIFIED_COUNTS)
@pytest.mark.parametrize("family", [*OPENAI_FAMILIES, TokenizerFamily.ANTHROPIC, TokenizerFamily.GENERIC])
def test_estimate_never_undercounts_verified_tokenizer_counts(
    text: str, cl100k: int, o200k: int, family: TokenizerFamily
) -> None:
    assert estimate_text_tokens(text, family) >= max(cl100k, o200k)


def test_heuristic_is_tighter_than_bytes_for_english_code_and_json() -> None:
    ascii_texts = [text for text, _, _ in VERIFIED_COUNTS[:4]]
    for text in ascii_texts:
        assert estimate_text_tokens(text, TokenizerFamily.OPENAI_O200K) < 0.75 * len(text.encode())


def test_generic_family_is_the_utf8_byte_length() -> None:
    for text in ("", "hello", "日本語", "👨‍👩‍👧‍👦", "a\nb"):
        assert estimate_text_tokens(text, TokenizerFamily.GENERIC) == len(text.encode())


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_every_estimate_is_at_most_the_proven_byte_bound_and_at_least_one_token(text: str) -> None:
    size = len(text.encode("utf-8"))
    for family in TokenizerFamily:
        estimate = estimate_text_tokens(text, family)
        assert estimate <= size
        assert (estimate >= 1) == (size >= 1)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200), st.integers(min_value=0, max_value=80))
def test_truncation_gives_the_longest_prefix_that_fits(text: str, limit: int) -> None:
    for family in (TokenizerFamily.OPENAI_O200K, TokenizerFamily.GENERIC):
        cut = truncate_to_tokens(text, limit, family)
        assert text.startswith(cut)
        assert estimate_text_tokens(cut, family) <= limit
        if len(cut) < len(text):
            assert estimate_text_tokens(text[: len(cut) + 1], family) > limit


def test_estimate_grows_with_every_added_character() -> None:
    text = 'Hello 世界! {"n": [1, 22, 333]}\n\tdone 👍'
    for family in TokenizerFamily:
        counts = [estimate_text_tokens(text[:i], family) for i in range(len(text) + 1)]
        assert counts == sorted(counts)


def test_chat_estimate_covers_every_content_plus_framing() -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2 + 2?", "name": "alice"},
        {"role": "assistant", "content": "4"},
    ]
    family = TokenizerFamily.OPENAI_O200K
    estimate = estimate_chat_tokens(messages, family)
    assert estimate.kind is TokenEstimateKind.HEURISTIC_UPPER_BOUND
    assert estimate.family is family
    # OpenAI's documented framing: 3 per message, 1 per name, 3 for the reply; contents on top.
    true_upper = sum(estimate_text_tokens(m["content"], family) for m in messages) + 3 * 3 + 1 + 3
    assert estimate.tokens >= true_upper - 3  # joining once may round up to one token less per text
    assert estimate.tokens >= 3 * 6 + 3


def test_text_parts_count_like_the_same_string_and_images_count_a_fixed_amount() -> None:
    family = TokenizerFamily.OPENAI_O200K
    as_string = estimate_chat_tokens([{"role": "user", "content": "describe this picture"}], family)
    as_parts = estimate_chat_tokens(
        [{"role": "user", "content": [{"type": "text", "text": "describe this picture"}]}], family
    )
    with_image = estimate_chat_tokens(
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "describe this picture"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 100_000}},
                ],
            }
        ],
        family,
    )
    assert as_parts == as_string
    assert with_image.tokens == as_string.tokens + IMAGE_TOKENS[family]


def test_tools_and_tool_calls_add_to_the_estimate() -> None:
    family = TokenizerFamily.OPENAI_CL100K
    messages = [{"role": "user", "content": "weather in Paris?"}]
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    bare = estimate_chat_tokens(messages, family)
    with_tools = estimate_chat_tokens(messages, family, tools=tools)
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
        ],
    }
    with_call = estimate_chat_tokens(
        [*messages, call, {"role": "tool", "tool_call_id": "call_1", "content": "18C"}], family
    )
    assert with_tools.tokens > bare.tokens + 24
    assert with_call.tokens > bare.tokens + 2 * 6 + 8


def test_generic_chat_estimates_are_byte_bounds() -> None:
    estimate = estimate_chat_tokens([{"role": "user", "content": "hi"}], TokenizerFamily.GENERIC)
    assert estimate.kind is TokenEstimateKind.BYTE_UPPER_BOUND
    assert estimate.tokens == 2 + 6 + 3


def test_estimates_of_different_kinds_or_families_cannot_be_added() -> None:
    a = TokenEstimate(10, TokenEstimateKind.HEURISTIC_UPPER_BOUND, TokenizerFamily.OPENAI_O200K)
    assert (a + a).tokens == 20
    with pytest.raises(ValueError, match="different kinds"):
        _ = a + TokenEstimate(10, TokenEstimateKind.BYTE_UPPER_BOUND, TokenizerFamily.GENERIC)
    with pytest.raises(ValueError, match="different kinds"):
        _ = a + TokenEstimate(10, TokenEstimateKind.HEURISTIC_UPPER_BOUND, TokenizerFamily.OPENAI_CL100K)


_TEXTS = st.text(alphabet=st.sampled_from("aZ09 .\n\té€𝄞-_{}"), max_size=40) | st.text(max_size=40)
_CONTENT = st.one_of(
    st.none(),
    _TEXTS,
    st.lists(
        st.one_of(
            st.builds(lambda t: {"type": "text", "text": t}, _TEXTS),
            st.just({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}),
        ),
        max_size=3,
    ),
)
_MESSAGES = st.lists(
    st.builds(
        lambda role, content: {"role": role, "content": content},
        st.sampled_from(["system", "developer", "user", "assistant"]),
        _CONTENT,
    ),
    max_size=5,
)


@dataclass(frozen=True)
class _Directive:
    content: str
    injection_mode: str


@settings(max_examples=400, deadline=None)
# A chat capped at its bytes (a lone digit costs more by the rule than its one byte) with prose for a directive: the
# case a sum of the two estimates alone would under-count.
@example([{"role": "user", "content": "1"}], "hello world", "SystemFirst", TokenizerFamily.OPENAI_O200K)
@example([{"role": "user", "content": "7"}], "be brief", "UserPrepend", TokenizerFamily.ANTHROPIC)
@given(
    _MESSAGES,
    _TEXTS,
    st.sampled_from(["SystemFirst", "SystemAppend", "UserPrepend"]),
    st.sampled_from(list(TokenizerFamily)),
)
def test_a_directive_never_adds_more_than_its_allowance_however_it_is_injected(
    messages: list[dict[str, Any]], text: str, mode: str, family: TokenizerFamily
) -> None:
    """The budget hold adds ``directive_allowance`` to the client's chat estimate instead of estimating the chat
    with the directive in it a second time: that must stay an upper bound of the second estimate."""
    sent = inject_directive(messages, _Directive(text, mode))
    with_directive = estimate_chat_tokens(sent, family).tokens
    assert with_directive <= estimate_chat_tokens(messages, family).tokens + directive_allowance(text, family)
