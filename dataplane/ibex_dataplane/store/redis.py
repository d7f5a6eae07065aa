"""Redis/Valkey client construction and error wrapping. Keys come from :mod:`ibex_dataplane.store.keys` only."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ibex_dataplane.store.errors import StoreUnavailable

REDIS_DOWN: tuple[type[BaseException], ...] = (RedisConnectionError, RedisTimeoutError, OSError)


def create_redis(url: str, *, timeout: float = 2.0, max_connections: int = 200) -> aioredis.Redis:
    """A pooled client; commands raise redis errors that callers wrap via :func:`unavailable`."""
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


def unavailable(e: BaseException) -> StoreUnavailable:
    return StoreUnavailable("redis", type(e).__name__)


@contextmanager
def redis_errors() -> Iterator[None]:
    """Inside: an unreachable or timed-out Redis surfaces as :class:`StoreUnavailable` (the edges answer 503)."""
    try:
        yield
    except REDIS_DOWN as e:
        raise unavailable(e) from e


async def ping(client: aioredis.Redis) -> None:
    with redis_errors():
        await client.ping()
