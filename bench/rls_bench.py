"""Row-level security's cost per row: the policies of migration 0041 against the form they replaced, side by side.

Run from the repository root: ``python bench/rls_bench.py [--rounds 5] [--repeats 30]``. It starts its own embedded
Postgres in a temporary directory, migrates it, writes one organization with two agents, and gives the first agent
``--memories`` rows (the second the same number, so the agent policy has rows to refuse). Then, in alternated
rounds, it sets every policy of the schema to one form with the admin role and times, as the data plane's role in
an agent-scoped tenant transaction, the statement that scans the most rows on a search: the text leg's population
count (``memory/repository.py``, capped at 20,000 rows, counted at most once a minute per agent and inline in the
search that finds no count). Forms:

- ``0041``: ``org_id = (SELECT ibex_current_org())`` and the agent check likewise: the settings are read once per
  statement;
- ``0001``: ``org_id = ibex_current_org()``, as every tenant table had it before 0041: Postgres inlines the function
  into ``nullif(current_setting(...), '')::uuid`` and, where the statement's own predicates do not fold it into a
  one-time filter, computes it for every row.

Prints the median of ``--repeats`` statements per form and round, the ratio per round, and the spread; it asserts
nothing and no CI job gates on it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from uuid import UUID

import asyncpg

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.budget_bench import create_tenants  # noqa: E402
from bench.durability import production_durability  # noqa: E402
from bench.pg import throwaway_postgres  # noqa: E402
from ibex_dataplane.memory.repository import _POPULATION  # noqa: E402  (the product's statement, exactly)
from ibex_dataplane.memory.tuning import SearchTuning  # noqa: E402
from ibex_dataplane.runtime.embedded import ADMIN_ROLE, APP_ROLE, EmbeddedPostgres  # noqa: E402
from ibex_dataplane.store.migrations import default_migrations_dir, migrate_postgres  # noqa: E402
from ibex_dataplane.store.postgres import Database, create_pool  # noqa: E402

CAP = SearchTuning().text_population  # the cap of the count (20,000)

# Every policy of the schema in one form: tenant_isolation on org_id (id for organizations), agent_isolation.
SET_FORM = """
DO $$
DECLARE p record; org text; agent text; expr text;
BEGIN
    org := CASE '{form}' WHEN '0041' THEN '(SELECT ibex_current_org())' ELSE 'ibex_current_org()' END;
    agent := CASE '{form}' WHEN '0041' THEN '(SELECT ibex_current_agent())' ELSE 'ibex_current_agent()' END;
    FOR p IN SELECT tablename, policyname FROM pg_policies WHERE schemaname = 'public' LOOP
        expr := CASE p.policyname
            WHEN 'agent_isolation' THEN format('%s IS NULL OR agent_id = %s', agent, agent)
            ELSE format('%I = %s', CASE p.tablename WHEN 'organizations' THEN 'id' ELSE 'org_id' END, org)
        END;
        EXECUTE format('ALTER POLICY %I ON public.%I USING (%s) WITH CHECK (%s)', p.policyname, p.tablename,
                       expr, expr);
    END LOOP;
END
$$
"""


async def fill(admin: asyncpg.Connection, org: UUID, agents: list[UUID], n: int) -> None:
    """``n`` active memories for each agent (content only: the count reads no embedding)."""
    for agent in agents:
        await admin.execute(
            "INSERT INTO memories (id, org_id, agent_id, content, content_hash, status, source)"
            " SELECT gen_random_uuid(), $1, $2::uuid, 'memory ' || i || ' of ' || $2::uuid,"
            " sha256(convert_to(i || ' ' || $2::uuid, 'UTF8')), 'active', 'imported' FROM generate_series(1, $3) i",
            org, agent, n,
        )  # fmt: skip
    await admin.execute("VACUUM (ANALYZE) memories")  # as autovacuum leaves a table this size: index-only scans


async def timed(db: Database, org: UUID, agent: UUID, repeats: int) -> tuple[float, int]:
    """Median ms of the population count, each in its own agent-scoped read-only transaction, and its value."""
    times = []
    count = 0
    for _ in range(repeats):
        async with db.tenant(org, agent, readonly=True) as conn:
            started = time.perf_counter()
            count = await conn.fetchval(_POPULATION, org, agent, CAP)
            times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times), count


async def bench(pg: EmbeddedPostgres, sizes: list[int], rounds: int, repeats: int) -> None:
    await migrate_postgres(pg.dsn(ADMIN_ROLE), default_migrations_dir() / "postgres")
    durability = await production_durability(pg.dsn(ADMIN_ROLE))
    print(f"Postgres synchronous_commit = {durability['synchronous_commit']}, fsync = {durability['fsync']}")
    pool = await create_pool(pg.dsn(APP_ROLE), min_size=2, max_size=2, application_name="bench")
    admin = await asyncpg.connect(pg.dsn(ADMIN_ROLE))
    try:
        db = Database(pool)
        print(f"{'memories':>9} {'round':>5} {'0001 ms':>9} {'0041 ms':>9} {'0001 / 0041':>12}")
        for size in sizes:
            [[(org, first), (_, second)]] = await create_tenants(pg.dsn(ADMIN_ROLE), 1, 2)
            await fill(admin, org, [first, second], size)
            ratios = []
            for r in range(rounds):
                medians = {}
                for form in ("0001", "0041") if r % 2 == 0 else ("0041", "0001"):
                    await admin.execute(SET_FORM.format(form=form))
                    await timed(db, org, first, 3)  # the plans made again under the new policies
                    medians[form], count = await timed(db, org, first, repeats)
                    assert count == min(size, CAP), (form, count, size)  # the same rows under both forms
                ratios.append(medians["0001"] / medians["0041"])
                print(f"{size:9d} {r + 1:5d} {medians['0001']:9.2f} {medians['0041']:9.2f} {ratios[-1]:12.2f}")
            print(f"{size:9d}   all ratio median {statistics.median(ratios):.2f} (min {min(ratios):.2f}, "
                  f"max {max(ratios):.2f})")  # fmt: skip
        await admin.execute(SET_FORM.format(form="0041"))
    finally:
        await admin.close()
        await pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--memories", default="1000,10000,20000", help="comma-separated memories per agent")
    parser.add_argument("--rounds", type=int, default=5, help="alternated rounds per size")
    parser.add_argument("--repeats", type=int, default=30, help="statements timed per form and round")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"commit {commit}; asyncpg {asyncpg.__version__}; {os.cpu_count()} cores; "
          f"load average before {os.getloadavg()[0]:.2f}")  # fmt: skip
    with throwaway_postgres("ibex-rls-bench-") as pg:
        import uvloop

        uvloop.run(bench(pg, [int(n) for n in args.memories.split(",")], args.rounds, args.repeats))
        print(f"load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
