"""A yardstick of the host's speed: the same fixed work on one thread, timed.

The load average says how many processes wanted the cores, not how fast a core ran. On a virtual machine whose
neighbours share the hardware, the same benchmark has taken half again as long from one hour to the next with the
load average near zero (``bench/results/retrieval.md``, 2026-12-06). So absolute figures of two runs compare only
when the host ran at the same speed; ratios measured side by side in one run hold either way.

The yardstick times two kinds of fixed work: pure Python (dicts, strings, sorting: what request handling does) and
numpy (float32 element-wise work on arrays larger than the caches: memory bandwidth, which the models and Postgres
also lean on), each the median of several repeats, in milliseconds; lower is faster. ``bench/report.py`` takes it
before and after every benchmark and prints both beside the load average.

The host has not always been the same CPU either: some runs had AVX512-VNNI, some not, and onnxruntime's int8
products take a different, slower path without it. :func:`cpu` names the model and says which, and the report
prints it in its header.

    .venv/bin/python -m bench.hostspeed
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def python_work() -> int:
    """Fixed interpreter work (a seeded list of records grouped, formatted and sorted); returns a checksum."""
    rng = random.Random(11)
    rows = [(i, f"org-{rng.randrange(50)}", rng.randrange(1000)) for i in range(20_000)]
    totals: dict[str, int] = {}
    for _, org, tokens in rows:
        totals[org] = totals.get(org, 0) + tokens
    lines = sorted(f"{org}:{total}" for org, total in totals.items())
    ordered = sorted(rows, key=lambda r: (r[2], r[0]))
    return sum(len(line) for line in lines) + ordered[0][0] + ordered[-1][0]


def numpy_work() -> float:
    """Fixed float32 element-wise work over arrays larger than the caches (numpy runs it on one thread, unlike
    matrix products, which its BLAS may spread over the cores); returns a checksum."""
    rng = np.random.default_rng(11)
    a = rng.standard_normal(1_000_000, dtype=np.float32)
    b = rng.standard_normal(1_000_000, dtype=np.float32)
    for _ in range(6):
        a = np.tanh(a * np.float32(0.9) + b)
    return float(a.sum())


def _median_ms(work: Callable[[], Any], repeats: int) -> float:
    work()  # warm (imports, allocator)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append((time.perf_counter() - started) * 1000)
    return round(statistics.median(times), 2)


def measure(repeats: int = 7) -> dict[str, float]:
    """``{"python_ms": ..., "numpy_ms": ...}``: the median time of each fixed work over ``repeats`` runs."""
    if repeats < 1:
        raise ValueError("repeats must be at least 1")
    return {"python_ms": _median_ms(python_work, repeats), "numpy_ms": _median_ms(numpy_work, repeats)}


def cpu(cpuinfo: str | None = None) -> str:
    """``"AMD EPYC, VNNI"`` or ``"..., no VNNI"``: the CPU model and whether it has int8 dot-product instructions
    (``avx512_vnni`` or ``avx_vnni``), from ``cpuinfo`` (the text of /proc/cpuinfo, read when None)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""  # reported like a CPU that names nothing: "unknown CPU, no VNNI"
    model, flags = "unknown CPU", set[str]()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model == "unknown CPU":
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return f"{model}, {'VNNI' if flags & {'avx512_vnni', 'avx_vnni'} else 'no VNNI'}"


def describe(speed: dict[str, float] | None) -> str:
    """``"python 21.3 / numpy 9.8 ms"`` (or ``"not taken"``)."""
    if not speed:
        return "not taken"
    return f"python {speed['python_ms']:.1f} / numpy {speed['numpy_ms']:.1f} ms"


if __name__ == "__main__":
    print(json.dumps(measure()))
