"""What one analytics flush costs the proxy's event loop: rows shipped as Python values against rows encoded as a
JSON block (the shipped path), side by side on one embedded ClickHouse engine.

Run from the repository root: ``python -m bench.analytics_flush_bench [--rows 1000] [--repeats 7]``. It starts a
chdb engine in its own process, as ``ibex dev`` and ``ibex proxy`` do, migrates it, and then flushes batches of
``--rows`` trace rows (plus their usage rows) through an ``AnalyticsRecorder`` in alternation:

- ``values``: the previous insert path, kept here to compare against: the rows as lists of Python values, pickled
  to the engine process by the executor's feeder thread, encoded there by clickhouse-connect;
- ``json``: ``ClickHouse.insert`` as shipped: the rows encoded by orjson on the event loop, in slices that yield to
  it, and shipped as one bytes block.

While each flush runs, a task on the same event loop yields in a loop and records the gaps between its turns: the
longest gap is how long a request of the process could have waited on that flush. Prints, per path, the median and
the range over the repeats of the longest gap and of the flush's duration, and checks that every flush wrote all
of its rows (``ibex_proxy_analytics_written_total``) and that the table holds them all at the end.
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
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from decimal import Decimal
from importlib.metadata import version
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from bench.hostspeed import cpu, describe, measure
from ibex_dataplane.proxy.analytics import AnalyticsRecorder, Trace
from ibex_dataplane.store import clickhouse as store
from ibex_dataplane.store.clickhouse import ClickHouse, org_query
from ibex_dataplane.store.migrations import default_migrations_dir, migrate_clickhouse


def _insert_values(url: str, table: str, rows: list[list[Any]], column_names: list[str]) -> None:
    """The previous path's engine side: clickhouse-connect encodes Python values (runs in the engine process)."""
    store._client(url).insert(table, rows, column_names=column_names)


class ValuesInsert:
    """A ClickHouse whose ``insert`` ships the rows as Python values, as the facade did before the JSON block."""

    def __init__(self, clickhouse: ClickHouse) -> None:
        self._ch = clickhouse

    async def insert(self, table: str, rows: Iterable[Sequence[Any]], column_names: Sequence[str]) -> None:
        values = [list(r) for r in rows]
        if values:
            await self._ch._call(_insert_values, table, values, list(column_names))


def trace(org: uuid.UUID) -> Trace:
    return Trace(
        org_id=org, agent_id=uuid.uuid4(), request_id=f"req_{uuid.uuid4().hex}", ts=datetime.now(UTC),
        key_id="key-bench", session_id="", route="/v1/chat/completions", model="bench-model", provider="bench",
        stream=False, status_code=200, error_code="", prompt_tokens=12, completion_tokens=16,
        cost_usd=Decimal("0.00012345"), latency_ms=1.2, upstream_ms=0.4,
        stage_ms={"authenticate": 0.05, "rate_limit": 0.1, "budget_hold": 0.2, "directive": 0.05}, priced=True,
    )  # fmt: skip


async def flush_once(clickhouse: Any, org: uuid.UUID, rows: int) -> tuple[float, float]:
    """One flush of ``rows`` traces: (the longest gap between the ticker's turns, the flush's duration), in ms."""
    registry = CollectorRegistry()
    recorder = AnalyticsRecorder(clickhouse, registry, batch_size=rows)
    for _ in range(rows):
        recorder.record(trace(org))
    longest, running = 0.0, True

    async def ticker() -> None:
        nonlocal longest
        last = time.perf_counter()
        while running:
            await asyncio.sleep(0)
            now = time.perf_counter()
            longest, last = max(longest, now - last), now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    started = time.perf_counter()
    await recorder.flush()
    took = time.perf_counter() - started
    running = False
    await task
    written = registry.get_sample_value("ibex_proxy_analytics_written_total")
    if written != rows:
        raise SystemExit(f"a flush wrote {written} of {rows} rows")
    return longest * 1000, took * 1000


async def run(args: argparse.Namespace, root: Path) -> None:
    clickhouse = ClickHouse(f"chdb://{root / 'analytics'}")
    try:
        await migrate_clickhouse(clickhouse, default_migrations_dir() / "clickhouse")
        org = uuid.uuid4()
        paths: dict[str, Any] = {"values": ValuesInsert(clickhouse), "json": clickhouse}
        for target in paths.values():  # warm-up: the engine process, its client, the tables' first parts
            await flush_once(target, org, 50)
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
        for i in range(args.repeats):
            for name in list(paths) if i % 2 == 0 else list(reversed(paths)):
                results[name].append(await flush_once(paths[name], org, args.rows))
        stored = await clickhouse.query(org_query("SELECT count() FROM llm_traces WHERE org_id = {org_id:UUID}", org))
        expected = (2 * 50) + 2 * args.repeats * args.rows
        if stored != [(expected,)]:
            raise SystemExit(f"llm_traces holds {stored} rows of the org, expected {expected}")
    finally:
        await clickhouse.close()

    def spread(values: list[float]) -> str:
        return f"{statistics.median(values):7.2f} ({min(values):.2f}-{max(values):.2f})"

    print(f"{args.rows} trace rows (and as many usage rows) per flush, {args.repeats} flushes per path, alternated")
    print(f"{'path':8} {'longest event-loop gap, ms':>30} {'flush duration, ms':>26}")
    for name, pairs in results.items():
        print(f"{name:8} {spread([p[0] for p in pairs]):>30} {spread([p[1] for p in pairs]):>26}")
    gap = {name: statistics.median(p[0] for p in pairs) for name, pairs in results.items()}
    print(f"longest gap, json / values: {gap['json'] / gap['values']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1000, help="trace rows per flush (the recorder's batch size)")
    parser.add_argument("--repeats", type=int, default=7, help="flushes per path")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"commit {commit}; {cpu()}; {describe(measure())}")
    print("versions: " + ", ".join(f"{p} {version(p)}" for p in ("orjson", "clickhouse-connect", "chdb", "chdb-core")))
    with open("/proc/loadavg") as f:
        print(f"load average before: {f.read().split()[0]}")
    root = Path(tempfile.mkdtemp(prefix="ibex-analytics-bench-"))
    try:
        asyncio.run(run(args, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
