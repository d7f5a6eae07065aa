"""The HTTP work every network model provider shares: attempts, retries, the breaker, status mapping.

``OpenAICompatProvider`` and ``AnthropicProvider`` subclass :class:`HttpProvider` and add only their wire format.
Resilience, all before the first byte of the upstream's answer only: jittered exponential backoff on connection
errors, 429 and 5xx (honouring a short ``Retry-After``), up to ``max_attempts``; a circuit breaker per provider;
the request's deadline bounds every wait, including backoff sleeps. Once an upstream has answered 200 nothing is
retried.

Upstream status mapping: 400/404/409/413/422 and other 4xx pass through as ``UpstreamRejected`` with the upstream
body (the client's request is at fault); 401/403 become ``PROVIDER_ERROR`` (our credentials are at fault, and the
client must not think its own key was refused); 429 after retries is ``UpstreamRateLimited`` (429
``RATE_LIMITED`` with the upstream's ``Retry-After``); 502, 503, 504 and 529 after retries become
``PROVIDER_UNAVAILABLE``; other 5xx become ``PROVIDER_ERROR``. Logs carry provider, status, attempt and request
id; never bodies or the API key.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Mapping
from typing import Any, Final, NoReturn

import orjson
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from ibex_dataplane.providers.base import ChatRequest, EmbeddingRequest, Usage
from ibex_dataplane.providers.breaker import CircuitBreaker
from ibex_dataplane.providers.catalog import ModelCatalog
from ibex_dataplane.providers.errors import (
    CircuitOpen,
    ProviderError,
    ProviderTimeout,
    ProviderUnavailable,
    TransportError,
    UpstreamRateLimited,
    UpstreamRejected,
)
from ibex_dataplane.providers.tokens import TokenizerFamily, estimate_chat_tokens, estimate_text_tokens
from ibex_dataplane.providers.transport import UpstreamClient, UpstreamResponse

__all__ = ["HttpProvider", "HttpProviderConfig", "retry_after_seconds"]

AnyRequest = ChatRequest | EmbeddingRequest

logger = logging.getLogger(__name__)

_MAX_ERROR_BODY: Final = 64 * 1024
_CREDENTIAL_STATUSES: Final = frozenset({401, 403, 407})
_UNAVAILABLE_STATUSES: Final = frozenset({502, 503, 504, 529})


class HttpProviderConfig(BaseModel):
    """Settings every HTTP upstream shares (one entry of the ``providers`` section of the catalog configuration)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    base_url: str = Field(description="Prefix of the API's paths, e.g. https://api.openai.com/v1.")
    api_key: SecretStr | None = Field(default=None, description="Bearer token for the upstream, if it needs one.")
    connect_timeout: float = Field(default=5.0, gt=0, description="Seconds to establish a connection.")
    read_timeout: float = Field(default=60.0, gt=0, description="Longest silence between bytes of an answer.")
    max_attempts: int = Field(default=3, ge=1, description="Attempts per call, the first one included.")
    backoff_base: float = Field(default=0.2, gt=0, description="Backoff before retry n: up to base * 2**(n-1) s.")
    backoff_max: float = Field(default=2.0, gt=0, description="Cap of one backoff sleep (seconds).")
    max_retry_after: float = Field(default=5.0, ge=0, description="Longer upstream Retry-After: do not retry.")
    breaker_failure_threshold: int = Field(default=5, ge=1, description="Consecutive failures that open it.")
    breaker_cooldown: float = Field(default=30.0, gt=0, description="Seconds the breaker stays open.")
    headers: dict[str, str] = Field(default_factory=dict, description="Extra request headers.")


class _Retryable(Exception):
    """One failed attempt that may be retried; carries the error to raise if no attempt is left."""

    def __init__(self, error: ProviderError) -> None:
        super().__init__(error.message)
        self.error = error


class HttpProvider:
    """The HTTP work every network provider shares, over a shared :class:`UpstreamClient` it does not own."""

    def __init__(
        self,
        name: str,
        config: HttpProviderConfig,
        client: UpstreamClient,
        *,
        path: str,
        auth_headers: Mapping[str, str],
        catalog: ModelCatalog | None = None,
        breaker: CircuitBreaker | None = None,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self._name = name
        self._config = config
        self._client = client
        self._catalog = catalog
        self._base_url = config.base_url.rstrip("/")
        self._url = self._base_url + path
        self._breaker = breaker or CircuitBreaker(
            failure_threshold=config.breaker_failure_threshold, cooldown=config.breaker_cooldown
        )
        self._jitter = jitter
        self._headers: Mapping[str, str] = {"Content-Type": "application/json", **auth_headers, **config.headers}

    @property
    def name(self) -> str:
        return self._name

    @property
    def breaker(self) -> CircuitBreaker:
        return self._breaker

    async def aclose(self) -> None:
        return None  # the client belongs to whoever created it

    # --- attempts ------------------------------------------------------------------------------------------

    def _remaining(self, request: AnyRequest) -> float:
        remaining = request.remaining()
        if remaining <= 0:
            raise ProviderTimeout("deadline passed before the upstream answered", provider=self._name)
        return remaining

    def _timeout_error(self, request: AnyRequest, what: str) -> ProviderError:
        if request.remaining() <= 0:
            return ProviderTimeout(f"deadline passed while {what}", provider=self._name)
        return ProviderUnavailable(f"upstream went silent while {what}", provider=self._name)

    async def _read_json(self, request: AnyRequest, response: UpstreamResponse) -> Any:
        """The whole answer of an opened request, decoded, within the request's deadline. A silent or broken
        upstream counts as a failure for the breaker; the connection is released either way."""
        try:
            self._remaining(request)
            raw = await response.read()  # within the request's deadline, which the response was opened with
        except TimeoutError as e:
            response.close()
            self._breaker.record_failure()
            raise self._timeout_error(request, "reading the answer") from e
        except TransportError as e:
            response.close()
            self._breaker.record_failure()
            raise ProviderError("upstream connection broke while answering", provider=self._name) from e
        except BaseException:
            response.close()
            raise
        response.release()
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise ProviderError("upstream answered with invalid JSON", provider=self._name) from e

    async def _open(
        self, request: AnyRequest, payload: bytes, *, accept: str, url: str | None = None
    ) -> UpstreamResponse:
        """Send the request until an attempt gets a 200 (returned, unread) or no attempt is left."""
        headers = {**self._headers, "Accept": accept, "X-Request-ID": request.request_id}
        attempt = 0
        while True:
            attempt += 1
            wait = self._breaker.allow()
            if wait is not None:
                raise CircuitOpen("provider circuit breaker is open", provider=self._name, retry_after=wait)
            try:
                return await self._attempt(request, payload, headers, url or self._url)
            except _Retryable as failure:
                error = failure.error
                logger.warning(
                    "provider attempt failed provider=%s attempt=%d status=%s code=%s request_id=%s",
                    self._name,
                    attempt,
                    error.upstream_status,
                    error.code,
                    request.request_id,
                )
                if attempt >= self._config.max_attempts:
                    raise error from failure.__cause__
                if error.retry_after is not None and error.retry_after > self._config.max_retry_after:
                    raise error from failure.__cause__
                cap = min(self._config.backoff_max, self._config.backoff_base * 2 ** (attempt - 1))
                delay = max(cap * self._jitter(), error.retry_after or 0.0)
                if delay >= request.remaining():
                    raise error from failure.__cause__
                await asyncio.sleep(delay)

    async def _attempt(
        self, request: AnyRequest, payload: bytes, headers: Mapping[str, str], url: str
    ) -> UpstreamResponse:
        self._remaining(request)
        config = self._config
        try:
            response = await self._client.post(
                url, payload, headers, connect_timeout=config.connect_timeout, read_timeout=config.read_timeout,
                deadline=request.deadline,
            )  # fmt: skip
        except TimeoutError as e:
            self._breaker.record_failure()
            error = self._timeout_error(request, "waiting for the upstream")
            if isinstance(error, ProviderTimeout):
                raise error from e
            raise _Retryable(error) from e
        except TransportError as e:
            self._breaker.record_failure()
            raise _Retryable(ProviderUnavailable("cannot reach the upstream", provider=self._name)) from e
        if response.status == 200:
            self._breaker.record_success()
            return response
        try:
            await self._raise_for_status(request, response)
        finally:
            response.close()

    async def _raise_for_status(self, request: AnyRequest, response: UpstreamResponse) -> NoReturn:
        status = response.status
        retry_after = retry_after_seconds(response.headers.get("retry-after"))
        if status == 429:
            raise _Retryable(
                UpstreamRateLimited(
                    "upstream is rate limiting", provider=self._name, retry_after=retry_after, upstream_status=status
                )
            )
        if status >= 500:
            self._breaker.record_failure()
            kind = ProviderUnavailable if status in _UNAVAILABLE_STATUSES else ProviderError
            raise _Retryable(
                kind(
                    f"upstream failed with status {status}",
                    provider=self._name,
                    retry_after=retry_after,
                    upstream_status=status,
                )
            )
        self._breaker.record_success()  # the upstream is healthy; it refused this request
        if status in _CREDENTIAL_STATUSES:
            logger.error(
                "upstream refused our credentials provider=%s status=%d request_id=%s",
                self._name,
                status,
                request.request_id,
            )
            raise ProviderError(
                "upstream refused the gateway's credentials", provider=self._name, upstream_status=status
            )
        if 400 <= status < 500:
            body = await self._error_body(request, response)
            raise UpstreamRejected(
                f"upstream rejected the request with status {status}",
                provider=self._name,
                upstream_status=status,
                body=body,
            )
        raise ProviderError(f"unexpected upstream status {status}", provider=self._name, upstream_status=status)

    async def _error_body(self, request: AnyRequest, response: UpstreamResponse) -> dict[str, Any]:
        raw = b""
        try:
            async with asyncio.timeout(self._remaining(request)):
                raw = await response.read_upto(_MAX_ERROR_BODY)
        except (TimeoutError, TransportError, ProviderTimeout):
            pass
        try:
            parsed = orjson.loads(raw)
        except orjson.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
            return parsed
        message = raw.decode("utf-8", errors="replace")[:1000] or f"status {response.status}"
        return {"error": {"message": message, "type": "upstream_error", "param": None, "code": None}}

    # --- usage ---------------------------------------------------------------------------------------------

    def _estimate_usage(self, request: ChatRequest, completion_text: str) -> Usage:
        info = self._catalog.get(request.model) if self._catalog is not None else None
        family = info.tokenizer_family if info is not None else TokenizerFamily.GENERIC
        tools = request.body.get("tools")
        prompt = estimate_chat_tokens(request.messages, family, tools=tools if isinstance(tools, list) else None)
        return Usage(prompt.tokens, estimate_text_tokens(completion_text, family), estimated=True)


def retry_after_seconds(value: str | None) -> float | None:
    """Seconds of a ``Retry-After`` header (an HTTP date is ignored: rare from model APIs)."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if seconds >= 0 else None
