"""Budget hold + settle latency and throughput, one hot agent against many, on a throwaway embedded Postgres.

Run from the repository root: ``python bench/budget_bench.py [--seconds 5] [--callers 4,16,32]``. It starts its own
embedded Postgres in a temporary directory, migrates it, creates the tenants with the admin role, and drives
:class:`BudgetService` through the data plane's RLS-bound role exactly as the proxy does. Prints medians, p99s and
holds per second; it asserts nothing and no CI job gates on it (STYLE.md, Tests).

Scenarios:
0. The bare tenant transaction (BEGIN, set app.org_id, SELECT 1, COMMIT; plus asyncpg's reset query on release
   unless the pool drops it): the floor every hold pays.
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
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from functools import partial
from uuid import UUID, uuid4

import asyncpg

from bench.pg import throwaway_postgres
from ibex_dataplane.runtime.embedded import ADMIN_ROLE, APP_ROLE, EmbeddedPostgres
from ibex_dataplane.shared.budget import BudgetPolicy, BudgetService, Enforcement
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

    def merge(self, other: Tally) -> None:
        self.hold += other.hold
        self.settle += other.settle
        self.cycle += other.cycle
        self.elapsed += other.elapsed


def percentile(samples: Sequence[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def ms_of(samples: Sequence[float]) -> float:
    return statistics.median(samples) * 1000


def ms(samples: Sequence[float]) -> str:
    return f"{statistics.median(samples) * 1000:6.2f} / {percentile(samples, 0.99) * 1000:6.2f}"


def throughput(t: Tally) -> float:
    return len(t.hold) / t.elapsed


def report(label: str, t: Tally) -> None:
    print(
        f"{label:<44} hold {ms(t.hold)} ms   settle {ms(t.settle)} ms   hold+settle {ms(t.cycle)} ms"
        f"   {throughput(t):7.0f} holds/s"
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


async def bare(db: Database, org_id: UUID, agent_id: UUID, seconds: float) -> Tally:
    """Sequential empty tenant transactions; their latencies land in ``Tally.hold``."""
    tally = Tally()
    started = time.perf_counter()
    deadline = started + seconds
    while time.perf_counter() < deadline:
        begun = time.perf_counter()
        async with db.tenant(org_id, agent_id) as conn:
            await conn.fetchval("SELECT 1")
        tally.hold.append(time.perf_counter() - begun)
    tally.elapsed = time.perf_counter() - started
    return tally


async def interleaved(runs: Sequence[Callable[[float], Awaitable[Tally]]], seconds: float, rounds: int) -> list[Tally]:
    """Run each measurement for ``seconds / rounds`` in turn, ``rounds`` times, and merge the slices.

    On a shared machine, background load then falls on every scenario of a comparison alike.
    """
    merged = [Tally() for _ in runs]
    for _ in range(rounds):
        for total, run in zip(merged, runs, strict=True):
            total.merge(await run(seconds / rounds))
    return merged


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


def latency_line(label: str, t: Tally) -> str:
    return f"{label:<44} {ms(t.hold)} ms   {len(t.hold) / t.elapsed:7.0f} tx/s"


async def bench(pg: EmbeddedPostgres, seconds: float, callers: Sequence[int], pool_size: int, rounds: int) -> None:
    await migrate_postgres(pg.dsn(ADMIN_ROLE), default_migrations_dir() / "postgres")
    [hot] = await create_tenants(pg.dsn(ADMIN_ROLE), 1, 1)
    [wide] = await create_tenants(pg.dsn(ADMIN_ROLE), 1, 50)
    spread = [agents[0] for agents in await create_tenants(pg.dsn(ADMIN_ROLE), 50, 1)]
    pool = await create_pool(pg.dsn(APP_ROLE), min_size=pool_size, max_size=pool_size, application_name="bench")
    try:
        async with pool.acquire() as conn:
            # asyncpg sends this on every release unless the pool overrides it: one more round trip per transaction.
            reset = "yes" if conn.get_reset_query() else "no"
        print(f"pool from store.postgres.create_pool: {pool_size} connections, reset query on release: {reset}")
        db = Database(pool)
        budgets = BudgetService(db)
        await drive(budgets, hot, 1, min(1.0, seconds))  # warm-up: prepared statements, plans, pages

        base, one = await interleaved([partial(bare, db, *hot[0]), partial(drive, budgets, hot, 1)], seconds, rounds)
        print(latency_line("0. bare tenant transaction (SELECT 1)", base))
        report("1. one caller, one agent", one)
        added = ms_of(one.hold) - ms_of(base.hold)
        print(f"   the hold statement adds {added:.2f} ms to the bare tenant transaction (medians)")

        for n in callers:
            hot_agent, one_org, many_orgs = await interleaved(
                [partial(drive, budgets, targets, n) for targets in (hot, wide, spread)], seconds, rounds
            )
            report(f"2. {n} callers, one hot agent", hot_agent)
            report(f"3. {n} callers, 50 agents of one org", one_org)
            report(f"4. {n} callers, 50 agents in 50 orgs", many_orgs)
            print(
                f"   holds/s relative to 50 orgs: one hot agent {throughput(hot_agent) / throughput(many_orgs):.2f},"
                f" 50 agents of one org {throughput(one_org) / throughput(many_orgs):.2f}"
            )
        await budgets.drain()
    finally:
        await pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="duration of each scenario")
    parser.add_argument(
        "--callers", default="4,16,32", help="comma-separated numbers of concurrent callers for scenarios 2-4"
    )
    parser.add_argument("--pool", type=int, default=10, help="connections in the data-plane pool")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved slices per scenario (fairer on busy hosts)")
    parser.add_argument("--no-uvloop", action="store_true", help="use the default asyncio event loop")
    args = parser.parse_args()

    with throwaway_postgres("ibex-budget-bench-") as pg:
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
            f"embedded Postgres (synchronous_commit=off), {loop}, {args.seconds:g} s per scenario;"
            f" {args.rounds} interleaved rounds; hold {HOLD} USD, settle {ACTUAL} USD; latencies are median / p99"
        )
        run = bench(pg, args.seconds, [int(n) for n in args.callers.split(",")], args.pool, args.rounds)
        if loop == "uvloop":
            uvloop.run(run)
        else:
            asyncio.run(run)
        print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
