"""The figures of one benchmark run as JSON, beside what the benchmark prints: ``bench/report.py`` reads them.

A benchmark builds one :class:`Figures`, puts its results under dotted keys (``search.100000.latency``) and writes
them at the end when it was given ``--json PATH``. Latencies are stored as their summary (n, p50, p95, p99, mean in
milliseconds) and, for the distributions the report plots, as the samples themselves.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any


def quantile(values: list[float], q: float) -> float:
    """The nearest-rank quantile, as the benchmarks print it."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def latency(ms: list[float], *, samples: bool = False) -> dict[str, Any]:
    """Summary of latencies in milliseconds (and the samples when ``samples``)."""
    if not ms:
        raise ValueError("no latencies to summarise")
    out: dict[str, Any] = {
        "n": len(ms), "p50": statistics.median(ms), "p95": quantile(ms, 0.95), "p99": quantile(ms, 0.99),
        "mean": statistics.fmean(ms),
    }  # fmt: skip
    if samples:
        out["samples_ms"] = [round(v, 4) for v in ms]
    return out


class Figures:
    def __init__(self, bench: str) -> None:
        self.data: dict[str, Any] = {"bench": bench, "load_before": list(os.getloadavg())}

    def put(self, key: str, value: Any) -> None:
        node = self.data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value

    def write(self, path: Path | None) -> None:
        if path is None:
            return
        self.data["load_after"] = list(os.getloadavg())
        path.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
