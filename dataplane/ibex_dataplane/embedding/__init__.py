"""Sentence embeddings for the memory write path and context assembly (architecture sections 9.2 and 15).

``base`` holds the ``Embedder`` protocol the stages depend on; ``onnx`` holds the in-process
all-MiniLM-L6-v2 implementation, imported from there by the composition root only, so that importing the
protocol does not load onnxruntime.
"""

from ibex_dataplane.embedding.base import Embedder, Embeddings, SparseEncoder, SparseVector
from ibex_dataplane.embedding.errors import EmbeddingError

__all__ = ["Embedder", "EmbeddingError", "Embeddings", "SparseEncoder", "SparseVector"]
