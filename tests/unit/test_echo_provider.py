"""The offline echo model answers with exactly the messages it received, shaped like OpenAI's answers."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

import orjson
import pytest

from ibex_dataplane.providers.base import ChatRequest, StreamChunk, StreamDone, StreamEvent
from ibex_dataplane.providers.catalog import ModelCatalog
from ibex_dataplane.providers.echo import EchoProvider
from ibex_dataplane.providers.errors import ProviderTimeout
from ibex_dataplane.providers.tokens import TokenizerFamily, estimate_chat_tokens, estimate_text_tokens

MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You are the support assistant for Acme."},
    {"role": "user", "content": [{"type": "text", "text": "Où est ma commande ? 注文 #42 🚚"}]},
    {"role": "assistant", "content": 'Checking.\n\t"quoted" \\ back'},
    {"role": "user", "content": "thanks", "name": "bob"},
]


def request(body: Mapping[str, Any], *, deadline_in: float = 5.0) -> ChatRequest:
    return ChatRequest(body=body, model="echo", deadline=time.monotonic() + deadline_in, request_id="req-test")


@pytest.fixture
def echo() -> EchoProvider:
    return EchoProvider(ModelCatalog.builtin())


async def collect(provider: EchoProvider, req: ChatRequest) -> tuple[list[dict[str, Any]], StreamDone]:
    chunks: list[dict[str, Any]] = []
    done: list[StreamDone] = []
    async with provider.stream(req) as events:
        async for event in events:
            assert not done, "nothing may follow StreamDone"
            if isinstance(event, StreamChunk):
                chunks.append(orjson.loads(event.data))
            else:
                done.append(event)
    assert len(done) == 1
    return chunks, done[0]


def streamed_content(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


async def test_echo_replies_with_the_exact_messages_as_compact_json(echo: EchoProvider) -> None:
    response = await echo.complete(request({"model": "echo", "messages": MESSAGES}))
    body = response.body
    content = body["choices"][0]["message"]["content"]
    assert content == json.dumps(MESSAGES, separators=(",", ":"), ensure_ascii=False)
    assert json.loads(content) == MESSAGES
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert body["model"] == "echo"
    assert isinstance(body["created"], int)
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert response.model == "echo"
    assert response.provider == "echo"


async def test_echo_usage_is_the_conservative_estimate(echo: EchoProvider) -> None:
    response = await echo.complete(request({"model": "echo", "messages": MESSAGES}))
    content = response.body["choices"][0]["message"]["content"]
    prompt = estimate_chat_tokens(MESSAGES, TokenizerFamily.GENERIC).tokens
    completion = estimate_text_tokens(content, TokenizerFamily.GENERIC)
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (prompt, completion)
    assert response.usage.estimated is True
    assert response.body["usage"] == {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
async def test_max_tokens_truncates_the_reply_and_reports_length(echo: EchoProvider, field: str) -> None:
    full = json.dumps(MESSAGES, separators=(",", ":"), ensure_ascii=False)
    response = await echo.complete(request({"model": "echo", "messages": MESSAGES, field: 25}))
    content = response.body["choices"][0]["message"]["content"]
    assert response.body["choices"][0]["finish_reason"] == "length"
    assert full.startswith(content)
    assert 0 < len(content) < len(full)
    assert response.usage.completion_tokens <= 25
    assert response.body["usage"]["completion_tokens"] == response.usage.completion_tokens


async def test_the_tighter_of_both_limits_wins_and_a_roomy_limit_changes_nothing(echo: EchoProvider) -> None:
    both = await echo.complete(
        request({"model": "echo", "messages": MESSAGES, "max_tokens": 40, "max_completion_tokens": 10})
    )
    assert both.usage.completion_tokens <= 10
    roomy = await echo.complete(request({"model": "echo", "messages": MESSAGES, "max_tokens": 4096}))
    assert roomy.body["choices"][0]["finish_reason"] == "stop"
    assert json.loads(roomy.body["choices"][0]["message"]["content"]) == MESSAGES


async def test_stream_chunks_concatenate_to_the_same_content(echo: EchoProvider) -> None:
    body = {"model": "echo", "messages": MESSAGES, "stream": True}
    expected = (await echo.complete(request(body))).body["choices"][0]["message"]["content"]
    chunks, done = await collect(echo, request(body))
    assert streamed_content(chunks) == expected
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "", "refusal": None}
    content_chunks = [c for c in chunks[1:-1]]
    assert 2 <= len(content_chunks) <= 4
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert all("usage" not in c for c in chunks), "no usage unless the client asks"
    assert done.finish_reason == "stop"
    assert done.usage.completion_tokens == estimate_text_tokens(expected, TokenizerFamily.GENERIC)


async def test_stream_ends_with_a_usage_chunk_only_when_asked(echo: EchoProvider) -> None:
    body = {"model": "echo", "messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}}
    chunks, done = await collect(echo, request(body))
    *rest, last = chunks
    assert last["choices"] == []
    assert last["usage"] == {
        "prompt_tokens": done.usage.prompt_tokens,
        "completion_tokens": done.usage.completion_tokens,
        "total_tokens": done.usage.total_tokens,
    }
    assert all(c["usage"] is None for c in rest), "OpenAI sends usage: null on every other chunk"
    assert rest[-1]["choices"][0]["finish_reason"] == "stop"


async def test_stream_truncation_matches_the_non_streaming_answer(echo: EchoProvider) -> None:
    body = {"model": "echo", "messages": MESSAGES, "max_tokens": 7, "stream": True}
    expected = (await echo.complete(request(body))).body["choices"][0]["message"]["content"]
    chunks, done = await collect(echo, request(body))
    assert streamed_content(chunks) == expected
    assert done.finish_reason == "length"
    assert done.usage.completion_tokens <= 7


async def test_empty_reply_still_streams_role_and_finish(echo: EchoProvider) -> None:
    chunks, done = await collect(echo, request({"model": "echo", "messages": MESSAGES, "max_tokens": 0}))
    assert streamed_content(chunks) == ""
    assert done.finish_reason == "length"
    assert done.usage.completion_tokens == 0


async def test_a_passed_deadline_is_a_timeout_before_any_byte(echo: EchoProvider) -> None:
    late = request({"model": "echo", "messages": MESSAGES}, deadline_in=-0.001)
    with pytest.raises(ProviderTimeout):
        await echo.complete(late)
    events: list[StreamEvent] = []
    with pytest.raises(ProviderTimeout):
        async with echo.stream(late) as stream:
            events.extend([e async for e in stream])
    assert events == []
