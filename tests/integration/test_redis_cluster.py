"""Every Redis user against a real three-primary Valkey Cluster on loopback: one slot per org, the rate limiter,
the versioned cache and its cross-node invalidation, the hot cache, the operator's org purge, and outages."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta

import orjson
import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from hypothesis import given
from hypothesis import strategies as st
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from ibex_dataplane.memory.hotcache import HotCache
from ibex_dataplane.memory.models import Memory, MemorySource, MemoryStatus, Tenant
from ibex_dataplane.proxy.cache import InvalidationListener, TieredCache
from ibex_dataplane.proxy.ratelimit import RateLimiter, RateLimits
from ibex_dataplane.runtime.embedded import free_port
from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.store.errors import StoreUnavailable
from ibex_dataplane.store.keys import GlobalKeys, TenantKeys
from ibex_dataplane.store.redis import RedisClient, create_redis, discover, ping
from ibex_operator.purge import TenantPurger
from ibex_operator.repository import TenantConfigRepository
from tests.support.valkey_cluster import ValkeyCluster, start_cluster


@pytest.fixture(scope="session")
def valkey_cluster() -> Iterator[ValkeyCluster]:
    with start_cluster() as cluster:
        yield cluster


@pytest_asyncio.fixture
async def cluster(valkey_cluster: ValkeyCluster) -> AsyncIterator[RedisClient]:
    client = create_redis(valkey_cluster.url)
    assert await discover(client)  # what Stores.open does
    try:
        yield client
    finally:
        await client.aclose()


def org_on(valkey_cluster: ValkeyCluster, port: int) -> uuid.UUID:
    """An org whose hash-tag slot is served by the node on ``port``."""
    while True:
        org = uuid.uuid4()
        if valkey_cluster.owner(key_slot(TenantKeys(org).policy().encode())) == port:
            return org


def all_keys_of(org: uuid.UUID) -> list[str]:
    keys = TenantKeys(org)
    agent = uuid.uuid4()
    return [
        keys.policy(),
        keys.policy() + ":v7",
        keys.rate_limit("agent", agent, "rpm"),
        keys.agent_rate_window(agent),
        keys.org_rate_window(),
        keys.directive(agent),
        keys.directive(agent) + ":v0",
        keys.hot_memories(agent),
        keys.key("anything", "else"),
    ]


async def keys_on_node(valkey_cluster: ValkeyCluster, port: int, pattern: str) -> set[bytes]:
    node = aioredis.Redis.from_url(valkey_cluster.node_url(port))
    try:
        return {k async for k in node.scan_iter(match=pattern)}
    finally:
        await node.aclose()


@given(st.uuids(), st.uuids(), st.from_regex(r"[A-Za-z0-9_.\-]{1,20}", fullmatch=True))
def test_every_tenant_key_of_one_org_maps_to_one_slot(org: uuid.UUID, agent: uuid.UUID, part: str) -> None:
    keys = TenantKeys(org)
    built = [
        keys.policy(),
        keys.rate_limit("agent", agent, part),
        keys.agent_rate_window(agent),
        keys.org_rate_window(),
        keys.directive(agent),
        keys.hot_memories(agent),
        keys.key(part),
        keys.key(part, part) + ":v12",
    ]
    assert {key_slot(k.encode()) for k in built} == {key_slot(str(org).encode())}
    api = GlobalKeys.api_key(part)
    assert key_slot(api.encode()) == key_slot((api + ":v3").encode()) == key_slot(part.encode())


async def test_the_servers_agree_with_the_client_on_each_orgs_slot(
    cluster: RedisClient, valkey_cluster: ValkeyCluster
) -> None:
    assert isinstance(cluster, RedisCluster)
    org = uuid.uuid4()
    slots = {int(await cluster.execute_command("CLUSTER KEYSLOT", k)) for k in all_keys_of(org)}
    assert slots == {key_slot(str(org).encode())}


async def test_the_rate_limiter_admits_exactly_the_limit_for_two_orgs_on_different_nodes(
    cluster: RedisClient, valkey_cluster: ValkeyCluster
) -> None:
    first, second = (org_on(valkey_cluster, p) for p in valkey_cluster.ports[:2])
    agent = uuid.uuid4()
    limiter = RateLimiter(cluster)
    limits = RateLimits(agent_rpm=None, agent_tpm=None, org_rpm=7, org_tpm=None)
    decisions = await asyncio.gather(*(limiter.admit(org, agent, limits, 10) for org in (first, second) * 12))
    admitted = {org: sum(d.allowed for d, o in zip(decisions, (first, second) * 12, strict=True) if o == org)
                for org in (first, second)}  # fmt: skip
    assert admitted == {first: 7, second: 7}
    for org, port in zip((first, second), valkey_cluster.ports[:2], strict=True):
        assert await keys_on_node(valkey_cluster, port, TenantKeys(org).pattern()) == {
            TenantKeys(org).org_rate_window().encode()
        }


async def test_the_tiered_cache_reloads_after_an_invalidation_published_on_another_node(
    cluster: RedisClient, valkey_cluster: ValkeyCluster
) -> None:
    key = TenantKeys(uuid.uuid4()).policy()
    loads: list[int] = []

    async def load() -> str:
        loads.append(1)
        return f"value-{len(loads)}"

    cache: TieredCache[str] = TieredCache(cluster, encode=lambda v: v.encode(), decode=lambda raw: raw.decode())
    evicted = asyncio.Event()

    def handle(event: dict[str, str]) -> None:
        cache.evict(event["key"])
        evicted.set()

    listener = InvalidationListener(cluster, GlobalKeys.INVALIDATION_CHANNEL, handle, [cache])
    await listener.start()
    try:
        await asyncio.wait_for(listener.connected.wait(), 10)
        assert await cache.get(key, load) == "value-1"
        other_replica: TieredCache[str] = TieredCache(cluster, encode=str.encode, decode=bytes.decode)
        assert await other_replica.get(key, load) == "value-1"  # tier 2 on the cluster: no second load
        assert loads == [1]

        await cluster.incr(key)
        assert await cache.get(key, load) == "value-1"  # tier 1 still holds it until the event
        subscribed = valkey_cluster.owner(key_slot(GlobalKeys.INVALIDATION_CHANNEL.encode()))
        elsewhere = next(p for p in valkey_cluster.ports if p != subscribed)
        publisher = aioredis.Redis.from_url(valkey_cluster.node_url(elsewhere))
        try:
            assert (await publisher.pubsub_numsub(GlobalKeys.INVALIDATION_CHANNEL))[0][1] == 0
            await publisher.publish(GlobalKeys.INVALIDATION_CHANNEL, orjson.dumps({"key": key}))
        finally:
            await publisher.aclose()
        await asyncio.wait_for(evicted.wait(), 10)
        assert await cache.get(key, load) == "value-2"
    finally:
        await listener.stop()


def memory(agent: uuid.UUID, days_ago: int) -> Memory:
    at = datetime.now(UTC) - timedelta(days=days_ago)
    return Memory(
        id=uuid.uuid4(), agent_id=agent, content="x", status=MemoryStatus.ACTIVE, labels=(),
        source=MemorySource.USER_PROVIDED, confidence=0.5, usefulness=0.0, valid_from=None, valid_until=None,
        observed_at=None, session_id=None, metadata={}, revision=1, retrieval_count=0, last_retrieved_at=None,
        created_at=at, updated_at=at,
    )  # fmt: skip


async def test_the_hot_cache_keeps_the_newest_ids_in_its_bound_on_a_cluster(
    cluster: RedisClient, valkey_cluster: ValkeyCluster
) -> None:
    tenants = [Tenant(org_on(valkey_cluster, p), uuid.uuid4()) for p in valkey_cluster.ports]
    hot = HotCache(cluster, size=3)
    for tenant in tenants:
        memories = [memory(tenant.agent_id, d) for d in range(5)]
        await hot.sync(tenant, memories, [memories[0].id])
        assert await hot.ids(tenant, 10) == [m.id for m in memories[1:4]]
        await hot.remove(tenant, [memories[1].id])
        assert await hot.ids(tenant, 10) == [m.id for m in memories[2:4]]


async def test_the_org_purge_removes_that_orgs_keys_on_its_node_and_no_other_orgs(
    cluster: RedisClient, valkey_cluster: ValkeyCluster, stores: Stores
) -> None:
    gone, neighbour, elsewhere = (
        org_on(valkey_cluster, p) for p in (valkey_cluster.ports[1],) * 2 + (valkey_cluster.ports[2],)
    )
    for org in (gone, neighbour, elsewhere):
        for k in all_keys_of(org):
            await cluster.set(k, b"1")
    assert stores.admin_pool is not None
    repo = TenantConfigRepository(stores.admin_pool, cluster)
    purger = TenantPurger(stores.admin_pool, cluster, stores.clickhouse, repo)

    report = await purger.purge_organization(str(uuid.uuid4()), "cluster", "gone", gone)

    assert report.total("redis") == len(all_keys_of(gone))
    for port in valkey_cluster.ports:
        assert await keys_on_node(valkey_cluster, port, TenantKeys(gone).pattern()) == set()
    assert len(await keys_on_node(valkey_cluster, valkey_cluster.ports[1], TenantKeys(neighbour).pattern())) == len(
        all_keys_of(neighbour)
    )
    assert len(await keys_on_node(valkey_cluster, valkey_cluster.ports[2], TenantKeys(elsewhere).pattern())) == len(
        all_keys_of(elsewhere)
    )


async def test_a_cluster_with_no_reachable_node_is_store_unavailable() -> None:
    client = create_redis(f"redis+cluster://127.0.0.1:{free_port()},127.0.0.1:{free_port()}", timeout=0.5)
    try:
        assert not await discover(client)
        with pytest.raises(StoreUnavailable):
            await ping(client)
    finally:
        await client.aclose()


def test_a_plain_url_gives_a_standalone_client_and_a_cluster_url_a_cluster_client() -> None:
    assert not isinstance(create_redis("redis://127.0.0.1:6379/0"), RedisCluster)
    client = create_redis("rediss+cluster://user:p%40ss@a.example:7000,b.example:7001")
    assert isinstance(client, RedisCluster)
    assert sorted(n.name for n in client.nodes_manager.startup_nodes.values()) == ["a.example:7000", "b.example:7001"]
