"""The proxy benchmark's check of a streamed answer: its content, and that it ends with [DONE]."""

from __future__ import annotations

import json

from bench.proxy_overhead import streamed_content


def event(content: str | None, finish: str | None = None) -> bytes:
    delta = {} if content is None else {"content": content}
    chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def test_a_whole_stream_adds_up_to_its_content() -> None:
    usage = b'data: {"choices": [], "usage": {"prompt_tokens": 3}}\n\n'
    raw = event("") + event("tok ") + event("tok ") + event(None, "stop") + usage + b"data: [DONE]\n\n"
    assert streamed_content(raw) == "tok tok "


def test_a_stream_without_done_or_empty_is_refused() -> None:
    assert streamed_content(event("tok ") + event(None, "stop")) is None
    assert streamed_content(b"") is None
    assert streamed_content(b"data: [DONE]\n\n") == ""
