"""Routes a resolved model to its provider, with an optional fallback chain per model.

The proxy's provider-handoff step calls ``ProviderRegistry.complete`` / ``ProviderRegistry.stream`` (same contract
as a single ``Provider``, see ``base``). The registry looks the model up in the catalog, picks the provider the
catalog names, and, if that provider is unavailable or times out *before the first byte*
(``PROVIDER_UNAVAILABLE`` / ``PROVIDER_TIMEOUT``, including an open circuit breaker or an unconfigured provider),
tries the next model of the model's fallback chain while the deadline allows. Every other error (an upstream 4xx,
a 5xx ``PROVIDER_ERROR``, anything after the first chunk) is final. ``ChatResponse.model`` and ``StreamDone.model``
name the model that actually answered, which is the one to price.

A fallback may never cost more than the model it stands in for (input price, output price and max output must be
no higher), so the budget hold placed for the requested model still covers whichever model answers.

``from_config`` builds the registry from the catalog configuration's JSON shape::

    {"models": [...],
     "providers": {"openai": {"type": "openai_compat", "api_key": "...", ...},
                   "local-vllm": {"type": "openai_compat", "base_url": "http://127.0.0.1:8000/v1"},
                   "anthropic": {"type": "anthropic", "api_key_env": "ANTHROPIC_API_KEY"}},
     "fallbacks": {"gpt-4o": ["gpt-4o-mini", "echo"]}}
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ibex_dataplane.providers.anthropic import AnthropicConfig, AnthropicProvider
from ibex_dataplane.providers.base import (
    ChatRequest,
    ChatResponse,
    EmbeddingProvider,
    EmbeddingRequest,
    EmbeddingResponse,
    Provider,
    StreamEvent,
)
from ibex_dataplane.providers.breaker import BreakerState, CircuitBreaker
from ibex_dataplane.providers.catalog import ECHO_PROVIDER, CatalogConfigError, ModelCatalog
from ibex_dataplane.providers.echo import EchoProvider
from ibex_dataplane.providers.errors import ProviderTimeout, ProviderUnavailable
from ibex_dataplane.providers.openai_compat import OpenAICompatConfig, OpenAICompatProvider
from ibex_dataplane.providers.transport import UpstreamClient

__all__ = ["ProviderRegistry"]

logger = logging.getLogger(__name__)


class _OpenAICompatSpec(OpenAICompatConfig):
    type: Literal["openai_compat"] = "openai_compat"


class _AnthropicSpec(AnthropicConfig):
    type: Literal["anthropic"]


class _RegistrySpec(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    providers: dict[str, _AnthropicSpec | _OpenAICompatSpec] = Field(default_factory=dict)
    fallbacks: dict[str, list[str]] = Field(default_factory=dict)


def _parse(config: Mapping[str, Any]) -> _RegistrySpec:
    try:
        return _RegistrySpec.model_validate(config)
    except ValidationError as e:
        raise CatalogConfigError(f"invalid provider configuration: {e}") from e


class ProviderRegistry:
    """Catalog-driven routing from model names to ``Provider`` instances, with fallback chains."""

    def __init__(
        self,
        catalog: ModelCatalog,
        providers: Mapping[str, Provider | EmbeddingProvider],
        fallbacks: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        self._catalog = catalog
        self._providers = dict(providers)
        # What each provider serves, decided once: a runtime-checkable protocol's isinstance walks the protocol's
        # members on every call, and the chat path asks on every request.
        self._chat = {name: p for name, p in self._providers.items() if isinstance(p, Provider)}
        self._embedding = {name: p for name, p in self._providers.items() if isinstance(p, EmbeddingProvider)}
        self._chains: dict[str, tuple[str, ...]] = {}
        for model, chain in (fallbacks or {}).items():
            primary = catalog.require(model)
            seen = {model}
            for name in chain:
                fallback = catalog.require(name)
                if name in seen:
                    raise ValueError(f"fallback chain of {model!r} repeats {name!r}")
                seen.add(name)
                if (
                    fallback.input_price_per_mtok > primary.input_price_per_mtok
                    or fallback.output_price_per_mtok > primary.output_price_per_mtok
                    or fallback.max_output_tokens > primary.max_output_tokens
                ):
                    raise ValueError(f"fallback {name!r} may cost more than {model!r}, whose budget hold it uses")
            self._chains[model] = (model, *chain)

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any],
        catalog: ModelCatalog,
        client: UpstreamClient,
        builtin: Mapping[str, Provider | EmbeddingProvider] | None = None,
    ) -> ProviderRegistry:
        """Echo, the ``builtin`` providers the caller owns (the proxy's in-process embedder) and one provider per
        ``providers`` entry (``"type"``: ``openai_compat``, the default, or ``anthropic``), sharing ``client``
        (owned by the caller)."""
        spec = _parse(config)
        providers: dict[str, Provider | EmbeddingProvider] = {ECHO_PROVIDER: EchoProvider(catalog), **(builtin or {})}
        for name, provider_spec in spec.providers.items():
            fields = provider_spec.model_dump(exclude={"type"})
            if isinstance(provider_spec, _AnthropicSpec):
                providers[name] = AnthropicProvider(name, AnthropicConfig(**fields), client, catalog=catalog)
            else:
                providers[name] = OpenAICompatProvider(name, OpenAICompatConfig(**fields), client, catalog=catalog)
        try:
            return cls(catalog, providers, spec.fallbacks)
        except (ValueError, LookupError) as e:
            raise CatalogConfigError(f"invalid fallback configuration: {e}") from e

    @classmethod
    def check_config(cls, config: Mapping[str, Any], catalog: ModelCatalog) -> None:
        """Raise :class:`CatalogConfigError` for a configuration ``from_config`` would refuse (checked at start,
        before anything else is opened, so a mistake in the providers file stops a process at once)."""
        spec = _parse(config)
        try:
            cls(catalog, {}, spec.fallbacks)
        except (ValueError, LookupError) as e:
            raise CatalogConfigError(f"invalid fallback configuration: {e}") from e

    @property
    def catalog(self) -> ModelCatalog:
        return self._catalog

    def chain(self, model: str) -> tuple[str, ...]:
        """The model followed by its fallbacks, in the order they are tried."""
        return self._chains.get(model, (model,))

    def provider_for(self, model: str) -> Provider:
        """The chat provider serving ``model``; ``UnknownModel`` if uncatalogued, ``ProviderUnavailable`` if unset."""
        name = self._configured(model)
        provider = self._chat.get(name)
        if provider is None:
            raise ProviderUnavailable(f"provider of {model!r} serves no chat", provider=name)
        return provider

    def _configured(self, model: str) -> str:
        """The name of the configured provider of ``model``."""
        info = self._catalog.require(model)
        if info.provider not in self._providers:
            raise ProviderUnavailable(f"provider {info.provider!r} is not configured", provider=info.provider)
        return info.provider

    def _may_fall_back(
        self,
        error: Exception,
        model: str,
        index: int,
        chain: tuple[str, ...],
        request: ChatRequest | EmbeddingRequest,
    ) -> bool:
        if index + 1 >= len(chain) or request.remaining() <= 0:
            return False
        logger.warning(
            "falling back model=%s next=%s code=%s request_id=%s",
            model,
            chain[index + 1],
            getattr(error, "code", type(error).__name__),
            request.request_id,
        )
        return True

    async def complete(self, request: ChatRequest) -> ChatResponse:
        """``Provider.complete`` on the request's model, then on its fallbacks while they are unavailable."""
        chain = self.chain(request.model)
        for index, model in enumerate(chain):
            attempt = request if model == request.model else dataclasses.replace(request, model=model)
            try:
                return await self.provider_for(model).complete(attempt)
            except (ProviderUnavailable, ProviderTimeout) as e:
                if not self._may_fall_back(e, model, index, chain, request):
                    raise
        raise AssertionError("unreachable: a chain is never empty")  # pragma: no cover

    def breaker_states(self) -> dict[str, BreakerState]:
        """The circuit breaker state of every provider that has one (the network providers)."""
        return {
            name: breaker.state
            for name, provider in self._providers.items()
            if isinstance(breaker := getattr(provider, "breaker", None), CircuitBreaker)
        }

    def can_embed(self, model: str) -> bool:
        """Whether the provider of ``model`` serves embeddings (configured and able to)."""
        info = self._catalog.get(model)
        return info is not None and info.provider in self._embedding

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResponse:
        """``embed`` on the request's model, then on its fallbacks while they are unavailable."""
        chain = self.chain(request.model)
        for index, model in enumerate(chain):
            attempt = request if model == request.model else dataclasses.replace(request, model=model)
            provider = self._embedding.get(self._configured(model))
            if provider is None:
                raise ProviderUnavailable(f"provider of {model!r} serves no embeddings", provider=model)
            try:
                return await provider.embed(attempt)
            except (ProviderUnavailable, ProviderTimeout) as e:
                if not self._may_fall_back(e, model, index, chain, attempt):
                    raise
        raise AssertionError("unreachable: a chain is never empty")  # pragma: no cover

    @asynccontextmanager
    async def stream(
        self, request: ChatRequest, on_open: Callable[[str], None] | None = None
    ) -> AsyncIterator[AsyncIterator[StreamEvent]]:
        """``Provider.stream`` with fallback while opening; once a stream is open it is the answer. ``on_open`` is
        told which model of the chain opened it (before the first event, so a header can say so)."""
        chain = self.chain(request.model)
        async with AsyncExitStack() as stack:
            for index, model in enumerate(chain):
                attempt = request if model == request.model else dataclasses.replace(request, model=model)
                try:
                    events = await stack.enter_async_context(self.provider_for(model).stream(attempt))
                except (ProviderUnavailable, ProviderTimeout) as e:
                    if not self._may_fall_back(e, model, index, chain, request):
                        raise
                    continue
                if on_open is not None:
                    on_open(model)
                yield events
                return

    async def aclose(self) -> None:
        """Close every provider (each closes only what it owns)."""
        for provider in self._providers.values():
            if isinstance(provider, Provider):
                await provider.aclose()
