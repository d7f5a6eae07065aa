"""Model providers: the catalog, conservative token estimates, and the adapters the proxy hands requests to.

The proxy's provider-handoff step talks to a ``ProviderRegistry`` (routing and fallback) built from a
``ModelCatalog``; adapters implement the ``Provider`` protocol of ``base``: the offline ``echo`` model, any
OpenAI-compatible upstream and Anthropic's Messages API (both on the shared HTTP machinery of ``http``); those
that embed also implement ``EmbeddingProvider``. ``tokens`` is shared with the context stage and the budget gate.
"""

from ibex_dataplane.providers.anthropic import AnthropicConfig, AnthropicProvider
from ibex_dataplane.providers.base import (
    ChatRequest,
    ChatResponse,
    EmbeddingProvider,
    EmbeddingRequest,
    EmbeddingResponse,
    Provider,
    StreamChunk,
    StreamDone,
    StreamEvent,
    Usage,
)
from ibex_dataplane.providers.catalog import ModelCatalog, ModelInfo
from ibex_dataplane.providers.echo import EchoProvider
from ibex_dataplane.providers.errors import (
    CircuitOpen,
    ProviderError,
    ProviderStreamInterrupted,
    ProviderTimeout,
    ProviderUnavailable,
    UnknownModel,
    UpstreamRateLimited,
    UpstreamRejected,
)
from ibex_dataplane.providers.openai_compat import OpenAICompatConfig, OpenAICompatProvider
from ibex_dataplane.providers.registry import ProviderRegistry
from ibex_dataplane.providers.tokens import (
    TokenEstimate,
    TokenEstimateKind,
    TokenizerFamily,
    estimate_chat_tokens,
    estimate_text_tokens,
)

__all__ = [
    "AnthropicConfig",
    "AnthropicProvider",
    "ChatRequest",
    "ChatResponse",
    "CircuitOpen",
    "EchoProvider",
    "EmbeddingProvider",
    "EmbeddingRequest",
    "EmbeddingResponse",
    "ModelCatalog",
    "ModelInfo",
    "OpenAICompatConfig",
    "OpenAICompatProvider",
    "Provider",
    "ProviderError",
    "ProviderRegistry",
    "ProviderStreamInterrupted",
    "ProviderTimeout",
    "ProviderUnavailable",
    "StreamChunk",
    "StreamDone",
    "StreamEvent",
    "TokenEstimate",
    "TokenEstimateKind",
    "TokenizerFamily",
    "UnknownModel",
    "UpstreamRateLimited",
    "UpstreamRejected",
    "Usage",
    "estimate_chat_tokens",
    "estimate_text_tokens",
]
