"""What one memory insert costs Postgres, by part: the row and its indexes, each trigger, the foreign keys.

Starts the embedded stack (production durability), writes ``--memories`` generated sentences through the proxy's
``POST /v1/memories:batch`` (the whole refinery, so rows, postings and indexes are real), then runs
``EXPLAIN (ANALYZE)`` of a copy of one stored row's insert ``--repeats`` times, each in a rolled-back
transaction, first as migrated and then with the two postings tables' foreign keys to ``memories`` dropped (a
what-if; the stack is thrown away afterwards). Prints each run's execution time and trigger times; asserts nothing.

Run: ``python bench/insert_cost_bench.py [--memories 3000] [--repeats 4]``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import uuid
from pathlib import Path

from aiohttp import ClientSession

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.memory_bench import sentence  # noqa: E402
from bench.stack import embedded_stack  # noqa: E402
from tests.support.proxy import running_proxy  # noqa: E402

COLUMNS = ["id", "org_id", "agent_id", "content", "content_hash", "status", "source", "session_id", "request_id",
           "observed_at", "valid_from", "valid_until", "confidence", "metadata", "embedding", "sparse_tokens",
           "sparse_weights"]  # fmt: skip
KEYS = {"memory_sparse_terms": "memory_sparse_terms_memory_id_fkey", "memory_terms": "memory_terms_memory_id_fkey"}


async def run(args: argparse.Namespace) -> None:
    rng = random.Random(3)
    async with embedded_stack("ibex-insert-cost-") as stack:
        print(f"Postgres durability: {stack.durability}")
        tenant = await stack.tenants.create(agents=("alpha",))
        headers = {"Authorization": f"Bearer {tenant.keys['alpha']}", "X-IBEX-Agent-ID": str(tenant.agents["alpha"])}
        async with (
            running_proxy(stack.settings, stack.stores, stack.pepper, memory=stack.memory_deps) as proxy,
            ClientSession() as http,
        ):
            for first in range(0, args.memories, 100):
                body = {"items": [{"content": sentence(rng, i)} for i in range(first, min(first + 100, args.memories))]}
                async with http.post(proxy.v1 + "/memories:batch", json=body, headers=headers) as r:
                    assert r.status == 200, r.status
        pool = stack.stores.admin_pool
        assert pool is not None
        async with pool.acquire() as conn:
            row = await conn.fetchrow("SELECT * FROM memories WHERE org_id = $1 LIMIT 1", tenant.org_id)
            terms = await conn.fetchval(
                "SELECT avg(cardinality(sparse_tokens)) FROM memories WHERE org_id = $1", tenant.org_id
            )
            print(f"{args.memories} memories; SPLADE postings per memory: {float(terms):.1f}")
            placeholders = ", ".join(f"${i + 1}" for i in range(len(COLUMNS)))
            sql = f"EXPLAIN (ANALYZE) INSERT INTO memories ({', '.join(COLUMNS)}) VALUES ({placeholders})"
            for label in ("as migrated", "without the postings tables' foreign keys"):
                if label != "as migrated":
                    for table, key in KEYS.items():
                        await conn.execute(f"ALTER TABLE {table} DROP CONSTRAINT {key}")
                print(label)
                for k in range(args.repeats):
                    values = [row[c] for c in COLUMNS]
                    values[0] = uuid.uuid4()
                    values[3] = f"{row['content']} (copy {label[:3]} {k})"
                    values[4] = uuid.uuid4().bytes + bytes(16)  # a hash no active row has
                    transaction = conn.transaction()
                    await transaction.start()
                    try:
                        plan = [r[0].strip() for r in await conn.fetch(sql, *values)]
                    finally:
                        await transaction.rollback()
                    print("  " + " | ".join(line for line in plan if line.startswith(("Trigger", "Execution"))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memories", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=4)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
