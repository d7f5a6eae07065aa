"""How memories are written into the prompt: the memory message, and its token cost before and after packing.

Owns the memory message's text and its token cost. The context stage's service calls ``new_nonce`` once per
assembly, ``formatter_overhead`` and ``entry_tokens`` before packing (the budget and the packer's weights), and
``assemble_messages`` after packing. Pure apart from ``new_nonce``'s randomness; nothing here parses memory
content, it only escapes it.

Format
------
One extra system message after the conversation (the section order is directive, history, memories, tools; the
directive is already in the history and tools stay in the request's ``tools`` field): the safety sentence and
nonce-tagged, escaped blocks of :mod:`ibex_dataplane.shared.memory_blocks` (the format and its escaping rules are
described there; the proxy's MCP tools mark memory text with the same blocks)::

    <safety sentence naming the nonce>
    <memory nonce="kdjeapfmcnbhgoil" id="01J..." valid_from="2025-01-02T03:04:05Z">escaped content</memory>
    <memory nonce="kdjeapfmcnbhgoil" id="01J...">escaped content</memory>
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from ibex_dataplane.providers.tokens import (
    TokenEstimate,
    TokenEstimateKind,
    TokenizerFamily,
    estimate_chat_tokens,
    estimate_text_tokens,
)
from ibex_dataplane.shared.memory_blocks import (
    NONCE_LENGTH,
    SEPARATOR,
    MemoryEntry,
    check_nonce,
    format_entry,
    memory_blocks,
    new_nonce,
    safety_preamble,
)

__all__ = [
    "MEMORY_ROLE",
    "NONCE_LENGTH",
    "MemoryEntry",
    "assemble_messages",
    "entry_tokens",
    "format_entry",
    "formatter_overhead",
    "memory_message",
    "new_nonce",
    "safety_preamble",
]

MEMORY_ROLE: Final = "system"
# Any valid nonce costs the same estimate (letters only), so this one stands for all of them when estimating.
_ESTIMATE_NONCE: Final = "a" * NONCE_LENGTH
_SEPARATOR: Final = SEPARATOR


def _kind(family: TokenizerFamily) -> TokenEstimateKind:
    return estimate_chat_tokens((), family).kind


# Families whose estimate is the plain byte length: additive over concatenation, so no cap can bind.
_BYTE_BOUND_FAMILIES: Final = frozenset(f for f in TokenizerFamily if _kind(f) is TokenEstimateKind.BYTE_UPPER_BOUND)
# Last resort when padding cannot lift the byte cap: the rule's costliest byte (a lone digit between non-digits)
# is under 1.9 tokens.
_DENSE_TOKENS_PER_BYTE: Final = 2
_PAD_ATTEMPTS: Final = 4


def _share_of_joined_text(text: str, family: TokenizerFamily) -> int:
    """Upper bound on what ``text`` adds to the estimate of a longer text it is joined into.

    The rule counts byte classes and runs, which add up over texts joined at a newline, then caps the total at
    the byte length. A block estimated alone can hit that cap (dense text: digit lists, ids, mixed scripts) and
    then understates what it adds once joined with the rest of the message. Padding it with cheap text lifts
    the cap, and the padded estimate minus the padding's (plus one for rounding) is the block's uncapped share.
    """
    tokens = estimate_text_tokens(text, family)
    size = len(text.encode("utf-8"))
    if family in _BYTE_BOUND_FAMILIES or tokens < size:
        return tokens
    pad = "a" * (size + 16)
    for _ in range(_PAD_ATTEMPTS):
        pad_tokens = estimate_text_tokens(pad, family)
        joined = estimate_text_tokens(f"{text}\n{pad}", family)
        if pad_tokens < len(pad) and joined < size + 1 + len(pad):
            return max(tokens, joined - pad_tokens + 1)
        pad *= 4
    return _DENSE_TOKENS_PER_BYTE * size


def entry_tokens(entry: MemoryEntry, family: TokenizerFamily) -> int:
    """Conservative tokens one entry adds to the memory message: its block and the separator before it.

    The same for every nonce, at least the block's own estimate, and at least what the block adds to the
    estimate of the whole memory message (see ``_share_of_joined_text``), so the sections' estimates add up.
    """
    return _share_of_joined_text(_SEPARATOR + format_entry(entry, _ESTIMATE_NONCE), family)


def formatter_overhead(family: TokenizerFamily) -> TokenEstimate:
    """Conservative tokens of the memory message without its entries: the safety sentence and message framing.

    Estimated with the chat rule, so it carries the same kind and family as the other sections' estimates (and
    counts the reply priming once more, a few tokens on the safe side).
    """
    return estimate_chat_tokens([{"role": MEMORY_ROLE, "content": safety_preamble(_ESTIMATE_NONCE)}], family)


def memory_message(entries: Sequence[MemoryEntry], nonce: str) -> dict[str, Any] | None:
    """The system message carrying ``entries`` in the given order, or ``None`` when there are none."""
    if not entries:
        check_nonce(nonce)
        return None
    return {"role": MEMORY_ROLE, "content": memory_blocks(entries, nonce)}


def assemble_messages(
    history: Sequence[Mapping[str, Any]], entries: Sequence[MemoryEntry], nonce: str
) -> list[dict[str, Any]]:
    """The messages to send: a copy of ``history`` (directive already injected), then the memory message if any.

    Each message is copied one level deep; nested content parts are shared, never modified.
    """
    messages = [dict(m) for m in history]
    memory = memory_message(entries, nonce)
    if memory is not None:
        messages.append(memory)
    return messages
