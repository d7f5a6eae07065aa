"""Fixtures for tests that drive the proxy over HTTP."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import pytest_asyncio

from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.settings import Settings

if TYPE_CHECKING:
    from tests.support.proxy import RunningProxy


@pytest_asyncio.fixture(scope="session")
async def proxy(settings: Settings, stores: Stores, pepper: bytes) -> AsyncIterator[RunningProxy]:
    from tests.support.proxy import running_proxy

    async with running_proxy(settings, stores, pepper) as running:
        yield running


@pytest_asyncio.fixture(scope="session")
async def second_proxy(settings: Settings, stores: Stores, pepper: bytes) -> AsyncIterator[RunningProxy]:
    """Another replica over the same stores (its own caches and invalidation subscription)."""
    from tests.support.proxy import running_proxy

    async with running_proxy(settings, stores, pepper) as running:
        yield running
