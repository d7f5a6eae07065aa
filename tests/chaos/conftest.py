"""The fault suite's shared stack (one per module) and its table (printed at the end, written to a file)."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import pytest
import pytest_asyncio

from ibex_dataplane.runtime.embedded import EmbeddedRuntime
from ibex_dataplane.runtime.stores import migrations_dir
from ibex_dataplane.settings import Settings
from ibex_dataplane.store.clickhouse import ClickHouse
from ibex_dataplane.store.migrations import migrate_clickhouse, migrate_postgres
from ibex_dataplane.store.postgres import create_pool
from ibex_dataplane.store.redis import create_redis
from ibex_operator.reconcile import Reconciler
from ibex_operator.repository import TenantConfigRepository
from ibex_operator.secrets import FileSecretSink
from tests.chaos.load import Org, token
from tests.chaos.report import FaultRow, render_report, render_table, report_path
from tests.chaos.stack import Stack, StageProcess, analytics_dirs, build_stack, start_all, upstream_process
from tests.support.tenants import TenantFactory


@dataclass
class ChaosLog:
    """The rows of this run, the suite's method text and when it began (kept on the pytest config)."""

    rows: list[FaultRow] = field(default_factory=list)
    method: str = ""
    started: float = field(default_factory=time.monotonic)
    load_before: str = ""


CHAOS_LOG = pytest.StashKey[ChaosLog]()
# Limits far above the load, so that every request runs the rate limiter in Valkey (as real agents' requests do)
# without ever being limited.
LIMITS = {"requestsPerMinute": 1_000_000, "tokensPerMinute": 1_000_000_000}
STARTUP_DEADLINE = 90.0  # seconds for every stage of the stack to print its ready line


def chaos_log(config: pytest.Config) -> ChaosLog:
    if CHAOS_LOG not in config.stash:
        with open("/proc/loadavg") as f:
            config.stash[CHAOS_LOG] = ChaosLog(load_before=" ".join(f.read().split()[:3]))
    return config.stash[CHAOS_LOG]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config) -> None:
    log = config.stash.get(CHAOS_LOG, None)
    if log is None or not log.rows:
        return
    path = report_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_report(log.rows, log.started, log.load_before, log.method))
    terminalreporter.section("fault suite")
    terminalreporter.write_line(render_table(log.rows))
    terminalreporter.write_line(f"(written to {path})")


@dataclass
class World:
    stack: Stack
    tenants: TenantFactory
    admin_dsn: str
    pool: asyncpg.Pool
    markers: list[str] = field(default_factory=list)  # every organization's marker so far: none may leak

    async def orgs(self, n: int = 2, *, cap_usd: str = "0.004") -> list[Org]:
        """Fresh organizations for one fault: agents ``mem`` (memory on), ``cap`` (memory off, a small HardCap
        budget the load runs into) and ``fast`` (memory off, for the upstream model), all rate limited."""
        await self.pool.expire_connections()  # Postgres may have restarted since the last fault
        out = []
        for _ in range(n):
            t = await self.tenants.create(
                agents=("mem", "cap", "fast"),
                agent_specs={"mem": {"limits": LIMITS},
                             "cap": {"limits": LIMITS, "memory": {"enabled": False},
                                     "budget": {"monthlyLimitUSD": cap_usd}},
                             "fast": {"limits": LIMITS, "memory": {"enabled": False}}},
                org_spec={"models": {"default": "echo"}, "limits": LIMITS},
            )  # fmt: skip
            marker = "mk" + token(10)
            self.markers.append(marker)
            out.append(Org(t.name, t.org_id, marker, dict(t.agents), dict(t.keys)))
        return out


@pytest_asyncio.fixture(scope="module")
async def world(request: pytest.FixtureRequest, settings: Settings) -> AsyncIterator[World]:
    log = chaos_log(request.config)
    log.method = (request.module.__doc__ or "").strip()
    # Under /tmp itself (not pytest's 0700 temp root): as root, Postgres runs as an unprivileged user.
    root = Path(tempfile.mkdtemp(prefix="ibex-chaos-"))
    runtime = EmbeddedRuntime(root / "stores")
    await asyncio.to_thread(runtime.start)
    stack: Stack | None = None
    upstream: StageProcess | None = None
    try:
        info = runtime.info
        folder = migrations_dir(settings)
        await migrate_postgres(info.postgres_admin_dsn, folder / "postgres")
        for url in analytics_dirs(root):  # one analytics engine per replica, migrated before it starts
            clickhouse = ClickHouse(url)
            try:
                await migrate_clickhouse(clickhouse, folder / "clickhouse")
            finally:
                await clickhouse.close()
        upstream = upstream_process(root)
        upstream_url = (await asyncio.to_thread(upstream.start)).group(1).removesuffix("/v1")
        stack = build_stack(root, runtime, secrets.token_hex(32), secrets.token_hex(32), upstream, upstream_url)
        await start_all(stack, timeout=STARTUP_DEADLINE)
        await stack.script(chunk_interval=0.1)  # streams last about 0.6 s: a kill finds some in flight
        pool = await create_pool(info.postgres_admin_dsn, min_size=1, max_size=2, application_name="chaos")
        redis = create_redis(info.redis_url)
        try:
            sink = FileSecretSink(root / "secrets.json")
            reconciler = Reconciler(TenantConfigRepository(pool, redis), sink, stack.pepper.encode())
            yield World(stack, TenantFactory(reconciler, sink), info.postgres_admin_dsn, pool)
        finally:
            await redis.aclose()
            await pool.close()
    finally:
        if stack is not None:
            await asyncio.to_thread(stack.stop)  # the upstream with the stages
        elif upstream is not None:
            await asyncio.to_thread(upstream.stop)
        await asyncio.to_thread(runtime.stop)
        if os.environ.get("CHAOS_KEEP"):  # keep the stage logs for a post-mortem
            print(f"fault suite files kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
