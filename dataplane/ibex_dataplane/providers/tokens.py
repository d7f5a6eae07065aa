"""Conservative token estimates for prompts and completions, without any tokenizer files.

Owns the one rule the data plane uses to count tokens before a provider has answered: the proxy (budget holds,
rate-limit charges), the context stage (budget by subtraction) and the echo provider (its usage numbers) all call
``estimate_chat_tokens`` / ``estimate_text_tokens``. Nothing here downloads or loads a vocabulary.

The rule
--------
Every estimate is an *upper bound* on what the model's tokenizer will count, never a best guess:

* ``generic`` (unknown tokenizer): the UTF-8 byte length. Proven for every byte-level tokenizer (byte-level BPE,
  SentencePiece with byte fallback, character-level): each token covers at least one byte. Kind
  ``BYTE_UPPER_BOUND``.
* ``openai_o200k`` / ``openai_cl100k``: a linear bound over byte classes, fitted as an upper bound on a
  calibration corpus counted with the real cl100k_base and o200k_base encoders (English prose, docs, licences,
  Python/C/JS code, minified JS, JSON files and generated JSON, 60 languages from sentence and stop-word lists,
  CJK test texts, and adversarial strings: random letters, digits, number arrays, embeddings, hex, UUIDs, base64,
  JWTs, ULIDs, punctuation and whitespace runs, emoji, random code points). Of 3,119 samples of 1 byte to
  8 KiB, in four sets of which three were held out from the fit, none is under-counted. Kind ``HEURISTIC_UPPER_BOUND``::

        0.62 per lowercase ASCII letter       0.92 per uppercase ASCII letter
        0.42 per ASCII digit                  + 1.41 per run of digits
        0.48 per run of spaces                0.93 per tab / newline / CR / VT / FF
        0.78 per other ASCII byte             1.00 per non-ASCII byte (UTF-8)
        + 0.60 per run of non-ASCII bytes     + 1.4 per separately encoded text
        then round up, and never more than the UTF-8 byte length

  Slack against the real counts (sum of estimates / sum of true counts over the corpus): English 2.6, code 2.3,
  JSON 2.0, CJK 2.5, other scripts 2.1, numbers, identifiers and random strings 1.0-1.6. Letters cannot cost
  less than about 0.55 while random letter strings must still be covered, and non-ASCII costs its bytes because
  rare CJK and emoji really do approach one token per byte: that is the price of never under-counting.
* ``anthropic``: Anthropic's tokenizer is not public, so this is the OpenAI rule with every digit counted as a
  token and everything scaled by 1.35, capped by the byte length. Unverified, so callers budgeting context
  should keep a larger safety buffer for this family.

A chat adds, per message, 6 tokens of framing (role and delimiters; OpenAI documents 3-4) plus its name, its
content, its tool calls (8 each plus name, id and arguments), and 3 for priming the reply. Image parts count a
fixed amount (the largest high-detail gpt-4o image, 1,445 tokens, or 1,600 for other families; gpt-4o-mini
bills images at a multiple, which its price, not this count, must reflect); parts of
other non-text types count as the estimate of their JSON text. Tool schemas count as their compact JSON plus
16 plus 8 per tool.

Cost: one ``encode``, three or four ``bytes.translate``, ``split`` and seven ``bytes.count`` over all the chat's
text joined once: about 4 us for a short chat and 4-6 ns per byte beyond (``bench/tokens_bench.py``).
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import orjson

__all__ = [
    "TokenEstimate",
    "TokenEstimateKind",
    "TokenizerFamily",
    "directive_allowance",
    "estimate_chat_tokens",
    "estimate_text_tokens",
    "estimate_utf8_tokens",
    "truncate_to_tokens",
]


class TokenizerFamily(enum.StrEnum):
    """Which tokenizer a model uses, as far as estimates care."""

    OPENAI_O200K = "openai_o200k"
    OPENAI_CL100K = "openai_cl100k"
    ANTHROPIC = "anthropic"
    GENERIC = "generic"


class TokenEstimateKind(enum.StrEnum):
    """How an estimate was made; estimates of different kinds must not be added together."""

    HEURISTIC_UPPER_BOUND = "heuristic_upper_bound"
    BYTE_UPPER_BOUND = "byte_upper_bound"


@dataclass(frozen=True, slots=True)
class TokenEstimate:
    """A token count that is an upper bound, labelled with how it was made and for which tokenizer."""

    tokens: int
    kind: TokenEstimateKind
    family: TokenizerFamily

    def __add__(self, other: TokenEstimate) -> TokenEstimate:
        if not isinstance(other, TokenEstimate):
            return NotImplemented
        if other.kind is not self.kind or other.family is not self.family:
            raise ValueError(
                f"cannot add token estimates of different kinds or families: "
                f"{self.kind}/{self.family} + {other.kind}/{other.family}"
            )
        return TokenEstimate(self.tokens + other.tokens, self.kind, self.family)


@dataclass(frozen=True, slots=True)
class _Weights:
    lower: float
    upper: float
    digit: float
    digit_run: float
    space_run: float
    newline: float
    other_ascii: float
    high_byte: float
    high_run: float
    per_text: float


_OPENAI_WEIGHTS: Final = _Weights(
    lower=0.62,
    upper=0.92,
    digit=0.42,
    digit_run=1.41,
    space_run=0.48,
    newline=0.93,
    other_ascii=0.78,
    high_byte=1.0,
    high_run=0.60,
    per_text=1.4,
)
_ANTHROPIC_SCALE: Final = 1.35
_ANTHROPIC_WEIGHTS: Final = _Weights(
    lower=_OPENAI_WEIGHTS.lower * _ANTHROPIC_SCALE,
    upper=_OPENAI_WEIGHTS.upper * _ANTHROPIC_SCALE,
    digit=1.0 * _ANTHROPIC_SCALE,
    digit_run=0.0,
    space_run=_OPENAI_WEIGHTS.space_run * _ANTHROPIC_SCALE,
    newline=_OPENAI_WEIGHTS.newline * _ANTHROPIC_SCALE,
    other_ascii=_OPENAI_WEIGHTS.other_ascii * _ANTHROPIC_SCALE,
    high_byte=_OPENAI_WEIGHTS.high_byte * _ANTHROPIC_SCALE,
    high_run=_OPENAI_WEIGHTS.high_run * _ANTHROPIC_SCALE,
    per_text=_OPENAI_WEIGHTS.per_text * _ANTHROPIC_SCALE,
)
_WEIGHTS: Final[Mapping[TokenizerFamily, _Weights]] = {
    TokenizerFamily.OPENAI_O200K: _OPENAI_WEIGHTS,
    TokenizerFamily.OPENAI_CL100K: _OPENAI_WEIGHTS,
    TokenizerFamily.ANTHROPIC: _ANTHROPIC_WEIGHTS,
}

MESSAGE_OVERHEAD: Final = 6
NAME_OVERHEAD: Final = 1
REPLY_PRIMING: Final = 3
TOOL_CALL_OVERHEAD: Final = 8
TOOLS_OVERHEAD: Final = 16
TOOL_OVERHEAD: Final = 8
IMAGE_TOKENS: Final[Mapping[TokenizerFamily, int]] = {
    TokenizerFamily.OPENAI_O200K: 1445,
    TokenizerFamily.OPENAI_CL100K: 1445,
    TokenizerFamily.ANTHROPIC: 1600,
    TokenizerFamily.GENERIC: 1600,
}
_IMAGE_PART_TYPES: Final = frozenset({"image_url", "image", "input_image"})
_TEXT_PART_TYPES: Final = frozenset({"text", "input_text", "output_text", "refusal"})


def _class_table() -> bytes:
    table = bytearray(b"." * 256)
    for c in range(ord("a"), ord("z") + 1):
        table[c] = ord("a")
    for c in range(ord("A"), ord("Z") + 1):
        table[c] = ord("A")
    for c in range(ord("0"), ord("9") + 1):
        table[c] = ord("0")
    table[ord(" ")] = ord(" ")
    for c in b"\t\n\r\x0b\x0c":
        table[c] = ord("\n")
    for c in range(0x80, 0x100):
        table[c] = ord("h")
    return bytes(table)


def _mark_table(marked: bytes, mark: int, other: int) -> bytes:
    table = bytearray([other]) * 256
    for c in marked:
        table[c] = mark
    return bytes(table)


_CLASSES: Final = _class_table()
# Digits kept, everything else whitespace: ``split()`` then yields one piece per run of digits (fast in C while
# digits are rare, as in prose). Spaces marked against one other symbol: "x " cannot overlap itself, so its
# non-overlapping count is exactly the number of space runs that follow something.
_DIGIT_RUNS: Final = _mark_table(b"0123456789", ord("0"), ord(" "))
_SPACE_RUNS: Final = _mark_table(b" ", ord(" "), ord("x"))
_HIGH_RUNS: Final = _mark_table(bytes(range(0x80, 0x100)), ord("h"), ord(" "))


def _heuristic(data: bytes, texts: int, w: _Weights) -> int:
    """Apply the byte-class rule to ``data`` (``texts`` separately encoded texts joined together)."""
    return min(math.ceil(_heuristic_raw(data, texts, w)), len(data))


def _heuristic_raw(data: bytes, texts: int, w: _Weights) -> float:
    """The byte-class rule's sum over ``data``, before rounding up and the byte-length cap."""
    classes = data.translate(_CLASSES)
    lower = classes.count(b"a")
    upper = classes.count(b"A")
    digits = classes.count(b"0")
    newlines = classes.count(b"\n")
    spaces = classes.count(b" ")
    high = classes.count(b"h")
    other = len(classes) - lower - upper - digits - newlines - spaces - high
    digit_runs = len(data.translate(_DIGIT_RUNS).split()) if digits else 0
    space_runs = data.translate(_SPACE_RUNS).count(b"x ") + data.startswith(b" ") if spaces else 0
    total = (
        w.lower * lower
        + w.upper * upper
        + w.digit * digits
        + w.digit_run * digit_runs
        + w.space_run * space_runs
        + w.newline * newlines
        + w.other_ascii * other
        + w.per_text * texts
    )
    if high:
        total += w.high_byte * high + w.high_run * len(data.translate(_HIGH_RUNS).split())
    return total


def estimate_utf8_tokens(data: bytes, family: TokenizerFamily, *, texts: int = 1) -> int:
    """Upper bound on the tokens of UTF-8 ``data`` made of ``texts`` separately encoded texts joined together."""
    if not data:
        return 0
    weights = _WEIGHTS.get(family)
    if weights is None:
        return len(data)
    return _heuristic(data, texts, weights)


@functools.lru_cache(maxsize=1024)
def directive_allowance(text: str, family: TokenizerFamily) -> int:
    """Tokens ``text`` can add to a chat's estimate, however a directive is injected into it: as a message of its
    own, appended or prepended to a message's text with a blank line, or as a part of its own (an upper bound: the
    estimate of the chat with the directive never exceeds the estimate without it plus this).

    Why it holds: the directive adds its bytes and at most two line breaks to the joined text, its run counts and one
    text, all of which the rule counts additively, and at most one message. The rule caps the whole estimate at the
    byte length, and for any a, b, c, d: ``min(a + b, c + d) <= min(a, c) + max(b, d)``, so the larger of the
    directive's own heuristic and its byte length covers it whether the chat's estimate was capped or not. Cached:
    a directive's text repeats on every request of its agent."""
    data = text.encode("utf-8")
    weights = _WEIGHTS.get(family)
    separators = 2  # the blank line between the directive and a message's text, or the joiner of a new text
    if weights is None:
        return len(data) + separators + MESSAGE_OVERHEAD
    heuristic = _heuristic_raw(data, 1, weights) + separators * weights.newline
    return max(math.ceil(heuristic), len(data) + separators) + MESSAGE_OVERHEAD


def estimate_text_tokens(text: str, family: TokenizerFamily) -> int:
    """Upper bound on the number of tokens ``family``'s tokenizer produces for ``text`` (see module docstring)."""
    if not text:
        return 0
    return estimate_utf8_tokens(text.encode("utf-8"), family)


def truncate_to_tokens(text: str, max_tokens: int, family: TokenizerFamily) -> str:
    """Longest prefix of ``text`` whose estimate is at most ``max_tokens`` (the estimate grows with the prefix)."""
    if max_tokens <= 0:
        return ""
    if estimate_text_tokens(text, family) <= max_tokens:
        return text
    if family not in _WEIGHTS:
        return text.encode("utf-8")[:max_tokens].decode("utf-8", errors="ignore")
    lo, hi = 0, len(text)  # invariant: text[:lo] fits, text[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if estimate_text_tokens(text[:mid], family) <= max_tokens:
            lo = mid
        else:
            hi = mid
    return text[:lo]


def _kind(family: TokenizerFamily) -> TokenEstimateKind:
    return TokenEstimateKind.HEURISTIC_UPPER_BOUND if family in _WEIGHTS else TokenEstimateKind.BYTE_UPPER_BOUND


def _collect_content(content: object, family: TokenizerFamily, texts: list[str], fixed: list[int]) -> None:
    if isinstance(content, str):
        texts.append(content)
        return
    if not isinstance(content, Sequence):
        if content is not None:
            texts.append(orjson.dumps(content).decode())
        return
    for part in content:
        if isinstance(part, Mapping):
            kind = part.get("type")
            if kind in _TEXT_PART_TYPES:
                value = part.get(kind if kind == "refusal" else "text")
                if isinstance(value, str):
                    texts.append(value)
                    continue
            elif kind in _IMAGE_PART_TYPES:
                fixed.append(IMAGE_TOKENS[family])
                continue
        texts.append(orjson.dumps(part).decode())


def estimate_chat_tokens(
    messages: Iterable[Mapping[str, Any]],
    family: TokenizerFamily,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> TokenEstimate:
    """Upper bound on the prompt tokens of a Chat Completions request (messages, and tool schemas if any).

    ``messages`` are OpenAI-shaped: ``content`` a string, ``None`` or a list of content parts. Everything the
    rule counts as text is joined once and estimated in one pass, so the cost is per chat, not per message.
    """
    texts: list[str] = []
    fixed: list[int] = [REPLY_PRIMING]
    for message in messages:
        fixed.append(MESSAGE_OVERHEAD)
        name = message.get("name")
        if isinstance(name, str):
            texts.append(name)
            fixed.append(NAME_OVERHEAD)
        _collect_content(message.get("content"), family, texts, fixed)
        tool_calls = message.get("tool_calls")
        if isinstance(tool_calls, Sequence):
            for call in tool_calls:
                fixed.append(TOOL_CALL_OVERHEAD)
                texts.append(orjson.dumps(call).decode())
        tool_call_id = message.get("tool_call_id")
        if isinstance(tool_call_id, str):
            texts.append(tool_call_id)
    if tools:
        fixed.append(TOOLS_OVERHEAD + TOOL_OVERHEAD * len(tools))
        texts.append(orjson.dumps(list(tools)).decode())
    text_tokens = estimate_utf8_tokens("\n".join(texts).encode("utf-8"), family, texts=len(texts))
    return TokenEstimate(text_tokens + sum(fixed), _kind(family), family)
