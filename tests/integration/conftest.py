"""Fixtures for tests that drive the proxy (and the memory stage behind it) over HTTP."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING

import pytest
import pytest_asyncio

from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.settings import Settings

if TYPE_CHECKING:
    from tests.support.proxy import MemoryDeps, RunningProxy


@pytest.fixture(scope="session")
def memory_deps() -> Iterator[MemoryDeps]:
    """The real ONNX embedder and Presidio redactor, built once per session (they take seconds to load)."""
    from ibex_dataplane.embedding.onnx import OnnxMiniLMEmbedder
    from ibex_dataplane.pii.redactor import PiiRedactor
    from tests.support.proxy import MemoryDeps

    with OnnxMiniLMEmbedder.from_installed_packages() as embedder, PiiRedactor() as redactor:
        yield MemoryDeps(embedder, redactor)


@pytest_asyncio.fixture(scope="session")
async def proxy(
    settings: Settings, stores: Stores, pepper: bytes, memory_deps: MemoryDeps
) -> AsyncIterator[RunningProxy]:
    from tests.support.proxy import running_proxy

    async with running_proxy(settings, stores, pepper, memory=memory_deps) as running:
        yield running


@pytest_asyncio.fixture(scope="session")
async def second_proxy(settings: Settings, stores: Stores, pepper: bytes) -> AsyncIterator[RunningProxy]:
    """Another replica over the same stores (its own caches and invalidation subscription)."""
    from tests.support.proxy import running_proxy

    async with running_proxy(settings, stores, pepper) as running:
        yield running
