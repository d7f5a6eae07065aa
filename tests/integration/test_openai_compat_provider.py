"""The OpenAI-compatible adapter against a local upstream speaking the real Chat Completions wire format.

The upstream is an aiohttp server on 127.0.0.1 (free port) that answers JSON and SSE like OpenAI does, and can be
scripted per test to fail with a status N times, hang, go silent mid-stream, drop the connection mid-stream, or
omit usage. It records what it received and whether the client went away.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import orjson
import pytest
from pydantic import SecretStr

from ibex_dataplane.providers.base import ChatRequest, StreamChunk, StreamDone
from ibex_dataplane.providers.breaker import BreakerState
from ibex_dataplane.providers.catalog import ModelCatalog
from ibex_dataplane.providers.errors import (
    CircuitOpen,
    ProviderError,
    ProviderStreamInterrupted,
    ProviderTimeout,
    ProviderUnavailable,
    UpstreamRateLimited,
    UpstreamRejected,
)
from ibex_dataplane.providers.openai_compat import OpenAICompatConfig, OpenAICompatProvider
from ibex_dataplane.providers.registry import ProviderRegistry
from ibex_dataplane.providers.tokens import TokenizerFamily, estimate_chat_tokens, estimate_text_tokens
from ibex_dataplane.providers.transport import UpstreamClient
from tests.support.upstream import API_KEY, UPSTREAM_USAGE, Script, Upstream, running_upstream


@pytest.fixture(scope="module")
async def upstream() -> AsyncIterator[Upstream]:
    async with running_upstream() as state:
        yield state


@pytest.fixture
async def client() -> AsyncIterator[UpstreamClient]:
    upstreams = UpstreamClient()
    yield upstreams
    await upstreams.close()


@pytest.fixture
def fresh(upstream: Upstream) -> Upstream:
    upstream.reset()
    return upstream


def make_provider(upstream: Upstream, client: UpstreamClient, **overrides: Any) -> OpenAICompatProvider:
    settings: dict[str, Any] = {
        "base_url": upstream.url,
        "api_key": SecretStr(API_KEY),
        "max_attempts": 3,
        "backoff_base": 0.01,
        "backoff_max": 0.05,
        "read_timeout": 5.0,
        **overrides,
    }
    return OpenAICompatProvider("openai", OpenAICompatConfig(**settings), client, catalog=ModelCatalog.builtin())


MESSAGES = [{"role": "user", "content": "Say hello"}]


def chat(body: Mapping[str, Any] | None = None, *, deadline_in: float = 5.0) -> ChatRequest:
    return ChatRequest(
        body={"model": "gpt-4o", "messages": MESSAGES, **(body or {})},
        model="gpt-4o",
        deadline=time.monotonic() + deadline_in,
        request_id="req-int",
    )


async def read_stream(provider: Any, request: ChatRequest) -> tuple[list[bytes], StreamDone]:
    payloads: list[bytes] = []
    done: StreamDone | None = None
    async with provider.stream(request) as events:
        async for event in events:
            if isinstance(event, StreamChunk):
                payloads.append(event.data)
            else:
                done = event
    assert done is not None
    return payloads, done


async def drain(provider: OpenAICompatProvider, request: ChatRequest, received: list[bytes]) -> None:
    """Read a stream into ``received`` until it ends or fails (the failure propagates)."""
    async with provider.stream(request) as events:
        async for event in events:
            if isinstance(event, StreamChunk):
                received.append(event.data)


# --- non-streaming -------------------------------------------------------------------------------------------


async def test_unknown_fields_pass_through_and_usage_comes_from_upstream(
    fresh: Upstream, client: UpstreamClient
) -> None:
    body = {
        "model": "alias-the-proxy-resolved",
        "temperature": 0.3,
        "logit_bias": {"50256": -100},
        "vendor_extension": {"nested": [1, {"deep": None}]},
        "seed": 7,
    }
    response = await make_provider(fresh, client).complete(chat(body))
    sent = fresh.bodies[0]
    assert sent["model"] == "gpt-4o"
    for key in ("temperature", "logit_bias", "vendor_extension", "seed", "messages"):
        assert sent[key] == {**body, "messages": MESSAGES}[key]
    assert "stream" not in sent
    assert fresh.headers[0]["Authorization"] == f"Bearer {API_KEY}"
    assert fresh.headers[0]["X-Request-ID"] == "req-int"
    assert response.body["upstream_extra"] == {"kept": True}
    assert response.body["choices"][0]["message"]["content"] == "Hello, world!"
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (11, 4)
    assert response.usage.estimated is False
    assert (response.model, response.provider) == ("gpt-4o", "openai")


async def test_missing_upstream_usage_falls_back_to_estimates(fresh: Upstream, client: UpstreamClient) -> None:
    fresh.reset(Script(omit_usage=True))
    response = await make_provider(fresh, client).complete(chat())
    family = TokenizerFamily.OPENAI_O200K
    assert response.usage.estimated is True
    assert response.usage.prompt_tokens == estimate_chat_tokens(MESSAGES, family).tokens
    assert response.usage.completion_tokens == estimate_text_tokens("Hello, world!", family)


@pytest.mark.parametrize(("status", "retry_after"), [(500, None), (502, None), (503, None), (429, "0")])
async def test_transient_failures_are_retried_before_the_first_byte(
    fresh: Upstream, client: UpstreamClient, status: int, retry_after: str | None
) -> None:
    fresh.reset(Script(fail_first=2, fail_status=status, retry_after=retry_after))
    response = await make_provider(fresh, client).complete(chat())
    assert len(fresh.bodies) == 3
    assert response.body["choices"][0]["message"]["content"] == "Hello, world!"


@pytest.mark.parametrize(
    ("status", "error", "code"),
    [
        (500, ProviderError, "PROVIDER_ERROR"),
        (503, ProviderUnavailable, "PROVIDER_UNAVAILABLE"),
        (429, UpstreamRateLimited, "RATE_LIMITED"),
    ],
)
async def test_retries_stop_at_max_attempts(
    fresh: Upstream, client: UpstreamClient, status: int, error: type[ProviderError], code: str
) -> None:
    fresh.reset(Script(fail_first=10, fail_status=status))
    with pytest.raises(error) as raised:
        await make_provider(fresh, client, max_attempts=2).complete(chat())
    assert type(raised.value) is error
    assert raised.value.code == code
    assert raised.value.upstream_status == status
    assert len(fresh.bodies) == 2


async def test_a_long_retry_after_is_not_waited_for_but_reported(fresh: Upstream, client: UpstreamClient) -> None:
    fresh.reset(Script(fail_first=10, fail_status=429, retry_after="120"))
    with pytest.raises(ProviderUnavailable) as raised:
        await make_provider(fresh, client).complete(chat())
    assert raised.value.retry_after == 120.0
    assert len(fresh.bodies) == 1


async def test_client_errors_pass_through_with_the_upstream_body_and_are_not_retried(
    fresh: Upstream, client: UpstreamClient
) -> None:
    error_body = {
        "error": {
            "message": "This model's maximum context length is 128000 tokens.",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }
    fresh.reset(Script(fail_first=10, fail_status=400, fail_body=error_body))
    with pytest.raises(UpstreamRejected) as raised:
        await make_provider(fresh, client).complete(chat())
    assert raised.value.status == 400
    assert raised.value.body == error_body
    assert len(fresh.bodies) == 1


async def test_upstream_refusing_our_credentials_is_a_provider_error_not_a_401(
    fresh: Upstream, client: UpstreamClient
) -> None:
    provider = make_provider(fresh, client, api_key=SecretStr("sk-wrong"))
    with pytest.raises(ProviderError) as raised:
        await provider.complete(chat())
    assert type(raised.value) is ProviderError
    assert raised.value.status == 502
    assert "sk-wrong" not in str(raised.value)
    assert len(fresh.bodies) == 1


async def test_a_redirect_is_a_provider_error_that_is_neither_followed_nor_retried(
    fresh: Upstream, client: UpstreamClient
) -> None:
    fresh.reset(Script(fail_first=10, fail_status=302, fail_body={"moved": True}))
    with pytest.raises(ProviderError) as raised:
        await make_provider(fresh, client).complete(chat())
    assert type(raised.value) is ProviderError
    assert raised.value.upstream_status == 302
    assert len(fresh.bodies) == 1


async def test_connection_refused_is_unavailable_after_retries(client: UpstreamClient) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = OpenAICompatConfig(base_url=f"http://127.0.0.1:{port}/v1", backoff_base=0.01, max_attempts=2)
    provider = OpenAICompatProvider("local", config, client)
    with pytest.raises(ProviderUnavailable):
        await provider.complete(chat())


async def test_a_hanging_upstream_times_out_at_the_deadline_and_sees_the_disconnect(
    fresh: Upstream, client: UpstreamClient
) -> None:
    fresh.reset(Script(hang=True))
    started = time.monotonic()
    with pytest.raises(ProviderTimeout) as raised:
        await make_provider(fresh, client).complete(chat(deadline_in=0.3))
    elapsed = time.monotonic() - started
    assert raised.value.status == 504
    assert 0.25 <= elapsed < 2.0
    await asyncio.wait_for(fresh.disconnected.wait(), 2.0)
    assert len(fresh.bodies) == 1


async def test_a_passed_deadline_never_calls_the_upstream(fresh: Upstream, client: UpstreamClient) -> None:
    with pytest.raises(ProviderTimeout):
        await make_provider(fresh, client).complete(chat(deadline_in=-1))
    assert fresh.bodies == []


# --- streaming -----------------------------------------------------------------------------------------------


async def test_stream_forwards_chunks_and_hides_the_usage_chunk_the_client_did_not_ask_for(
    fresh: Upstream, client: UpstreamClient
) -> None:
    payloads, done = await read_stream(make_provider(fresh, client), chat({"stream": True, "custom": "x"}))
    sent = fresh.bodies[0]
    assert sent["stream"] is True
    assert sent["stream_options"] == {"include_usage": True}
    assert sent["custom"] == "x"
    chunks = [orjson.loads(p) for p in payloads]
    assert all(c["choices"] for c in chunks), "the usage-only chunk is stripped"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Hello, world!"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert done.usage.estimated is False
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (11, 4)
    assert done.finish_reason == "stop"


async def test_stream_keeps_the_usage_chunk_when_the_client_asked_and_bytes_are_untouched(
    fresh: Upstream, client: UpstreamClient
) -> None:
    body = {"stream": True, "stream_options": {"include_usage": True}}
    payloads, done = await read_stream(make_provider(fresh, client), chat(body))
    chunks = [orjson.loads(p) for p in payloads]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == UPSTREAM_USAGE
    assert payloads == [orjson.dumps(c) for c in chunks], "payloads are the upstream's bytes"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (11, 4)


async def test_a_stream_read_to_its_end_leaves_its_connection_for_the_next_call(
    fresh: Upstream, client: UpstreamClient
) -> None:
    provider = make_provider(fresh, client)
    for _ in range(3):
        payloads, _ = await read_stream(provider, chat({"stream": True}))
        assert payloads
    with_usage, _ = await read_stream(provider, chat({"stream": True, "stream_options": {"include_usage": True}}))
    assert orjson.loads(with_usage[-1])["usage"] == UPSTREAM_USAGE  # the upstream's last chunk, then the body's end
    assert len(fresh.peers) == 4 and None not in fresh.peers
    assert len(set(fresh.peers)) == 1, "every stream after the first reused the first one's connection"


async def test_stream_without_upstream_usage_is_estimated(fresh: Upstream, client: UpstreamClient) -> None:
    fresh.reset(Script(omit_usage=True))
    _, done = await read_stream(make_provider(fresh, client), chat({"stream": True}))
    assert done.usage.estimated is True
    assert done.usage.completion_tokens == estimate_text_tokens("Hello, world!", TokenizerFamily.OPENAI_O200K)


async def test_stream_is_retried_before_the_first_byte(fresh: Upstream, client: UpstreamClient) -> None:
    fresh.reset(Script(fail_first=1, fail_status=503))
    payloads, _ = await read_stream(make_provider(fresh, client), chat({"stream": True}))
    assert len(fresh.bodies) == 2
    assert payloads


async def test_a_stream_dropped_mid_way_is_not_retried(fresh: Upstream, client: UpstreamClient) -> None:
    fresh.reset(Script(drop_after_chunks=2))
    received: list[bytes] = []
    with pytest.raises(ProviderStreamInterrupted):
        await drain(make_provider(fresh, client), chat({"stream": True}), received)
    assert len(received) == 2
    assert len(fresh.bodies) == 1


async def test_a_stream_that_goes_silent_times_out_at_the_deadline(fresh: Upstream, client: UpstreamClient) -> None:
    fresh.reset(Script(silent_after_chunks=1))
    received: list[bytes] = []
    with pytest.raises(ProviderTimeout):
        await drain(make_provider(fresh, client), chat({"stream": True}, deadline_in=0.4), received)
    assert len(received) == 1
    await asyncio.wait_for(fresh.disconnected.wait(), 2.0)


async def test_cancelling_the_consumer_closes_the_upstream_connection(fresh: Upstream, client: UpstreamClient) -> None:
    fresh.reset(Script(endless=True))
    first = asyncio.Event()

    async def consume() -> None:
        async with make_provider(fresh, client).stream(chat({"stream": True}, deadline_in=30)) as events:
            async for _ in events:
                first.set()
                await asyncio.sleep(0)  # where a proxy would write to its client

    task = asyncio.create_task(consume())
    await asyncio.wait_for(first.wait(), 2.0)
    assert not fresh.disconnected.is_set()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(fresh.disconnected.wait(), 2.0)


def breaker_state(provider: OpenAICompatProvider) -> BreakerState:
    return provider.breaker.state


# --- circuit breaker and fallback ----------------------------------------------------------------------------


async def test_consecutive_failures_open_the_breaker_which_then_fails_fast(
    fresh: Upstream, client: UpstreamClient
) -> None:
    fresh.reset(Script(fail_first=2, fail_status=500))
    provider = make_provider(fresh, client, max_attempts=1, breaker_failure_threshold=2, breaker_cooldown=0.3)
    for _ in range(2):
        with pytest.raises(ProviderError):
            await provider.complete(chat())
    assert breaker_state(provider) is BreakerState.OPEN
    with pytest.raises(CircuitOpen) as raised:
        await provider.complete(chat())
    assert raised.value.code == "PROVIDER_UNAVAILABLE"
    assert raised.value.retry_after is not None and 0 < raised.value.retry_after <= 0.3
    with pytest.raises(CircuitOpen):
        async with provider.stream(chat({"stream": True})):
            pass
    assert len(fresh.bodies) == 2, "an open breaker does not call the upstream"
    await asyncio.sleep(0.35)
    response = await provider.complete(chat())  # the half-open probe succeeds and closes the breaker
    assert response.usage.prompt_tokens == 11
    assert breaker_state(provider) is BreakerState.CLOSED


async def test_registry_falls_back_to_the_next_model_when_the_provider_is_unavailable(
    fresh: Upstream, client: UpstreamClient
) -> None:
    fresh.reset(Script(fail_first=10, fail_status=503))
    catalog = ModelCatalog.builtin()
    config = {
        "providers": {
            "openai": {"type": "openai_compat", "base_url": fresh.url, "api_key": API_KEY, "max_attempts": 1}
        },
        "fallbacks": {"gpt-4o": ["gpt-4o-mini", "echo"]},
    }
    registry = ProviderRegistry.from_config(config, catalog, client)
    try:
        response = await registry.complete(chat())
        assert response.model == "echo"
        assert [b["model"] for b in fresh.bodies] == ["gpt-4o", "gpt-4o-mini"]
        fresh.reset(Script(fail_first=10, fail_status=503))
        _, done = await read_stream(registry, chat({"stream": True}))
        assert done.model == "echo"
        fresh.reset(Script(fail_first=10, fail_status=400))
        with pytest.raises(UpstreamRejected):
            await registry.complete(chat())
        assert len(fresh.bodies) == 1, "a client error is final: no fallback"
    finally:
        await registry.aclose()


def test_a_fallback_may_not_cost_more_than_the_model_it_replaces() -> None:
    catalog = ModelCatalog.builtin()
    with pytest.raises(ValueError, match="cost more"):
        ProviderRegistry(catalog, {}, {"gpt-4o-mini": ["gpt-4o"]})


def test_sse_decoder_reassembles_events_split_anywhere() -> None:
    from ibex_dataplane.providers.sse import SSEDecoder

    wire = (
        b': keep-alive\r\n\r\nevent: message\r\ndata: {"a":1}\r\n\r\ndata: line one\ndata: line two\n\ndata: [DONE]\n\n'
    )
    for size in (1, 2, 3, 7, len(wire)):
        decoder = SSEDecoder()
        payloads: list[bytes] = []
        for start in range(0, len(wire), size):
            payloads.extend(decoder.feed(wire[start : start + size]))
        payloads.extend(decoder.flush())
        assert payloads == [b'{"a":1}', b"line one\nline two", b"[DONE]"], size
    unterminated = SSEDecoder()
    assert unterminated.feed(b'data: {"last":true}') == []
    assert unterminated.flush() == [b'{"last":true}']
