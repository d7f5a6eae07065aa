"""A pool never makes anyone wait forever. Closing it: a connection that a stuck task still holds is terminated after
the close's timeout, so a process (or a test's teardown) shuts down instead of hanging on it. Acquiring from it:
a caller that names no timeout still gets one, so a pool drained by connections that never come back fails its
callers instead of hanging them."""

from __future__ import annotations

import asyncio
import logging

import pytest

from ibex_dataplane.runtime.embedded import RuntimeInfo
from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.store import postgres
from ibex_dataplane.store.postgres import close_pool, create_pool


async def test_a_connection_never_released_is_terminated_when_the_pool_closes(
    runtime_info: RuntimeInfo, stores: Stores
) -> None:
    pool = await create_pool(runtime_info.postgres_app_dsn, min_size=1, max_size=2)
    held = await pool.acquire()  # and never released, as by a task stuck on something else
    pid = await held.fetchval("SELECT pg_backend_pid()")
    await asyncio.wait_for(close_pool(pool, timeout=0.5), 30)  # without the bound, pool.close() waits for `held`
    assert await _ends(stores, pid)  # its server session is gone: the connection was terminated, not leaked


async def test_a_pool_with_everything_released_closes_cleanly(
    runtime_info: RuntimeInfo, caplog: pytest.LogCaptureFixture
) -> None:
    pool = await create_pool(runtime_info.postgres_app_dsn, min_size=1, max_size=2)
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT 1") == 1
    with caplog.at_level(logging.WARNING, logger="ibex_dataplane.store.postgres"):
        await close_pool(pool, timeout=30)
    assert pool.is_closing()
    assert not [r for r in caplog.records if "terminating" in r.getMessage()]  # closed, not cut short


async def test_acquiring_from_a_drained_pool_without_a_timeout_times_out(
    runtime_info: RuntimeInfo, stores: Stores, monkeypatch: pytest.MonkeyPatch
) -> None:  # `stores`: the schema (pgvector's type, which every pooled connection registers) is migrated
    monkeypatch.setattr(postgres, "ACQUIRE_TIMEOUT", 0.3)
    pool = await create_pool(runtime_info.postgres_app_dsn, min_size=1, max_size=1)
    try:
        held = await pool.acquire()  # the only connection, never given back
        async with asyncio.timeout(30) as guard:  # the test's own bound, in case the pool's were missing
            with pytest.raises(TimeoutError):
                await pool.acquire()
            with pytest.raises(TimeoutError):
                async with pool.acquire():  # the context-manager form is bounded the same way
                    pass
        assert not guard.expired()  # the pool's bound fired, not the test's
        await pool.release(held)
        async with pool.acquire() as conn:  # and the pool still serves once a connection comes back
            assert await conn.fetchval("SELECT 1") == 1
    finally:
        await close_pool(pool, timeout=5)


async def _ends(stores: Stores, pid: int) -> bool:
    """The terminated backend leaves pg_stat_activity shortly after its socket closed (the server's own pace)."""
    assert stores.admin_pool is not None
    deadline = asyncio.get_running_loop().time() + 10
    while asyncio.get_running_loop().time() < deadline:
        async with stores.admin_pool.acquire() as admin:
            if await admin.fetchval("SELECT NOT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)", pid):
                return True
        await asyncio.sleep(0.05)
    return False
