"""Errors raised by the embedding adapters.

Owns the one exception type every embedder raises, whatever failed underneath (a missing or corrupt model
file, a tokenizer that cannot be read, onnxruntime refusing an input, an embedder used after ``close()``).
The memory write path catches it and answers 503 (architecture section 9.2, stage 4); nothing else needs to
know which third-party library failed. Messages never contain the texts being embedded.
"""

from __future__ import annotations


class EmbeddingError(Exception):
    """Turning text into vectors failed; the cause, if any, is chained as ``__cause__``."""
