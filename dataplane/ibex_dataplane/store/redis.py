"""Redis/Valkey client construction, the few operations that differ on a Redis Cluster, and error wrapping.

Keys come from :mod:`ibex_dataplane.store.keys` only. Every caller (the proxy's caches and rate limiter, the
memory stage's hot cache, the operator's invalidations and purges, health checks) gets its client from
:func:`create_redis`, which returns a standalone client for a ``redis://``/``rediss://`` URL and a cluster-aware
client for ``redis+cluster://``/``rediss+cluster://``. Both run the same commands: every tenant key carries its org
as the hash tag, so a Lua script or a transaction never spans slots, and PUBLISH reaches subscribers on any node.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import TypeAlias
from urllib.parse import unquote, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import (
    ClusterDownError,
    ClusterError,
    RedisClusterException,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ibex_dataplane.store.errors import StoreUnavailable

RedisClient: TypeAlias = aioredis.Redis | RedisCluster
"""What :func:`create_redis` returns; code that takes a Redis client accepts either."""

# A cluster that lost a primary, has unassigned slots, or is mid-resharding past the client's retries is as
# unavailable as an unreachable standalone server (redirections, MOVED/ASK, are followed by the client itself).
# redis-py raises RedisClusterException when no startup node answers; it also uses it for cross-slot misuse, which
# our keys cannot produce (every multi-key command and script stays inside one org's or one key id's hash tag).
REDIS_DOWN: tuple[type[BaseException], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    OSError,
    ClusterDownError,
    ClusterError,
    SlotNotCoveredError,
    TryAgainError,
    RedisClusterException,
)

CLUSTER_SCHEMES = {"redis+cluster": False, "rediss+cluster": True}
"""URL schemes that select the cluster client, mapped to whether they use TLS."""


class RedisUrlError(ValueError):
    """A ``redis+cluster://`` URL that names no usable node."""


def is_cluster_url(url: str) -> bool:
    return urlsplit(url).scheme in CLUSTER_SCHEMES


def _startup_nodes(netloc: str) -> list[ClusterNode]:
    hosts = netloc.rsplit("@", 1)[-1]
    nodes = []
    for part in hosts.split(","):
        host, sep, port = part.strip().rpartition(":")
        if not sep or not host or not port.isdigit():
            raise RedisUrlError("a cluster URL lists nodes as host:port[,host:port...]")
        nodes.append(ClusterNode(host.strip("[]"), int(port)))
    return nodes


def create_cluster(url: str, *, timeout: float = 2.0, max_connections: int = 200) -> RedisCluster:
    """A cluster client from ``redis+cluster://[user:password@]host:port[,host:port...]``; the listed nodes are
    only where discovery starts, the client learns the slot map from them and follows it as it changes."""
    parts = urlsplit(url)
    userinfo = parts.netloc.rsplit("@", 1)[0] if "@" in parts.netloc else ""
    username, _, password = userinfo.partition(":")
    return RedisCluster(
        startup_nodes=_startup_nodes(parts.netloc),
        username=unquote(username) or None,
        password=unquote(password) or None,
        ssl=CLUSTER_SCHEMES[parts.scheme],
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        max_connections=max_connections,
        health_check_interval=30,
        decode_responses=False,
    )


def create_redis(url: str, *, timeout: float = 2.0, max_connections: int = 200) -> RedisClient:
    """A pooled client; commands raise redis errors that callers wrap via :func:`unavailable`."""
    if is_cluster_url(url):
        return create_cluster(url, timeout=timeout, max_connections=max_connections)
    # A blocking pool waits (briefly) for a free connection under load instead of failing at once.
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        max_connections=max_connections,
        timeout=timeout,
        health_check_interval=30,
        decode_responses=False,
    )
    client: aioredis.Redis = aioredis.Redis.from_pool(pool)  # the client owns and closes the pool
    return client


async def discover(client: RedisClient) -> bool:
    """Learn a cluster's slot map now, before requests arrive; a no-op for a standalone client.

    redis-py's cluster client otherwise initializes on its first command, and concurrent first commands then race
    on half-set-up connections. An unreachable cluster is not fatal here (False): it initializes on first use and
    until then every command fails as :class:`StoreUnavailable`, like a standalone Redis that is down."""
    if not isinstance(client, RedisCluster):
        return True
    try:
        await client.initialize()
    except REDIS_DOWN:
        return False
    return True


async def scan_tagged(client: RedisClient, match: str, *, count: int = 500) -> AsyncIterator[bytes]:
    """Every key matching ``match``, a pattern that starts with a literal hash-tagged prefix (``ibex:{org}:*``).

    On a cluster all such keys live in the tag's slot, so only the primary serving that slot is scanned."""
    tag_end = match.find("}")
    if match.find("{") < 0 or tag_end < 0 or any(c in match[: tag_end + 1] for c in "*?[\\"):
        raise ValueError("scan_tagged needs a pattern whose literal prefix holds the hash tag")
    if isinstance(client, RedisCluster):
        node = client.get_node_from_key(match)
        async for key in client.scan_iter(match=match, count=count, target_nodes=node):
            yield key
    else:
        async for key in client.scan_iter(match=match, count=count):
            yield key


def unavailable(e: BaseException) -> StoreUnavailable:
    return StoreUnavailable("redis", type(e).__name__)


@contextmanager
def redis_errors() -> Iterator[None]:
    """Inside: an unreachable or timed-out Redis surfaces as :class:`StoreUnavailable` (the edges answer 503)."""
    try:
        yield
    except REDIS_DOWN as e:
        raise unavailable(e) from e


async def ping(client: RedisClient) -> None:
    with redis_errors():
        await client.ping()
