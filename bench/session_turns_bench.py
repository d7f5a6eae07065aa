"""What one more turn of a session writes, before migration 0044 and since, side by side on one throwaway Postgres.

Run from the repository root: ``python -m bench.session_turns_bench [--turns 2000] [--rounds 2]``. For each round
and each variant (the migrations up to 0043, then all of them; alternated, the order flipped every round) it
creates a database, migrates it, opens one agent with 300 sessions of one turn each, and then writes ``--turns``
turns of one more session one after another through ``ibex_session_turn_capture_as`` (the proxy's one-by-one
checkpoint; the batch settle's session upsert is the same update). Every call's turn number is checked. Prints,
per variant and round: the WAL written per turn (``pg_current_wal_insert_lsn`` before and after), how much the
sessions table's indexes grew, and the wall time per turn, one call at a time from this process. Postgres runs with
production durability (``synchronous_commit = on``); it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path

import asyncpg

from bench.durability import production_durability
from bench.pg import throwaway_postgres
from ibex_dataplane.runtime.embedded import ADMIN_ROLE
from ibex_dataplane.store.migrations import default_migrations_dir, migrate_postgres

TURN = "SELECT ibex_session_turn_capture_as($1, $2, $3, $4, $5, NULL, 1, 1, 1.0, NULL, NULL, NULL, NULL, $6)"
INDEX_BYTES = "SELECT sum(pg_relation_size(indexrelid)) FROM pg_index WHERE indrelid = 'sessions'::regclass"
VARIANTS = {"before 0044": 43, "since 0044": 10**6}


def migrations_up_to(last: int) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="ibex-turns-migrations-")) / "postgres"
    folder.mkdir()
    for f in sorted((default_migrations_dir() / "postgres").glob("*.sql")):
        if int(f.name[:4]) <= last:
            shutil.copy(f, folder / f.name)
    return folder


async def one_variant(admin_dsn: str, last: int, turns: int) -> dict[str, float]:
    name = f"turns_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(admin_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    dsn = admin_dsn.rsplit("/", 1)[0] + f"/{name}"
    folder = migrations_up_to(last)
    try:
        await migrate_postgres(dsn, folder)
    finally:
        shutil.rmtree(folder.parent, ignore_errors=True)
    conn = await asyncpg.connect(dsn)
    try:
        org, agent, ttl = uuid.uuid4(), uuid.uuid4(), timedelta(hours=1)
        await conn.execute("INSERT INTO organizations (id, namespace, name) VALUES ($1, 'ns', 'org')", org)
        await conn.execute("INSERT INTO agents (id, org_id, namespace, name) VALUES ($1, $2, 'ns', 'a')", agent, org)
        for i in range(300):  # the other sessions a live table holds
            if await conn.fetchval(TURN, org, agent, f"other-{i}", "r", ["a"], ttl) != 1:
                raise SystemExit("a new session's first turn is not turn 1")
        await conn.execute("CHECKPOINT")
        index_before = await conn.fetchval(INDEX_BYTES)
        lsn_before = await conn.fetchval("SELECT pg_current_wal_insert_lsn()")
        started = time.perf_counter()
        for i in range(turns):
            if await conn.fetchval(TURN, org, agent, "busy", f"r{i}", ["a"], ttl) != i + 1:
                raise SystemExit(f"turn {i + 1} came back with another number")
        elapsed = time.perf_counter() - started
        lsn_after = await conn.fetchval("SELECT pg_current_wal_insert_lsn()")
        wal = float(await conn.fetchval("SELECT pg_wal_lsn_diff($1, $2)", lsn_after, lsn_before))
        index_after = await conn.fetchval(INDEX_BYTES)
    finally:
        await conn.close()
    return {"wal_per_turn": wal / turns, "index_growth_kb": (index_after - index_before) / 1024,
            "us_per_turn": elapsed * 1e6 / turns}  # fmt: skip


async def main(turns: int, rounds: int, commit: str) -> None:
    with throwaway_postgres("ibex-turns-") as pg:
        admin_dsn = pg.dsn(ADMIN_ROLE)
        durability = await production_durability(admin_dsn)
        conn = await asyncpg.connect(admin_dsn)
        version = await conn.fetchval("SHOW server_version")
        await conn.close()
        print(f"commit {commit}; Postgres {version}; {durability}; {turns} turns of one session per run")
        results: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
        for r in range(rounds):
            order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
            for variant in order:
                figures = await one_variant(admin_dsn, VARIANTS[variant], turns)
                results[variant].append(figures)
                wal, grown, took = figures["wal_per_turn"], figures["index_growth_kb"], figures["us_per_turn"]
                print(f"round {r + 1}  {variant:<12} WAL {wal:6.0f} B per turn   sessions indexes +{grown:5.0f} kB"
                      f"   {took:6.0f} us per turn")  # fmt: skip
        print("medians over the rounds:")
        for variant, runs in results.items():
            print(f"  {variant:<12} WAL {statistics.median(f['wal_per_turn'] for f in runs):6.0f} B per turn"
                  f"   {statistics.median(f['us_per_turn'] for f in runs):6.0f} us per turn")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, check=False)
    asyncio.run(main(args.turns, args.rounds, head.stdout.strip()))
