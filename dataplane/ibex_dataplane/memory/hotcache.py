"""The per-agent hot cache (architecture section 9.6): a bounded Redis sorted set of recent, high-value memory ids.

Owned by the memory stage: the outbox worker refreshes it after commit (:meth:`HotCache.sync`), the service reads
it (:meth:`HotCache.ids`) and always rehydrates the ids through Postgres, so a stale member can never resurrect a
forgotten or superseded memory. It holds ids and scores only, never content. Keys come from
:class:`~ibex_dataplane.store.keys.TenantKeys`; Redis failures surface as :class:`StoreUnavailable`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any
from uuid import UUID

from ibex_dataplane.memory.models import Memory, Tenant
from ibex_dataplane.store.keys import TenantKeys
from ibex_dataplane.store.redis import RedisClient, redis_errors

DEFAULT_SIZE = 200
# A memory's value moves it up by at most this much, in seconds: a very useful, confident memory ranks like one
# written a week later than it was.
_VALUE_BONUS_SECONDS = 7 * 86400.0


def hot_score(memory: Memory) -> float:
    """Recency (seconds since the epoch of its start of validity, or creation) plus a bonus for its value."""
    anchor = memory.valid_from or memory.created_at
    return anchor.timestamp() + _VALUE_BONUS_SECONDS * memory.usefulness * memory.confidence


class HotCache:
    def __init__(self, redis: RedisClient, *, size: int = DEFAULT_SIZE) -> None:
        self._redis = redis
        self._size = size

    @staticmethod
    def key(tenant: Tenant) -> str:
        return TenantKeys(tenant.org_id).hot_memories(tenant.agent_id)

    async def sync(self, tenant: Tenant, live: Iterable[Memory], gone: Iterable[UUID]) -> None:
        """Add or rescore ``live`` memories, drop ``gone`` ids, and trim the set to its bound, in one round trip."""
        key = self.key(tenant)
        scores = {str(m.id): hot_score(m) for m in live}
        removed = [str(i) for i in gone]
        if not scores and not removed:
            return
        with redis_errors():
            async with self._redis.pipeline(transaction=True) as pipe:
                if scores:
                    pipe.zadd(key, scores)
                if removed:
                    pipe.zrem(key, *removed)
                pipe.zremrangebyrank(key, 0, -(self._size + 1))
                await pipe.execute()

    async def ids(self, tenant: Tenant, limit: int) -> list[UUID]:
        """The ``limit`` highest-scoring ids, best first (members that are not ids are ignored)."""
        with redis_errors():
            raw: Sequence[Any] = await self._redis.zrevrange(self.key(tenant), 0, max(limit, 1) - 1)
        found: list[UUID] = []
        for member in raw:
            try:
                found.append(UUID(member.decode() if isinstance(member, bytes) else str(member)))
            except (ValueError, UnicodeDecodeError):
                continue
        return found

    async def remove(self, tenant: Tenant, ids: Sequence[UUID]) -> None:
        if not ids:
            return
        with redis_errors():
            await self._redis.zrem(self.key(tenant), *(str(i) for i in ids))
