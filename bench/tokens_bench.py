"""Median cost of the conservative token estimator on short and long chats.

Run: python bench/tokens_bench.py
Prints microseconds per ``estimate_chat_tokens`` call (median of repeated timed batches) per tokenizer family,
and the same for ``estimate_text_tokens`` on plain text of a few sizes. Not a test: it never asserts on time.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from ibex_dataplane.providers.tokens import TokenizerFamily, estimate_chat_tokens, estimate_text_tokens

PROSE = (
    "Agents call an OpenAI-compatible proxy. The proxy authenticates the API key, binds the call to one "
    "organization and one agent, applies policy, budget and rate limits, resolves the agent's directive and "
    "session, assembles memory context under a token budget and a deadline, and hands the request to a model "
    "provider. "
)
CODE = 'def handler(request):\n    body = await request.json()\n    return web.json_response({"ok": True, "n": 42})\n'
JSON_DOC = json.dumps({"order": {"id": "A-1029", "items": [{"sku": "X-1", "qty": 2, "price": 19.99}] * 5}})
CJK = "我们的代理会在调用模型之前检查预算和速率限制。エージェントはプロキシを呼び出します。"


def short_chat() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are the support assistant for Acme. Answer briefly."},
        {"role": "user", "content": "Where is my order A-1029?"},
        {"role": "assistant", "content": "It shipped yesterday and should arrive on Friday."},
        {"role": "user", "content": "Thanks!"},
    ]


def long_chat() -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": PROSE * 8}]
    for turn in range(20):
        messages.append({"role": "user", "content": [{"type": "text", "text": PROSE + CJK}]})
        messages.append({"role": "assistant", "content": CODE + JSON_DOC if turn % 2 else PROSE * 2})
    return messages


def median_us(fn: Callable[[], object], *, batch: int, repeats: int = 31) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(batch):
            fn()
        samples.append((time.perf_counter() - start) / batch * 1e6)
    return statistics.median(samples)


def main() -> None:
    print(f"python {platform.python_version()} on {platform.machine()}, median of 31 batches")
    chats = {"short chat": short_chat(), "long chat": long_chat()}
    for label, messages in chats.items():
        size = len(json.dumps(messages, ensure_ascii=False).encode())
        print(f"\n{label}: {len(messages)} messages, {size} bytes of JSON")
        for family in TokenizerFamily:
            batch = 2000 if label == "short chat" else 100
            us = median_us(partial(estimate_chat_tokens, messages, family), batch=batch)
            tokens = estimate_chat_tokens(messages, family).tokens
            print(f"  {family.value:14s} {us:8.2f} us/estimate  ({tokens} tokens)")
    print("\nplain text, openai_o200k:")
    for size in (100, 1_000, 10_000, 100_000):
        text = (PROSE * (size // len(PROSE) + 1))[:size]
        batch = max(10, 200_000 // size)
        us = median_us(partial(estimate_text_tokens, text, TokenizerFamily.OPENAI_O200K), batch=batch)
        print(f"  {size:>7d} chars {us:9.2f} us  ({us / size * 1000:.2f} ns/char)")


if __name__ == "__main__":
    main()
