"""Latency of the memory packer on 200 candidates, per budget, with run-to-run spread.

Run: PYTHONPATH=dataplane python bench/context_packer_bench.py
Candidates look like retrieved memories: formatted entries of 20-300 tokens (skewed towards short ones) and
composite scores in [0, 1). Each budget is timed over many calls cycling through seeded candidate sets, and the
whole measurement is repeated so the spread between runs shows. Target (not asserted): p99 <= 2 ms.
Not a test: it never asserts on time.
"""

from __future__ import annotations

import gc
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections import Counter

import numpy as np

from ibex_dataplane.context.packer import PackCandidate, PackResult, pack_memories

CANDIDATES = 200
BUDGETS = (500, 2000, 8000)
MAX_ITEMS_CASES = ((8000, 20),)  # (budget, max_items): the item-count DP
SETS = 50
CALLS = 2000
RUNS = 3
TARGET_P99_MS = 2.0


def candidate_sets(seed: int) -> list[list[PackCandidate]]:
    rnd = random.Random(seed)
    sets = []
    for s in range(SETS):
        sets.append(
            [
                PackCandidate(f"m{s:02d}-{i:03d}", rnd.random(), min(300, 20 + int(rnd.expovariate(1 / 80))))
                for i in range(CANDIDATES)
            ]
        )
    return sets


def measure(sets: list[list[PackCandidate]], budget: int, max_items: int | None) -> tuple[list[float], Counter[str]]:
    for cands in sets[:5]:  # warm up
        pack_memories(cands, budget, max_items=max_items)
    gc.collect()
    samples: list[float] = []
    paths: Counter[str] = Counter()
    for call in range(CALLS):
        cands = sets[call % len(sets)]
        start = time.perf_counter_ns()
        result: PackResult = pack_memories(cands, budget, max_items=max_items)
        samples.append((time.perf_counter_ns() - start) / 1e6)
        paths[result.path.value] += 1
    return samples, paths


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha.stdout.strip() + (" (uncommitted changes)" if dirty.stdout.strip() else "")


def main() -> None:
    print(
        f"python {platform.python_version()}, numpy {np.__version__}, {platform.machine()}, "
        f"{os.cpu_count()} cpus, commit {git_commit()}"
    )
    print(f"{CANDIDATES} candidates, 20-300 tokens each; {CALLS} calls per budget over {SETS} seeded sets; {RUNS} runs")
    sets = candidate_sets(seed=8)
    sizes = [c.tokens for s in sets for c in s]
    print(f"entry tokens: median {statistics.median(sizes):.0f}, mean {statistics.fmean(sizes):.0f}, max {max(sizes)}")
    cases: list[tuple[int, int | None]] = [(b, None) for b in BUDGETS] + list(MAX_ITEMS_CASES)
    worst: dict[tuple[int, int | None], float] = {}
    for run in range(1, RUNS + 1):
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"\nrun {run} (load average {load})")
        for budget, max_items in cases:
            samples, paths = measure(sets, budget, max_items)
            p50, p99 = percentile(samples, 0.50), percentile(samples, 0.99)
            worst[(budget, max_items)] = max(worst.get((budget, max_items), 0.0), p99)
            label = f"budget {budget:>5}" + (f", max_items {max_items}" if max_items is not None else "")
            path = ", ".join(f"{k} {v}" for k, v in sorted(paths.items()))
            print(f"  {label:<30} p50 {p50:6.3f} ms  p99 {p99:6.3f} ms  max {max(samples):6.3f} ms  path: {path}")
    print(f"\nworst p99 over runs (target <= {TARGET_P99_MS} ms):")
    for (budget, max_items), p99 in worst.items():
        label = f"budget {budget:>5}" + (f", max_items {max_items}" if max_items is not None else "")
        print(f"  {label:<30} {p99:6.3f} ms  {'met' if p99 <= TARGET_P99_MS else 'missed'}")
    print(f"load average at end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}", file=sys.stdout)


if __name__ == "__main__":
    main()
