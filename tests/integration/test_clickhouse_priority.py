"""The embedded ClickHouse engine runs at the lowest CPU priority, and nothing else does: its inserts (parsing a
batch, writing and merging parts, on several threads) wait for a free core instead of taking one from requests."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from ibex_dataplane.store.clickhouse import ENGINE_NICE, ClickHouse


def thread_nices(pid: int) -> dict[int, int]:
    """Thread id -> nice value, for every thread of ``pid`` (Linux keeps a nice value per thread); a thread that
    ends while they are read is left out."""
    nices = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError):
            nices[int(task.name)] = os.getpriority(os.PRIO_PROCESS, int(task.name))
    return nices


async def test_every_thread_of_the_engine_process_runs_at_the_lowest_priority_and_its_caller_does_not(
    tmp_path: Path,
) -> None:
    own = thread_nices(os.getpid())
    clickhouse = ClickHouse(f"chdb://{tmp_path / 'analytics'}")
    try:
        await clickhouse.command("CREATE TABLE t (n UInt8) ENGINE = MergeTree ORDER BY n")
        await clickhouse.insert("t", [[1], [2]], ["n"])  # the engine is open and has worked: its threads exist
        (engine,) = clickhouse._executor._processes  # type: ignore[attr-defined]
        nices = thread_nices(engine)
        # ClickHouse raises its memory tracker's own priority on purpose (a thread that only polls the allocator's
        # counters); every other thread, the engine's pools and the process's Python threads, takes ours.
        ours = {tid: nice for tid, nice in nices.items() if _name(engine, tid) != "MemoryWorker"}
        assert len(ours) > 5  # the engine's own threads, not only the process's first one
        assert set(ours.values()) == {ENGINE_NICE}
        assert ENGINE_NICE == 19
    finally:
        await clickhouse.close()
    assert {tid: nice for tid, nice in thread_nices(os.getpid()).items() if tid in own} == own


def _name(pid: int, tid: int) -> str:
    return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
