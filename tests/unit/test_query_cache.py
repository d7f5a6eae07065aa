"""The query cache: keyed by organization and text, least recently used out first, frozen arrays, sparse merge."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from ibex_dataplane.embedding import SparseVector
from ibex_dataplane.memory.query_cache import QueryCache


def dense(value: float) -> np.ndarray:
    return np.full(384, value, dtype=np.float32)


def sparse(token: int) -> SparseVector:
    return SparseVector(np.array([token], dtype=np.int32), np.array([0.5], dtype=np.float32))


def test_an_entry_is_found_only_by_its_own_organization_and_text() -> None:
    cache = QueryCache(8)
    org, other = uuid.uuid4(), uuid.uuid4()
    cache.put(org, "where is the lighthouse", dense(1.0), sparse(7))
    found = cache.get(org, "where is the lighthouse")
    assert found is not None and float(found.dense[0]) == 1.0
    assert found.sparse is not None and found.sparse.tokens.tolist() == [7]
    assert cache.get(other, "where is the lighthouse") is None
    assert cache.get(org, "where is the lighthouse?") is None


def test_the_least_recently_used_entry_goes_first() -> None:
    cache = QueryCache(2)
    org = uuid.uuid4()
    cache.put(org, "a", dense(1.0), None)
    cache.put(org, "b", dense(2.0), None)
    assert cache.get(org, "a") is not None  # "a" is now the most recently used
    cache.put(org, "c", dense(3.0), None)
    assert len(cache) == 2
    assert cache.get(org, "b") is None
    assert cache.get(org, "a") is not None and cache.get(org, "c") is not None


def test_size_zero_keeps_nothing_and_a_negative_size_is_refused() -> None:
    cache = QueryCache(0)
    cache.put(uuid.uuid4(), "a", dense(1.0), None)
    assert len(cache) == 0
    with pytest.raises(ValueError, match="negative"):
        QueryCache(-1)


def test_kept_arrays_are_frozen_copies() -> None:
    cache = QueryCache(4)
    org = uuid.uuid4()
    vector = dense(1.0)
    cache.put(org, "a", vector, sparse(3))
    vector[0] = 9.0  # the caller's array changing later does not change the entry
    found = cache.get(org, "a")
    assert found is not None and float(found.dense[0]) == 1.0
    with pytest.raises(ValueError, match="read-only"):
        found.dense[0] = 2.0
    assert found.sparse is not None
    with pytest.raises(ValueError, match="read-only"):
        found.sparse.weights[0] = 2.0


def test_a_sparse_vector_already_kept_survives_an_update_without_one() -> None:
    cache = QueryCache(4)
    org = uuid.uuid4()
    cache.put(org, "a", dense(1.0), sparse(5))
    cache.put(org, "a", dense(1.0), None)  # a history read: no sparse leg
    found = cache.get(org, "a")
    assert found is not None and found.sparse is not None and found.sparse.tokens.tolist() == [5]
