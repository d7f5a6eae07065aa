"""The encodings of recent search queries, so that a repeated query skips both models.

An agent in a tool loop has its context assembled once per step, and the search query (its latest user turn) does
not change while tools run; without this each repeat pays a dense and a sparse model run, about two thirds of a
search's CPU on a small machine. Entries are keyed by the organization and a digest of the *masked* query text, so
one organization's searches never answer, or speed up, another's (no timing signal crosses tenants), and no query
text is kept. The least recently used entry goes first. The models are fixed for the life of the process, so an
entry never goes stale; the arrays are frozen so no caller can change what the next one reads.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any
from uuid import UUID

import numpy as np

from ibex_dataplane.embedding import SparseVector


@dataclass(frozen=True, slots=True)
class QueryEncoding:
    """The dense vector of a query and, once a current read has computed it, its sparse vector."""

    dense: np.ndarray[Any, Any]
    sparse: SparseVector | None


class QueryCache:
    """At most ``size`` query encodings, least recently used out first; ``size`` 0 keeps nothing."""

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError("the query cache size cannot be negative")
        self._size = size
        self._entries: OrderedDict[tuple[UUID, bytes], QueryEncoding] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, org_id: UUID, text: str) -> QueryEncoding | None:
        key = (org_id, _digest(text))
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
        return found

    def put(self, org_id: UUID, text: str, dense: np.ndarray[Any, Any], sparse: SparseVector | None) -> None:
        """Keep a query's encodings; a sparse vector already kept stays when this call has none."""
        if self._size == 0:
            return
        key = (org_id, _digest(text))
        seen = self._entries.get(key)
        if sparse is None and seen is not None:
            sparse = seen.sparse
        self._entries[key] = QueryEncoding(_frozen(dense), None if sparse is None else _frozen_sparse(sparse))
        self._entries.move_to_end(key)
        while len(self._entries) > self._size:
            self._entries.popitem(last=False)


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _frozen(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    if not array.flags.writeable:
        return array
    copy = np.array(array, copy=True)
    copy.setflags(write=False)
    return copy


def _frozen_sparse(vector: SparseVector) -> SparseVector:
    tokens, weights = _frozen(vector.tokens), _frozen(vector.weights)
    if tokens is vector.tokens and weights is vector.weights:
        return vector
    return SparseVector(tokens, weights)
