"""The two-tier versioned cache: local hits, version bumps reload, stale or foreign encodings never stick."""

from __future__ import annotations

import uuid

from ibex_dataplane.proxy.cache import TieredCache
from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.store.keys import TenantKeys


def cache(stores: Stores) -> TieredCache[str]:
    return TieredCache(stores.redis, encode=lambda v: v.encode(), decode=lambda raw: raw.decode("ascii"))


async def test_loads_once_then_serves_locally_and_reloads_after_a_version_bump(stores: Stores) -> None:
    key = TenantKeys(uuid.uuid4()).policy()
    loads: list[int] = []

    async def load() -> str:
        loads.append(1)
        return f"value-{len(loads)}"

    c = cache(stores)
    assert await c.get(key, load) == "value-1"
    assert await c.get(key, load) == "value-1"
    assert len(loads) == 1
    other_replica = cache(stores)
    assert await other_replica.get(key, load) == "value-1"  # from Redis, no second load
    assert len(loads) == 1
    await stores.redis.incr(key)  # what the reconcile code does after a commit
    c.evict(key)  # what the invalidation event does
    assert await c.get(key, load) == "value-2"


async def test_a_value_that_no_longer_decodes_is_reloaded_and_replaced(stores: Stores) -> None:
    key = TenantKeys(uuid.uuid4()).policy()
    await stores.redis.set(key + ":v0", "not ascii: é".encode())

    async def load() -> str:
        return "fresh"

    assert await cache(stores).get(key, load) == "fresh"
    assert await stores.redis.get(key + ":v0") == b"fresh"


async def test_a_load_that_raced_an_invalidation_is_not_kept_locally(stores: Stores) -> None:
    key = TenantKeys(uuid.uuid4()).policy()
    c = cache(stores)
    calls: list[str] = []

    async def load() -> str:
        calls.append("load")
        c.evict(key)  # the invalidation arrives while the rows are being read
        return f"stale-{len(calls)}"

    assert await c.get(key, load) == "stale-1"
    await stores.redis.incr(key)
    assert await c.get(key, load) == "stale-2"  # reloaded: the raced value was not kept in the process
