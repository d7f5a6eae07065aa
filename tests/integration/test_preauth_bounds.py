"""Work before authentication is bounded: random well-formed API keys cannot grow the proxy's memory or Redis."""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
import uuid

import pytest

from ibex_dataplane.proxy.auth import KeyValidator, decode_key, encode_key
from ibex_dataplane.proxy.cache import TieredCache
from ibex_dataplane.proxy.repository import ProxyRepository
from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.security.apikeys import generate_key
from ibex_dataplane.shared.errors import ApiError
from ibex_dataplane.store.keys import GlobalKeys, TenantKeys


async def test_the_local_tier_is_an_lru_of_bounded_size_and_expired_entries_leave(stores: Stores) -> None:
    now = [0.0]
    cache: TieredCache[str | None] = TieredCache(
        stores.redis, encode=lambda v: (v or "").encode(), decode=lambda raw: raw.decode() or None,
        max_local=50, local_ttl=10, clock=lambda: now[0],
    )  # fmt: skip
    org = uuid.uuid4()
    keys = [TenantKeys(org).directive(uuid.uuid4()) for _ in range(200)]

    async def value() -> str:
        return "v"

    for key in keys:
        await cache.get(key, value)
    assert len(cache) == 50
    await cache.get(keys[150], value)  # recently used: survives the next insertions
    for key in keys[:40]:
        await cache.get(key, value)
    assert len(cache) == 50
    loads = 0

    async def counted() -> str:
        nonlocal loads
        loads += 1
        return "v"

    await cache.get(keys[150], counted)
    assert loads == 0  # still local
    now[0] = 11.0  # every local entry has expired
    await cache.get(keys[150], counted)
    assert len(cache) == 1  # expired entries were dropped as the fresh one came in


async def test_unknown_keys_are_cached_negatively_for_a_short_time_only(stores: Stores) -> None:
    cache: TieredCache[None] = TieredCache(stores.redis, encode=lambda v: b"", decode=lambda raw: None)
    key = GlobalKeys.api_key("k" + uuid.uuid4().hex[:16])

    async def nothing() -> None:
        return None

    await cache.get(key, nothing)
    ttl = await stores.redis.ttl(key + ":v0")
    assert 0 < ttl <= 60


async def test_random_tokens_keep_the_process_memory_flat(stores: Stores) -> None:
    cache = TieredCache(stores.redis, encode=encode_key, decode=decode_key, max_local=1_000)
    validator = KeyValidator(ProxyRepository(stores.db), cache, b"pepper-for-the-bounds-test")

    async def flood(n: int) -> None:
        async def one() -> None:
            with pytest.raises(ApiError) as refused:
                await validator.authenticate("Bearer " + generate_key().token)
            assert refused.value.code == "INVALID_TOKEN"

        for _ in range(n // 200):
            await asyncio.gather(*(one() for _ in range(200)))

    tracemalloc.start()
    try:
        await flood(3_000)  # warm: pools, prepared statements, the cache at its bound
        gc.collect()
        warm = tracemalloc.get_traced_memory()[0]
        await flood(9_000)
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(cache) <= 1_000
    # 9,000 more distinct ids; unbounded, each entry (key string, record, epoch) costs a few hundred bytes.
    assert after - warm < 512 * 1024, f"grew {after - warm} bytes"
