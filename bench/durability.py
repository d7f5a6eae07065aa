"""The Postgres durability the benchmarks run with: production's, whatever the embedded runtime defaults to."""

from __future__ import annotations

import asyncio


async def production_durability(admin_dsn: str | None) -> dict[str, str]:
    """Give the embedded Postgres the durability of production, whose defaults it otherwise trades for speed: every
    commit waits for its WAL flush (``synchronous_commit = on``). Returns the settings as a new session sees them."""
    import asyncpg

    assert admin_dsn is not None
    conn = await asyncpg.connect(admin_dsn)
    try:
        await conn.execute("ALTER SYSTEM SET synchronous_commit = 'on'")
        await conn.execute("SELECT pg_reload_conf()")
    finally:
        await conn.close()
    for _ in range(100):  # the postmaster applies the reload on its own time; a new session shows when it has
        fresh = await asyncpg.connect(admin_dsn)
        try:
            settings = {name: await fresh.fetchval(f"SHOW {name}") for name in ("synchronous_commit", "fsync")}
        finally:
            await fresh.close()
        if settings["synchronous_commit"] == "on":
            return settings
        await asyncio.sleep(0.05)
    raise RuntimeError(f"Postgres did not take synchronous_commit = on: {settings}")
