"""Open and close every store client a process needs, from settings or from an embedded runtime.

Used by the CLI (the composition root) and by the test fixtures, so both wire stores the same way.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import asyncpg
from pydantic import SecretStr

from ibex_dataplane.runtime.embedded import RuntimeInfo
from ibex_dataplane.runtime.errors import EmbeddedStoreError
from ibex_dataplane.settings import Settings
from ibex_dataplane.store.clickhouse import ClickHouse
from ibex_dataplane.store.migrations import default_migrations_dir, migrate_clickhouse, migrate_postgres
from ibex_dataplane.store.postgres import Database, close_pool, create_pool
from ibex_dataplane.store.redis import RedisClient, create_redis, discover

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreUrls:
    postgres_app_dsn: str
    postgres_admin_dsn: str | None
    redis_url: str
    clickhouse_url: str

    @classmethod
    def from_runtime(cls, info: RuntimeInfo) -> StoreUrls:
        return cls(info.postgres_app_dsn, info.postgres_admin_dsn, info.redis_url, info.clickhouse_url)

    @classmethod
    def from_settings(cls, settings: Settings) -> StoreUrls:
        """Each explicitly configured store wins; the others come from the embedded runtime recorded under the data
        dir (e.g. ``IBEX_CLICKHOUSE_URL`` alone gives a process beside ``ibex dev`` a ClickHouse of its own)."""

        def value(secret: SecretStr | None) -> str | None:
            return secret.get_secret_value() if secret else None

        postgres, admin = value(settings.postgres_dsn), value(settings.postgres_admin_dsn)
        redis, clickhouse = value(settings.redis_url), value(settings.clickhouse_url)
        if postgres and redis and clickhouse:
            return cls(postgres, admin, redis, clickhouse)
        runtime_file = settings.data_dir / "runtime.json"
        if not runtime_file.exists():
            raise EmbeddedStoreError(
                f"no store URLs configured (IBEX_POSTGRES_DSN, IBEX_REDIS_URL, IBEX_CLICKHOUSE_URL) and no embedded "
                f"runtime at {runtime_file}: start `ibex dev` or set the URLs"
            )
        info = RuntimeInfo.read(runtime_file)
        return cls(
            postgres or info.postgres_app_dsn,
            admin or (None if postgres else info.postgres_admin_dsn),  # never another server's admin DSN
            redis or info.redis_url,
            clickhouse or info.clickhouse_url,
        )


def migrations_dir(settings: Settings) -> Path:
    return settings.migrations_dir or default_migrations_dir()


async def migrate_all(urls: StoreUrls, settings: Settings, clickhouse: ClickHouse) -> None:
    if urls.postgres_admin_dsn is None:
        raise EmbeddedStoreError("migrations need IBEX_POSTGRES_ADMIN_DSN (a privileged role)")
    folder = migrations_dir(settings)
    await migrate_postgres(urls.postgres_admin_dsn, folder / "postgres")
    await migrate_clickhouse(clickhouse, folder / "clickhouse")


@dataclass
class Stores:
    """Open clients: the data plane's RLS-bound database, the privileged pool (operator work), Redis, ClickHouse."""

    db: Database
    admin_pool: asyncpg.Pool | None
    redis: RedisClient
    clickhouse: ClickHouse
    owns_clickhouse: bool = True

    @classmethod
    async def open(
        cls, urls: StoreUrls, settings: Settings, *, admin: bool = False, clickhouse: ClickHouse | None = None
    ) -> Stores:
        """Open every client; pass ``clickhouse`` to share an already open engine (chdb: one per data path)."""
        owns = clickhouse is None
        clickhouse = clickhouse or ClickHouse(urls.clickhouse_url)
        redis = create_redis(urls.redis_url)
        admin_pool: asyncpg.Pool | None = None
        try:
            if not await discover(redis):
                log.warning("Redis Cluster not reachable at startup; commands fail with 503 until it is")
            pool = await create_pool(
                urls.postgres_app_dsn,
                min_size=settings.postgres_pool_min,
                max_size=settings.postgres_pool_max,
                application_name="ibex-dataplane",
            )
            if admin and urls.postgres_admin_dsn:
                admin_pool = await create_pool(
                    urls.postgres_admin_dsn, min_size=1, max_size=4, application_name="ibex-admin"
                )
        except BaseException:
            await redis.aclose()
            if owns:
                await clickhouse.close()
            raise
        return cls(Database(pool), admin_pool, redis, clickhouse, owns)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.db.close()
        if self.admin_pool is not None:
            with contextlib.suppress(Exception):
                await close_pool(self.admin_pool)
        with contextlib.suppress(Exception):
            await self.redis.aclose()
        if self.owns_clickhouse:
            await self.clickhouse.close()


def load_or_create_secret(path: Path, nbytes: int = 32) -> bytes:
    """A local secret kept in the data dir (mode 0600), created on first use: e.g. the API key pepper."""
    try:
        return bytes.fromhex(path.read_text().strip())
    except FileNotFoundError:
        pass
    value = secrets.token_bytes(nbytes)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value.hex())
    return value
