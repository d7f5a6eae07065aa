"""CPU time of processes and threads, read from /proc, for the benchmarks' "CPU per call" breakdowns.

Readings are clock ticks (``SC_CLK_TCK``, 100 per second here) of user plus system time; a benchmark reads them
before and after a phase of N calls and :func:`cpu_ms_per_call` turns the two readings into core-milliseconds per
call by consumer. On a machine with fewer cores than busy processes this is the honest measure of what one process
costs per request: its throughput alone is bounded by the others sharing the cores.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple


class Ticks(NamedTuple):
    name: str  # the command name
    parent: int  # the parent's pid
    user: int
    system: int  # in the kernel on the process's behalf: syscalls, such as socket sends and receives

    @property
    def total(self) -> int:
        return self.user + self.system


def stat_ticks(stat: Path) -> Ticks:
    """The ticks of a ``/proc/<pid>/stat`` or ``.../task/<tid>/stat``."""
    raw = stat.read_text()
    fields = raw[raw.rindex(")") + 2 :].split()
    return Ticks(raw[raw.index("(") + 1 : raw.rindex(")")], int(fields[1]), int(fields[11]), int(fields[12]))


def processes() -> Iterator[tuple[int, Ticks]]:
    """(pid, ticks) of every process still readable."""
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError, ValueError):
                yield int(proc.name), stat_ticks(proc / "stat")


def tree_ticks(roots: dict[str, int], by_name: tuple[str, ...] = ()) -> dict[str, int]:
    """Ticks by role: each named root process (``role``, and ``role, in the kernel`` for its system time alone) and
    its descendants apart (``role's children``), every process whose command name is in ``by_name`` under that name
    (e.g. ``postgres``), and this process (``client``)."""
    table = dict(processes())
    owner = {pid: role for role, pid in roots.items()}
    changed = True
    while changed:  # descendants take their root's role
        changed = False
        for pid, ticks in table.items():
            if pid not in owner and ticks.parent in owner:
                root = owner[ticks.parent]
                owner[pid] = root if root.endswith("'s children") else f"{root}'s children"
                changed = True
    out: dict[str, int] = {}
    me = os.getpid()
    for pid, ticks in table.items():
        consumer = "client" if pid == me else ticks.name if ticks.name in by_name else owner.get(pid)
        if consumer is not None:
            out[consumer] = out.get(consumer, 0) + ticks.total
        if pid in roots.values():
            out[f"{owner[pid]}, in the kernel"] = ticks.system
    return out


def cpu_ms_per_call(before: dict[str, int], after: dict[str, int], calls: int) -> dict[str, float]:
    """Core-milliseconds per call by role between two readings, largest first (roles under 0.05 ms left out)."""
    tick_ms = 1000 / os.sysconf("SC_CLK_TCK")
    spent = {k: (after.get(k, 0) - before.get(k, 0)) * tick_ms / calls for k in after}
    return {k: round(v, 3) for k, v in sorted(spent.items(), key=lambda kv: -kv[1]) if v >= 0.05}
