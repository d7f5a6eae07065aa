"""Budget hold + settle latency and throughput, one hot agent against many, on a throwaway embedded Postgres.

Run from the repository root: ``python bench/budget_bench.py [--seconds 5] [--callers 16]``. It starts its own
embedded Postgres in a temporary directory, migrates it, creates the tenants with the admin role, and drives
:class:`BudgetService` through the data plane's RLS-bound role exactly as the proxy does. Prints medians, p99s and
holds per second; it asserts nothing and no CI job gates on it (STYLE.md, Tests).

Scenarios:
0. The bare tenant transaction (BEGIN, set app.org_id, SELECT 1, COMMIT): the floor every hold pays.
1. One caller, one agent: the latency a single request adds (hold before the provider, settle after).
2. N callers on one agent of an org with an org budget: both budget rows are hot.
3. N callers over 50 agents of that org: the agent rows spread, the org row is still shared by every hold.
4. N callers over 50 agents in 50 orgs: no row shared between holds (the ceiling without contention).
Each caller loops hold -> settle; "holds/s" counts completed holds (each also settled).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from uuid import UUID, uuid4

import asyncpg

from ibex_dataplane.proxy.budget import BudgetPolicy, BudgetService, Enforcement
from ibex_dataplane.runtime.embedded import ADMIN_ROLE, APP_ROLE, EmbeddedPostgres
from ibex_dataplane.store.migrations import default_migrations_dir, migrate_postgres
from ibex_dataplane.store.postgres import Database, create_pool

POLICY = BudgetPolicy(
    org_limit_usd=Decimal("1000000"), agent_limit_usd=Decimal("1000000"), enforcement=Enforcement.HARD_CAP
)
HOLD = Decimal("0.0021")
ACTUAL = Decimal("0.00137")


@dataclass
class Tally:
    hold: list[float] = field(default_factory=list)
    settle: list[float] = field(default_factory=list)
    cycle: list[float] = field(default_factory=list)
    elapsed: float = 0.0


def percentile(samples: Sequence[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def ms(samples: Sequence[float]) -> str:
    return f"{statistics.median(samples) * 1000:6.2f} / {percentile(samples, 0.99) * 1000:6.2f}"


def report(label: str, t: Tally) -> None:
    print(
        f"{label:<44} hold {ms(t.hold)} ms   settle {ms(t.settle)} ms   hold+settle {ms(t.cycle)} ms"
        f"   {len(t.hold) / t.elapsed:7.0f} holds/s"
    )


async def drive(budgets: BudgetService, targets: Sequence[tuple[UUID, UUID]], callers: int, seconds: float) -> Tally:
    tally = Tally()
    deadline = time.perf_counter() + seconds

    async def caller(index: int) -> None:
        turn = index
        while time.perf_counter() < deadline:
            org_id, agent_id = targets[turn % len(targets)]
            turn += callers
            started = time.perf_counter()
            hold = await budgets.hold(org_id, agent_id, f"req_{uuid4().hex}", HOLD, POLICY)
            held = time.perf_counter()
            await budgets.settle(hold, ACTUAL, model="echo", prompt_tokens=800, completion_tokens=300)
            done = time.perf_counter()
            tally.hold.append(held - started)
            tally.settle.append(done - held)
            tally.cycle.append(done - started)

    started = time.perf_counter()
    await asyncio.gather(*(caller(i) for i in range(callers)))
    tally.elapsed = time.perf_counter() - started
    return tally


async def bare_transactions(db: Database, org_id: UUID, agent_id: UUID, seconds: float) -> list[float]:
    samples: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        started = time.perf_counter()
        async with db.tenant(org_id, agent_id) as conn:
            await conn.fetchval("SELECT 1")
        samples.append(time.perf_counter() - started)
    return samples


async def create_tenants(admin_dsn: str, orgs: int, agents_per_org: int) -> list[list[tuple[UUID, UUID]]]:
    """Organizations and agents written straight with the admin role (the operator's job, not measured here)."""
    conn = await asyncpg.connect(admin_dsn)
    created: list[list[tuple[UUID, UUID]]] = []
    try:
        for _ in range(orgs):
            org_id = uuid4()
            await conn.execute(
                "INSERT INTO organizations (id, namespace, name) VALUES ($1, 'bench', $2)", org_id, f"org-{org_id}"
            )
            agents = [(org_id, uuid4()) for _ in range(agents_per_org)]
            await conn.executemany(
                "INSERT INTO agents (id, org_id, namespace, name) VALUES ($1, $2, 'bench', $3)",
                [(agent_id, org_id, f"agent-{agent_id}") for _, agent_id in agents],
            )
            created.append(agents)
    finally:
        await conn.close()
    return created


async def bench(pg: EmbeddedPostgres, seconds: float, callers: int, pool_size: int) -> None:
    await migrate_postgres(pg.dsn(ADMIN_ROLE), default_migrations_dir() / "postgres")
    [hot] = await create_tenants(pg.dsn(ADMIN_ROLE), 1, 1)
    [wide] = await create_tenants(pg.dsn(ADMIN_ROLE), 1, 50)
    spread = [agents[0] for agents in await create_tenants(pg.dsn(ADMIN_ROLE), 50, 1)]
    pool = await create_pool(pg.dsn(APP_ROLE), min_size=pool_size, max_size=pool_size, application_name="bench")
    try:
        db = Database(pool)
        budgets = BudgetService(db)
        await drive(budgets, hot, 1, min(1.0, seconds))  # warm-up: prepared statements, plans, pages
        base = await bare_transactions(db, *hot[0], seconds)
        print(
            f"{'0. bare tenant transaction (SELECT 1)':<44} "
            f"{statistics.median(base) * 1000:6.2f} / {percentile(base, 0.99) * 1000:6.2f} ms"
            f"   {len(base) / seconds:7.0f} tx/s"
        )
        report("1. one caller, one agent", await drive(budgets, hot, 1, seconds))
        report(f"2. {callers} callers, one hot agent", await drive(budgets, hot, callers, seconds))
        report(f"3. {callers} callers, 50 agents of one org", await drive(budgets, wide, callers, seconds))
        report(f"4. {callers} callers, 50 agents in 50 orgs", await drive(budgets, spread, callers, seconds))
        await budgets.drain()
    finally:
        await pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="duration of each scenario")
    parser.add_argument("--callers", type=int, default=16, help="concurrent callers in scenarios 2-4")
    parser.add_argument("--pool", type=int, default=10, help="connections in the data-plane pool")
    parser.add_argument("--no-uvloop", action="store_true", help="use the default asyncio event loop")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="ibex-budget-bench-"))
    pg = EmbeddedPostgres(root / "postgres")
    pg.start()
    try:
        loop = "asyncio"
        if not args.no_uvloop:
            try:
                import uvloop
            except ImportError:
                pass
            else:
                loop = "uvloop"
        print(f"machine: {os.cpu_count()} cores; load average before: {os.getloadavg()[0]:.2f}")
        print(
            f"embedded Postgres (synchronous_commit=off), pool {args.pool}, {loop}, {args.seconds:g} s per scenario;"
            f" hold {HOLD} USD, settle {ACTUAL} USD; latencies are median / p99"
        )
        run = bench(pg, args.seconds, args.callers, args.pool)
        if loop == "uvloop":
            uvloop.run(run)
        else:
            asyncio.run(run)
    finally:
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
