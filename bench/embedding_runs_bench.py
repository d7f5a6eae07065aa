"""CPU per text of both write-path encoders (MiniLM dense, SPLADE sparse) by how a call is cut into model runs.

Run from the repository root: ``python bench/embedding_runs_bench.py [--rounds 3] [--texts 500] [--overheads 8 ...]``.

Two corpora: LoCoMo turns of one development conversation (lengths vary widely: a few words to a paragraph) and
the memory benchmark's generated sentences (alike in length). Each is encoded in calls of 100 texts (a full
``:batch``) and of 25 (one slice of the write path), with the run cutting of ``ibex_dataplane.embedding.runs``
at several per-run overheads; ``fixed`` stands for the old rule (length-sorted runs of the encoder's maximum
size, 32 dense, 16 sparse): as few runs as that size allows, cut where they pad least, so if anything kinder
than the old fixed chunks. The figure is the process CPU time (the encoders' intra-op threads included) per text,
the median over ``--rounds`` interleaved rounds with the spread; it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import ibex_dataplane.embedding.onnx as dense_module  # noqa: E402
import ibex_dataplane.embedding.splade as sparse_module  # noqa: E402
from bench.memory_bench import sentence  # noqa: E402
from ibex_dataplane.embedding.onnx import OnnxMiniLMEmbedder  # noqa: E402
from ibex_dataplane.embedding.runs import padded_runs  # noqa: E402
from ibex_dataplane.embedding.splade import OnnxSpladeEncoder  # noqa: E402
from ibex_dataplane.evaluation.dataset import load_locomo  # noqa: E402

FIXED = 10**9  # an overhead so large that every run is as big as the encoder allows: the old fixed-size rule


def cutting(overhead: int) -> Callable[..., list[list[int]]]:
    def runs(lengths: Sequence[int], *, max_size: int) -> list[list[int]]:
        return padded_runs(lengths, max_size=max_size, overhead=overhead)

    return runs


def cpu_per_text(encode: Callable[[list[str]], object], texts: list[str], size: int) -> float:
    started = time.process_time()
    for first in range(0, len(texts), size):
        encode(texts[first : first + size])
    return (time.process_time() - started) * 1000 / len(texts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--locomo", type=Path, required=True, help="a LoCoMo JSON file (its second conversation)")
    parser.add_argument("--texts", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--overheads", type=int, nargs="+", default=[0, 4, 8, 16, 64])
    args = parser.parse_args()
    conversation = load_locomo(args.locomo)[1]
    rng = random.Random(1)
    corpora = {
        "locomo": [t.write_body()["content"] for t in conversation.turns][: args.texts],
        "generated": [sentence(rng, i) for i in range(args.texts)],
    }
    dense = OnnxMiniLMEmbedder.from_installed_packages()
    sparse = OnnxSpladeEncoder.from_installed_packages()
    encoders: dict[str, Callable[[list[str]], object]] = {
        "dense": dense.embed_sync,
        "sparse": lambda texts: asyncio.run(sparse.encode(texts)),
    }
    rules = [("fixed", FIXED)] + [(f"overhead {o}", o) for o in args.overheads]
    figures: dict[tuple[str, str, int, str], list[float]] = {}
    for _ in range(args.rounds):
        for label, overhead in rules:
            for module in (dense_module, sparse_module):
                setattr(module, "padded_runs", cutting(overhead))  # noqa: B010 (the name each encoder calls)
            for corpus, texts in corpora.items():
                for size in (100, 25):
                    for name, encode in encoders.items():
                        figures.setdefault((corpus, name, size, label), []).append(cpu_per_text(encode, texts, size))
    print(f"{args.texts} texts per corpus, {args.rounds} rounds; CPU ms per text, median [min-max]")
    for corpus in corpora:
        for name in encoders:
            for size in (100, 25):
                cells = []
                for label, _ in rules:
                    values = figures[(corpus, name, size, label)]
                    cells.append(f"{label}: {statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]")
                print(f"{corpus:9} {name:6} calls of {size:3}  " + "  ".join(cells))


if __name__ == "__main__":
    main()
