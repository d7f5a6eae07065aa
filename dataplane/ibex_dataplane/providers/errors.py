"""Errors raised by model providers, the catalog and the registry.

Each error carries the envelope ``code`` and the HTTP ``status`` the proxy should answer with; the mapping to an
HTTP response (or to an SSE error event once a stream has started) happens only in the proxy. Messages are safe
to show to a client: they never contain prompt content, upstream bodies of 5xx answers, or credentials.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

__all__ = [
    "CircuitOpen",
    "ProviderError",
    "ProviderStreamInterrupted",
    "ProviderTimeout",
    "ProviderUnavailable",
    "TransportError",
    "UnknownModel",
    "UpstreamRateLimited",
    "UpstreamRejected",
]


class ProviderError(Exception):
    """The provider failed in a way the client cannot fix: envelope ``PROVIDER_ERROR``, HTTP 502."""

    code: ClassVar[str] = "PROVIDER_ERROR"
    default_status: ClassVar[int] = 502

    def __init__(
        self,
        message: str,
        *,
        provider: str,
        retry_after: float | None = None,
        upstream_status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.provider = provider
        self.retry_after = retry_after
        self.upstream_status = upstream_status

    @property
    def status(self) -> int:
        """HTTP status for the proxy's answer."""
        return self.default_status


class ProviderUnavailable(ProviderError):
    """The provider cannot take the call now (connection refused, 429/503 after retries, breaker open): 503."""

    code: ClassVar[str] = "PROVIDER_UNAVAILABLE"
    default_status: ClassVar[int] = 503


class UpstreamRateLimited(ProviderUnavailable):
    """The upstream kept answering 429 through every retry: forwarded as 429 ``RATE_LIMITED`` with the upstream's
    ``Retry-After``. Still unavailability, so a fallback model may serve instead."""

    code: ClassVar[str] = "RATE_LIMITED"
    default_status: ClassVar[int] = 429


class CircuitOpen(ProviderUnavailable):
    """The provider's circuit breaker is open; the upstream was not called. ``retry_after`` is the cool-down left."""


class ProviderTimeout(ProviderError):
    """The request's deadline passed before the provider answered: ``PROVIDER_TIMEOUT``, HTTP 504."""

    code: ClassVar[str] = "PROVIDER_TIMEOUT"
    default_status: ClassVar[int] = 504


class ProviderStreamInterrupted(ProviderError):
    """A stream failed after its first chunk was delivered; the HTTP status is already sent (502 for logs)."""


class UpstreamRejected(ProviderError):
    """The upstream refused the request itself (a 4xx other than 401/403/429): pass status and body through.

    ``body`` is the upstream's OpenAI error body (``{"error": {...}}``), already parsed; ``status`` is the
    upstream's status code.
    """

    code: ClassVar[str] = "UPSTREAM_REJECTED"

    def __init__(self, message: str, *, provider: str, upstream_status: int, body: Mapping[str, Any]) -> None:
        super().__init__(message, provider=provider, upstream_status=upstream_status)
        self.body = body

    @property
    def status(self) -> int:
        """The upstream's own status code."""
        assert self.upstream_status is not None
        return self.upstream_status


class TransportError(Exception):
    """The connection to an upstream failed: refused, reset, closed before the answer ended, or a malformed
    answer (:mod:`ibex_dataplane.providers.transport`). Never reaches a client: the providers turn it into one of
    the errors above."""


class UnknownModel(LookupError):
    """A model name that is not in the catalog (the proxy validates models before this can happen)."""

    def __init__(self, model: str) -> None:
        super().__init__(f"unknown model: {model!r}")
        self.model = model
