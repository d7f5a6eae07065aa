"""Two-tier, versioned caches for what every request needs: API key records, policy snapshots, directives.

Tier 1 is in-process (a dict with a TTL, so the hot path does no I/O); tier 2 is Redis, under a *versioned* key:
the reconcile code never deletes a cached value, it increments the entry's version counter (after its Postgres
commit) and publishes an invalidation event. Readers fetch the version and the value of that version in one Lua
call, so a replica that loaded stale rows just before a commit can only ever write them under the old version,
which nobody reads again. The pub/sub event evicts tier 1 on every replica within milliseconds; the local TTL is
only a safety net. An epoch per entry stops a load that began before an invalidation from re-filling tier 1.

Both tiers are bounded, because the key cache is reached before authentication: every well-formed token names a key
id, and random ids must not grow memory. Tier 1 is an LRU of at most ``max_local`` entries; expired entries are
dropped when they are met and from the cold end whenever an entry is added; negative values (``None``: "no such
key") live ``negative_ttl`` seconds in Redis instead of ``redis_ttl``, so a flood of random ids costs Redis at most
its rate times that TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import orjson
from redis.commands.core import AsyncScript

from ibex_dataplane.store.redis import RedisClient, redis_errors

log = logging.getLogger(__name__)

T = TypeVar("T")

# KEYS[1] = version key. ARGV[1] = data key prefix (same hash tag as the version key).
_READ = """
local v = redis.call('GET', KEYS[1]) or '0'
return {v, redis.call('GET', ARGV[1] .. v)}
"""


@dataclass
class _Entry(Generic[T]):
    value: T
    expires: float


class TieredCache(Generic[T]):
    """A named family of cached values (e.g. "policy"), each addressed by a Redis version key."""

    def __init__(
        self,
        redis: RedisClient,
        *,
        encode: Callable[[T], bytes],
        decode: Callable[[bytes], T],
        local_ttl: float = 30.0,
        redis_ttl: int = 600,
        negative_ttl: int = 60,
        max_local: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
        on_lookup: Callable[[str], None] | None = None,
    ) -> None:
        self._on_lookup = on_lookup or (lambda tier: None)  # told which tier answered: local, redis or load
        self._redis = redis
        self._encode = encode
        self._decode = decode
        self._local_ttl = local_ttl
        self._redis_ttl = redis_ttl
        self._negative_ttl = negative_ttl
        self._max_local = max_local
        self._clock = clock
        self._local: OrderedDict[str, _Entry[T]] = OrderedDict()
        self._epochs: dict[str, int] = {}
        self._global_epoch = 0
        self._read: AsyncScript = redis.register_script(_READ)
        self.local_enabled = True

    def __len__(self) -> int:
        return len(self._local)

    def evict(self, version_key: str) -> None:
        self._local.pop(version_key, None)
        if len(self._epochs) >= self._max_local:
            # Forgetting per-key epochs is safe only together with a global bump: any load in flight is then stale.
            self._epochs.clear()
            self._global_epoch += 1
        self._epochs[version_key] = self._epochs.get(version_key, 0) + 1

    def clear(self) -> None:
        self._local.clear()
        self._global_epoch += 1

    async def get(self, version_key: str, load: Callable[[], Awaitable[T]]) -> T:
        entry = self._local.get(version_key)
        now = self._clock()
        if entry is not None:
            if entry.expires > now and self.local_enabled:
                self._local.move_to_end(version_key)
                self._on_lookup("local")
                return entry.value
            del self._local[version_key]
        epoch = (self._epochs.get(version_key, 0), self._global_epoch)
        prefix = version_key + ":v"
        with redis_errors():
            version, raw = await self._read(keys=[version_key], args=[prefix])
        if raw is not None:
            try:
                value = self._remember(version_key, epoch, self._decode(raw))
                self._on_lookup("redis")
                return value
            except (ValueError, KeyError, TypeError):
                pass  # written by another version of the codec: reload and overwrite it
        value = await load()
        self._on_lookup("load")
        ttl = self._negative_ttl if value is None else self._redis_ttl
        with redis_errors():
            await self._redis.set(prefix + version.decode(), self._encode(value), ex=ttl)
        return self._remember(version_key, epoch, value)

    def _remember(self, version_key: str, epoch: tuple[int, int], value: T) -> T:
        """Keep it locally unless an invalidation arrived while it was being read."""
        if self.local_enabled and epoch == (self._epochs.get(version_key, 0), self._global_epoch):
            now = self._clock()
            while self._local:  # drop expired entries from the cold end before adding one
                _, oldest = next(iter(self._local.items()))
                if oldest.expires > now:
                    break
                self._local.popitem(last=False)
            self._local[version_key] = _Entry(value, now + self._local_ttl)
            self._local.move_to_end(version_key)
            while len(self._local) > self._max_local:
                self._local.popitem(last=False)  # least recently used
        return value


class InvalidationListener:
    """Subscribes to the invalidation channel and evicts local cache entries on every event.

    While the subscription is down, local caching is switched off (every read goes to Redis), and when it comes
    back every local entry is dropped, so an event missed during the gap cannot leave a stale entry behind.
    """

    def __init__(
        self,
        redis: RedisClient,
        channel: str,
        handler: Callable[[dict[str, str]], None],
        caches: list[TieredCache[Any]],
    ) -> None:
        self._redis = redis
        self._channel = channel
        self._handler = handler
        self._caches = caches
        self._task: asyncio.Task[None] | None = None
        self.connected = asyncio.Event()

    def _set_local(self, enabled: bool) -> None:
        for cache in self._caches:
            cache.local_enabled = enabled
            cache.clear()

    async def start(self) -> None:
        self._set_local(False)
        self._task = asyncio.create_task(self._run(), name="ibex-invalidation")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            pubsub = self._redis.pubsub()
            try:
                await pubsub.subscribe(self._channel)
                self._set_local(True)
                self.connected.set()
                backoff = 0.05
                while True:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=5.0)
                    if message is None or message.get("type") != "message":
                        continue
                    try:
                        event = orjson.loads(message["data"])
                    except orjson.JSONDecodeError:
                        continue
                    if isinstance(event, dict):
                        self._handler({str(k): str(v) for k, v in event.items()})
            except asyncio.CancelledError:
                raise
            except Exception as e:  # connection lost: disable local caching until resubscribed
                self.connected.clear()
                self._set_local(False)
                log.warning("invalidation subscription lost (%s); retrying", type(e).__name__)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
            finally:
                with contextlib.suppress(Exception):  # closing a possibly broken connection
                    await pubsub.aclose()  # type: ignore[no-untyped-call]
