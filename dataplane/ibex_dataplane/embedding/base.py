"""The embedder seam: what the memory and context stages need from a sentence-embedding model.

Owns the ``Embedder`` protocol and the ``Embeddings`` array type. The memory write path (embed stage),
context assembly (query embedding) and tests depend on this protocol only; the composition root picks the
implementation (today ``ibex_dataplane.embedding.onnx.OnnxMiniLMEmbedder``).

Vectors are returned as one numpy ``float32`` array of shape ``(len(texts), dimensions)``, row ``i``
belonging to ``texts[i]``, C-contiguous and L2-normalised, so cosine similarity is a dot product. An array
rather than ``list[list[float]]`` because it is what pgvector's codecs and the similarity maths consume,
without a per-float Python object; call ``.tolist()`` where plain lists are needed. An empty input gives an
array of shape ``(0, dimensions)``.

``SparseEncoder`` is the seam of the learned-sparse (SPLADE) signal of memory search: a text becomes a
:class:`SparseVector` over a fixed vocabulary (today ``ibex_dataplane.embedding.splade.OnnxSpladeEncoder``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias

import numpy as np
import numpy.typing as npt

#: Rows of L2-normalised float32 vectors, one per input text.
Embeddings: TypeAlias = npt.NDArray[np.float32]


class Embedder(Protocol):
    """Turns texts into unit-length vectors of a fixed width.

    Implementations raise ``EmbeddingError`` for every failure of the model itself and ``TypeError`` when
    called with something that is not a sequence of strings (a bare ``str`` included).
    """

    @property
    def dimensions(self) -> int:
        """Width of every vector (384 for all-MiniLM-L6-v2)."""
        ...

    @property
    def model_name(self) -> str:
        """Identifier stored next to vectors, so vectors of different models are never compared."""
        ...

    async def embed(self, texts: Sequence[str]) -> Embeddings:
        """Embed ``texts`` without blocking the event loop."""
        ...

    def embed_sync(self, texts: Sequence[str]) -> Embeddings:
        """Embed ``texts``, blocking the calling thread; never call it from the event loop."""
        ...


@dataclass(frozen=True, slots=True)
class SparseVector:
    """Token ids (ascending, int32) and their weights (float32, > 0) of one text."""

    tokens: npt.NDArray[np.int32]
    weights: npt.NDArray[np.float32]

    def dot(self, other: SparseVector) -> float:
        """sum(w_a * w_b) over the tokens both hold."""
        _, mine, theirs = np.intersect1d(self.tokens, other.tokens, assume_unique=True, return_indices=True)
        return float(np.dot(self.weights[mine], other.weights[theirs]))

    def strongest(self, k: int) -> SparseVector:
        """The ``k`` largest weights (ties: the lower token id), in ascending token order; all of them if ``k`` <= 0."""
        if k <= 0 or len(self.tokens) <= k:
            return self
        keep = np.sort(np.argsort(-self.weights, kind="stable")[:k])
        return SparseVector(self.tokens[keep], self.weights[keep])


class SparseEncoder(Protocol):
    """Turns texts into sparse vocabulary weights; raises ``EmbeddingError`` for every failure of the model."""

    @property
    def model_name(self) -> str: ...

    async def encode(self, texts: Sequence[str]) -> list[SparseVector]:
        """One vector per text, in input order, without blocking the event loop."""
        ...
