"""The proxy's settle statement (``ibex_answer_settle_batch_as``) as earlier migrations defined it against the
current one, side by side on one throwaway embedded Postgres.

Run from the repository root: ``python -m bench.settle_batch_bench [--sizes 1,8,32,100] [--repeats 60]
[--against 0035,0036]``. It migrates a fresh embedded Postgres to the newest migration, installs each earlier
migration's text of the function under another name (``ibex_answer_settle_batch_v0035_as``, ...), places one
budget lease for one agent, and then calls every version with batches of N answers drawn from that lease, each
answer in a new session (what the proxy sends under load when clients send no session id), rotating which goes
first. Every call's rows are checked (each answer settled from a held lease, turn 1, no checkpoint error), and at
the end the books must balance: the ledger holds every answer once and the budget rows moved by exactly the sums.
Prints the median and p90 time per statement, the median per answer and each version's ratio to the first one
named; it asserts nothing about speed and no CI job gates on it. Postgres runs with production durability
(``synchronous_commit = on``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from decimal import Decimal

import asyncpg
import orjson

from bench.budget_bench import create_tenants
from bench.durability import production_durability
from bench.pg import throwaway_postgres
from ibex_dataplane.runtime.embedded import ADMIN_ROLE, APP_ROLE, EmbeddedPostgres
from ibex_dataplane.store.migrations import default_migrations_dir, migrate_postgres

NEW = "ibex_answer_settle_batch_as"
ACTUAL, DRAWN = Decimal("0.00137"), Decimal("0.0021")


def renamed(version: str) -> str:
    return f"ibex_answer_settle_batch_v{version}_as"


def function_of(version: str) -> str:
    """The CREATE of the batch function in the migration numbered ``version``, renamed."""
    [path] = (default_migrations_dir() / "postgres").glob(f"{version}_*.sql")
    text = path.read_text()
    start = text.index(f"CREATE OR REPLACE FUNCTION {NEW}")
    body = text.index("AS $$", start) + len("AS $$")
    end = text.index("$$;", body) + len("$$;")
    return text[start:end].replace(NEW, renamed(version))


def batch(lease: uuid.UUID, n: int) -> str:
    return orjson.dumps([
        {"hold": str(lease), "actual": f"{ACTUAL:f}", "model": "echo", "prompt_tokens": 10, "completion_tokens": 5,
         "session": f"sess_{uuid.uuid4().hex}", "request_id": f"req_{uuid.uuid4().hex}", "messages": ["ab" * 32],
         "completion": "cd" * 32, "latency_ms": 1.5, "mode": None, "capture_model": None, "capture": None,
         "observed_at": None, "drawn": f"{DRAWN:f}"}
        for _ in range(n)
    ]).decode()  # fmt: skip


async def run(pg: EmbeddedPostgres, sizes: list[int], repeats: int, against: list[str]) -> None:
    await migrate_postgres(pg.dsn(ADMIN_ROLE), default_migrations_dir() / "postgres")
    durability = await production_durability(pg.dsn(ADMIN_ROLE))
    admin = await asyncpg.connect(pg.dsn(ADMIN_ROLE))
    versions = {renamed(v): v for v in against}
    for name, version in versions.items():
        await admin.execute(function_of(version))
        await admin.execute(f"GRANT EXECUTE ON FUNCTION {name}(uuid, uuid, jsonb, interval) TO {APP_ROLE}")
    versions[NEW] = "current"
    names = list(versions)
    [[(org, agent)]] = await create_tenants(pg.dsn(ADMIN_ROLE), 1, 1)
    app = await asyncpg.connect(pg.dsn(APP_ROLE))
    lease = uuid.uuid4()
    placed = await app.fetchval(
        "SELECT ibex_budget_lease_as($1, $2, $3, date_trunc('month', now())::date, 100000, 0, 1000000, 1000000,"
        " 'HardCap', '1 day')",
        org, agent, lease,
    )  # fmt: skip
    assert placed == "held", placed
    print(f"Postgres synchronous_commit = {durability['synchronous_commit']}, fsync = {durability['fsync']};"
          f" {repeats} statements per size and version, rotating which goes first; ms per statement (median /"
          f" p90), us per answer (median), ratio to {versions[names[0]]}")  # fmt: skip
    print(f"{'answers':>8} " + " ".join(f"{versions[name]:>30}" for name in names))
    answers = 0
    for n in sizes:
        times: dict[str, list[float]] = {name: [] for name in names}
        for r in range(repeats):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                payload = batch(lease, n)
                started = time.perf_counter()
                rows = await app.fetch(
                    f"SELECT hold_status, turn, checkpoint_error FROM {name}($1, $2, $3::jsonb, '1 hour')",
                    org, agent, payload,
                )  # fmt: skip
                times[name].append(time.perf_counter() - started)
                assert len(rows) == n, (name, len(rows))
                assert all(tuple(x) == ("held", 1, None) for x in rows), (name, [tuple(x) for x in rows[:3]])
                answers += n

        def q(v: list[float], p: float) -> float:
            return sorted(v)[min(len(v) - 1, int(p * len(v)))] * 1000

        first = statistics.median(times[names[0]])
        cells = []
        for name in names:
            median = statistics.median(times[name])
            cells.append(
                f"{median * 1000:6.2f} / {q(times[name], 0.9):6.2f} {median * 1e6 / n:5.0f} {median / first:5.2f}"
            )
        print(f"{n:>8} " + " ".join(f"{c:>30}" for c in cells))
    rows = await admin.fetch(
        "SELECT scope_kind, spent_usd, held_usd FROM budget_periods WHERE org_id = $1 ORDER BY scope_kind", org
    )
    ledger = await admin.fetchval("SELECT count(*) FROM budget_ledger WHERE org_id = $1", org)
    lease_left = await admin.fetchval("SELECT amount_usd FROM budget_holds WHERE id = $1", lease)
    assert ledger == answers, (ledger, answers)
    for row in rows:
        assert row["spent_usd"] == ACTUAL * answers, dict(row)
        assert row["held_usd"] == lease_left == Decimal(100000) - DRAWN * answers, (dict(row), lease_left)
    print(f"books balance: {answers} answers, {ledger} ledger rows, spent {rows[0]['spent_usd']}, held {lease_left}")
    await app.close()
    await admin.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,8,32,100", help="answers per statement")
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--against", default="0035,0036", help="earlier migrations whose function to compare")
    args = parser.parse_args()
    with throwaway_postgres("settle-batch-bench-") as pg:
        asyncio.run(run(pg, [int(s) for s in args.sizes.split(",")], args.repeats, args.against.split(",")))


if __name__ == "__main__":
    main()
