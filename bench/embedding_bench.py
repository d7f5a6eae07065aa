"""Latency and throughput of the in-process MiniLM embedder, and what coalescing concurrent calls buys.

Run from the repository root: ``python bench/embedding_bench.py [--seconds 6] [--rounds 6]``. Prints medians,
p95s and sentences per second; it asserts nothing and no CI job gates on it (STYLE.md, Tests).

Scenarios, each given ``--seconds`` in total:
0. the two precisions the packaged checkpoint can be built at, ``float32`` and ``int8`` (the default), side by
   side: ``embed_sync`` with 1 and 32 sentences per call, and how close the int8 vectors are to the float32 ones
   (cosine over the corpus);
1. ``embed_sync`` with 1, 8 and 32 sentences per call: the model alone, one caller (int8, as shipped).
2. ``embed`` (async) with 1, 8 and 32 sentences per call, one caller, coalescing off, with a 0 ms window and
   with a 2 ms window: what going through the worker thread and the coalescer costs a lone caller.
3. 1, 8 and 32 concurrent callers with one sentence each (a busy write path, or several context assemblies
   at once), with the same three coalescing settings.

The machine this runs on may be shared, so the scenarios compared with each other run interleaved, in
``--rounds`` short turns each, rather than one after the other: background load then hits all of them alike.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import statistics
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer

from ibex_dataplane.embedding.onnx import OnnxMiniLMEmbedder, packaged_tokenizer_path

SUBJECTS = ["The user", "Priya", "The on-call engineer", "Our biggest customer", "The finance team", "Sam"]
FACTS = [
    "prefers window seats on long-haul flights and always asks for a vegetarian meal",
    "moved the weekly sync to Thursday mornings because of the time difference with the Berlin office",
    "wants summaries in bullet points, no longer than five lines, with the decision first",
    "is allergic to peanuts",
    "reported that the staging cluster runs out of memory when the nightly reindex overlaps the backup job",
    "asked us to stop sending marketing e-mails and to keep only invoices and security notices",
    "uses Python 3.11 with numpy and asks for type hints in every example",
    "closes the quarter on the last Friday of March, June, September and December",
]
TAILS = ["", " since last spring", ", according to the notes from the March planning session", " (confirmed twice)"]
COALESCING = {"coalescing off": None, "coalescing 0 ms": 0.0, "coalescing 2 ms": 0.002}


def corpus(size: int) -> list[str]:
    """Deterministic memory-like sentences of mixed length."""
    return [
        f"{SUBJECTS[i % len(SUBJECTS)]} {FACTS[(i // 3) % len(FACTS)]}{TAILS[(i // 7) % len(TAILS)]}."
        for i in range(size)
    ]


@dataclass
class Tally:
    """Latencies and volume of one scenario, summed over its rounds."""

    latencies: list[float] = field(default_factory=list)
    sentences: int = 0
    elapsed: float = 0.0

    def line(self, label: str) -> str:
        ordered = sorted(self.latencies)
        p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
        return (
            f"{label:<36} median {statistics.median(ordered) * 1000:7.2f} ms   p95 {p95 * 1000:7.2f} ms"
            f"   {self.sentences / self.elapsed:5.0f} sentences/s   ({len(ordered)} calls)"
        )


def run_sync(embedder: OnnxMiniLMEmbedder, texts: list[str], batch: int, seconds: float, tally: Tally) -> None:
    started = time.perf_counter()
    done = 0
    while time.perf_counter() - started < seconds:
        first = tally.sentences + done
        chunk = [texts[(first + j) % len(texts)] for j in range(batch)]
        t0 = time.perf_counter()
        embedder.embed_sync(chunk)
        tally.latencies.append(time.perf_counter() - t0)
        done += batch
    tally.sentences += done
    tally.elapsed += time.perf_counter() - started


async def run_async(
    embedder: OnnxMiniLMEmbedder, texts: list[str], batch: int, callers: int, seconds: float, tally: Tally
) -> None:
    deadline = time.perf_counter() + seconds
    done = 0

    async def caller(offset: int) -> None:
        nonlocal done
        i = offset
        while time.perf_counter() < deadline:
            chunk = [texts[(i + j) % len(texts)] for j in range(batch)]
            t0 = time.perf_counter()
            await embedder.embed(chunk)
            tally.latencies.append(time.perf_counter() - t0)
            done += batch
            i += batch * callers

    started = time.perf_counter()
    await asyncio.gather(*(caller(n * batch) for n in range(callers)))
    tally.sentences += done
    tally.elapsed += time.perf_counter() - started


def interleave(rounds: int, scenarios: dict[str, Callable[[Tally], None]]) -> None:
    """Run every scenario ``rounds`` times, in turn, then print one line per scenario."""
    tallies = {label: Tally() for label in scenarios}
    for _ in range(rounds):
        for label, scenario in scenarios.items():
            scenario(tallies[label])
    for label, tally in tallies.items():
        print(tally.line(label))


def in_loop(make: Callable[[Tally], Coroutine[Any, Any, None]]) -> Callable[[Tally], None]:
    """A scenario that runs ``make`` in a fresh event loop (one per turn, as a short-lived process would)."""
    return lambda tally: asyncio.run(make(tally))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="total duration of each scenario")
    parser.add_argument("--rounds", type=int, default=6, help="turns each scenario's duration is split into")
    parser.add_argument("--threads", type=int, default=2, help="onnxruntime intra-op threads")
    args = parser.parse_args()
    turn = args.seconds / args.rounds
    texts = corpus(512)
    tokenizer = Tokenizer.from_file(str(packaged_tokenizer_path()))
    tokenizer.no_padding()
    tokens = [len(encoding.ids) for encoding in tokenizer.encode_batch_fast(texts)]

    print(f"machine: {os.cpu_count()} cores; onnxruntime intra-op threads: {args.threads}")
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    started = time.perf_counter()
    embedders = {
        name: OnnxMiniLMEmbedder.from_installed_packages(coalesce_window_s=window, intra_op_threads=args.threads)
        for name, window in COALESCING.items()
    }
    print(f"model load + warm-up: {(time.perf_counter() - started) * 1000 / len(embedders):.0f} ms per embedder")
    print(
        f"corpus: {len(texts)} sentences, tokens per sentence median {statistics.median(tokens):.0f} "
        f"(min {min(tokens)}, max {max(tokens)}); {args.seconds:g} s per scenario in {args.rounds} rounds"
    )
    plain = embedders["coalescing off"]

    exact = OnnxMiniLMEmbedder.from_installed_packages(
        precision="float32", coalesce_window_s=None, intra_op_threads=args.threads
    )
    cosines = (exact.embed_sync(texts) * plain.embed_sync(texts)).sum(axis=1)
    print(f"\n0. float32 against int8 (the default), embed_sync; cosine of the int8 vector to the float32 one: "
          f"min {cosines.min():.4f}, median {statistics.median(cosines.tolist()):.4f}")  # fmt: skip
    interleave(
        args.rounds,
        {
            f"{name:<7} batch {batch:>2}": functools.partial(run_sync, embedder, texts, batch, turn)
            for batch in (1, 32)
            for name, embedder in (("float32", exact), ("int8", plain))
        },
    )
    exact.close()

    print("\n1. one caller, embed_sync")
    interleave(
        args.rounds,
        {f"batch {batch:>2}": functools.partial(run_sync, plain, texts, batch, turn) for batch in (1, 8, 32)},
    )

    print("\n2. one caller, async embed()")
    interleave(
        args.rounds,
        {
            f"batch {batch:>2}  {name}": in_loop(functools.partial(run_async, embedder, texts, batch, 1, turn))
            for batch in (1, 8, 32)
            for name, embedder in embedders.items()
        },
    )

    print("\n3. concurrent callers, one sentence each")
    interleave(
        args.rounds,
        {
            f"{callers:>2} callers  {name}": in_loop(functools.partial(run_async, embedder, texts, 1, callers, turn))
            for callers in (1, 8, 32)
            for name, embedder in embedders.items()
        },
    )
    for embedder in embedders.values():
        embedder.close()
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
