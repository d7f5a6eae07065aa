"""``POST /v1/embeddings``: the OpenAI embeddings route, behind the same key, policy, rate-limit and budget gates
as generation, served by an upstream provider or by the built-in embedder (``ibex-minilm``, in process).

Gates after the shared ones: embedding model policy (the model must be an ``embedding`` model of the catalog the
org allows) -> rate limit (the inputs' estimated tokens) -> validation -> budget hold (the inputs at the model's
input price). No directive, session or memory context: an embedding is a function of its input. Accounting is the
generation pipeline's (:mod:`ibex_dataplane.proxy.accounting`): the hold is settled to the usage, the token
window corrected and the trace written with route ``embeddings``.

The built-in embedder is all-MiniLM-L6-v2 (384 dimensions, L2-normalised). Inputs longer than its 256 tokens are
truncated by the model, and each input is charged at most that much. Token-array inputs need an upstream (the
built-in model cannot read another tokenizer's ids): 400 for ``ibex-minilm``. ``encoding_format`` ``float`` and
``base64`` (little-endian float32, what the openai SDK asks for by default) are both served.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from ibex_dataplane.embedding.base import Embedder
from ibex_dataplane.embedding.errors import EmbeddingError
from ibex_dataplane.providers.base import EmbeddingRequest, EmbeddingResponse, Usage
from ibex_dataplane.providers.catalog import EMBEDDER_PROVIDER, ModelCatalog, ModelInfo
from ibex_dataplane.providers.errors import ProviderUnavailable
from ibex_dataplane.providers.tokens import estimate_text_tokens
from ibex_dataplane.shared.errors import ApiError

log = logging.getLogger(__name__)

MAX_INPUTS = 2048
ENCODINGS = ("float", "base64")
BUILTIN_DIMENSIONS = 384  # all-MiniLM-L6-v2


class LocalEmbedder:
    """The built-in embedder as an ``EmbeddingProvider`` of the registry (so fallback chains may end in it),
    loaded on first use (or given, when the process already has one: ``ibex dev``)."""

    name = EMBEDDER_PROVIDER

    def __init__(
        self, catalog: ModelCatalog, embedder: Embedder | None = None, factory: Callable[[], Embedder] | None = None
    ) -> None:
        self._catalog = catalog
        self._embedder = embedder
        self._factory = factory
        self._owned = False
        self._lock = asyncio.Lock()

    async def get(self) -> Embedder:
        if self._embedder is not None:
            return self._embedder
        async with self._lock:
            if self._embedder is None:
                if self._factory is None:
                    raise ProviderUnavailable("the built-in embedder is not available here", provider=EMBEDDER_PROVIDER)
                try:
                    self._embedder = await asyncio.to_thread(self._factory)
                except (EmbeddingError, OSError, RuntimeError) as e:
                    log.error("loading the built-in embedder failed: %s", type(e).__name__)
                    raise ProviderUnavailable("the built-in embedder could not be loaded",
                                              provider=EMBEDDER_PROVIDER) from e  # fmt: skip
                self._owned = True
            return self._embedder

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResponse:
        return await embed_locally(await self.get(), request, self._catalog.require(request.model))

    def close(self) -> None:
        closer = getattr(self._embedder, "close", None)
        if self._owned and callable(closer):
            closer()


def _texts(value: Any) -> list[str] | None:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    return None


def _token_arrays(value: Any) -> list[list[int]] | None:
    def ids(v: Any) -> bool:
        return isinstance(v, list) and bool(v) and all(isinstance(i, int) and not isinstance(i, bool) for i in v)

    if ids(value):
        return [value]
    if isinstance(value, list) and value and all(ids(v) for v in value):
        return list(value)
    return None


def validate_embeddings_body(body: Any, model: ModelInfo) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "VALIDATION_ERROR", "the request body is invalid",
                       field_errors=[{"field": "body", "message": "must be a JSON object"}])  # fmt: skip
    errors: list[dict[str, str]] = []
    value = body.get("input")
    texts, arrays = _texts(value), _token_arrays(value)
    if texts is None and arrays is None:
        errors.append({"field": "input", "message": "must be a string, a list of strings or of token arrays"})
    elif texts is not None and (not texts or len(texts) > MAX_INPUTS or any(not t for t in texts)):
        errors.append({"field": "input", "message": f"must hold 1 to {MAX_INPUTS} non-empty strings"})
    elif arrays is not None and len(arrays) > MAX_INPUTS:
        errors.append({"field": "input", "message": f"must hold at most {MAX_INPUTS} token arrays"})
    elif arrays is not None and model.provider == EMBEDDER_PROVIDER:
        errors.append({"field": "input", "message": f"'{model.name}' embeds text, not token arrays"})
    fmt = body.get("encoding_format")
    if fmt is not None and fmt not in ENCODINGS:
        errors.append({"field": "encoding_format", "message": "must be float or base64"})
    dims = body.get("dimensions")
    if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool) or dims < 1):
        errors.append({"field": "dimensions", "message": "must be a positive integer"})
    elif dims is not None and model.provider == EMBEDDER_PROVIDER and dims != BUILTIN_DIMENSIONS:
        errors.append({"field": "dimensions", "message": f"'{model.name}' has {BUILTIN_DIMENSIONS} dimensions"})
    if body.get("user") is not None and not isinstance(body.get("user"), str):
        errors.append({"field": "user", "message": "must be a string"})
    if errors:
        raise ApiError(400, "VALIDATION_ERROR", "the request body is invalid", field_errors=errors)
    return body


def input_tokens(body: Any, model: ModelInfo) -> int:
    """A conservative token count of the inputs (each capped at the model's input window), or 0 if unreadable."""
    value = body.get("input") if isinstance(body, dict) else None
    texts, arrays = _texts(value), _token_arrays(value)
    if texts is not None:
        return sum(min(estimate_text_tokens(t, model.tokenizer_family), model.context_window) for t in texts)
    if arrays is not None:
        return sum(len(a) for a in arrays)
    return 0


async def embed_locally(embedder: Embedder, request: EmbeddingRequest, model: ModelInfo) -> EmbeddingResponse:
    texts = _texts(request.body.get("input")) or []
    try:
        vectors = await embedder.embed(texts)
    except EmbeddingError as e:
        raise ProviderUnavailable("the built-in embedder failed", provider=EMBEDDER_PROVIDER) from e
    base64_out = request.body.get("encoding_format") == "base64"
    data = [
        {"object": "embedding", "index": i,
         "embedding": base64.b64encode(row.astype("<f4").tobytes()).decode() if base64_out else row.tolist()}
        for i, row in enumerate(np.asarray(vectors))
    ]  # fmt: skip
    tokens = sum(min(estimate_text_tokens(t, model.tokenizer_family), model.context_window) for t in texts)
    body = {"object": "list", "data": data, "model": model.name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}  # fmt: skip
    return EmbeddingResponse(body, Usage(tokens, 0, estimated=True), model.name, EMBEDDER_PROVIDER)
