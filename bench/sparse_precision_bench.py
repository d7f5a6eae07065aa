"""CPU per text of the SPLADE encoder at each precision, and how close int8's activations are to float32's.

Run from the repository root: ``python bench/sparse_precision_bench.py --locomo PATH/TO/locomo.json [--rounds 3]``.

Both encoders (``OnnxSpladeEncoder(precision=...)``, one onnxruntime thread each, as the memory stage runs them)
encode the same texts in calls of 100 and of 10 (a full ``:batch`` and one slice of the write path), the two
precisions alternating within every round. Two corpora: LoCoMo turns of the file's conversations (a few words to a
paragraph) and the memory benchmark's generated sentences (alike in length). The figure is this process's CPU time
per text (the encoder's thread included), the median over ``--rounds`` with the spread. Closeness is measured on
the LoCoMo turns: the cosine of each text's int8 activation to its float32 one, and the share of kept terms
(weight >= the encoder's minimum) the two have in common (Jaccard). It asserts nothing.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.memory_bench import sentence  # noqa: E402
from ibex_dataplane.embedding.splade import DEFAULT_MIN_WEIGHT, OnnxSpladeEncoder  # noqa: E402
from ibex_dataplane.evaluation.dataset import load_locomo  # noqa: E402

SIZES = (100, 10)


def cpu_per_text(encoder: OnnxSpladeEncoder, texts: list[str], size: int) -> float:
    started = time.process_time()
    for first in range(0, len(texts), size):
        encoder.encode_sync(texts[first : first + size])
    return (time.process_time() - started) * 1000 / len(texts)


def closeness(exact: OnnxSpladeEncoder, quick: OnnxSpladeEncoder, texts: list[str]) -> dict[str, float]:
    cosines: list[float] = []
    shared: list[float] = []
    for first in range(0, len(texts), 16):
        a: Any = exact.activations(texts[first : first + 16])
        b: Any = quick.activations(texts[first : first + 16])
        cosines += ((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).tolist()
        for row in range(len(a)):
            kept_a, kept_b = (
                set(np.flatnonzero(a[row] >= DEFAULT_MIN_WEIGHT)),
                set(np.flatnonzero(b[row] >= DEFAULT_MIN_WEIGHT)),
            )
            shared.append(len(kept_a & kept_b) / max(1, len(kept_a | kept_b)))
    return {"cosine min": min(cosines), "cosine median": statistics.median(cosines),
            "kept terms shared, min": min(shared), "kept terms shared, median": statistics.median(shared)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--locomo", type=Path, required=True, help="a LoCoMo JSON file")
    parser.add_argument("--texts", type=int, default=800)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    turns = [t.write_body()["content"] for c in load_locomo(args.locomo) for t in c.turns][: args.texts]
    rng = random.Random(1)
    corpora = {"locomo": turns, "generated": [sentence(rng, i) for i in range(args.texts)]}
    encoders = {p: OnnxSpladeEncoder.from_installed_packages(precision=p) for p in ("float32", "int8")}
    figures: dict[tuple[str, int, str], list[float]] = {}
    for round_ in range(args.rounds):
        order = list(encoders) if round_ % 2 == 0 else list(reversed(encoders))
        for corpus, texts in corpora.items():
            for size in SIZES:
                for precision in order:
                    figures.setdefault((corpus, size, precision), []).append(
                        cpu_per_text(encoders[precision], texts, size)
                    )
    print(f"{args.texts} texts per corpus, {args.rounds} rounds; CPU ms per text, median [min-max], ratio int8/float32")
    for corpus in corpora:
        for size in SIZES:
            cells = {p: figures[(corpus, size, p)] for p in encoders}
            ratio = statistics.median(cells["int8"]) / statistics.median(cells["float32"])
            text = "  ".join(f"{p}: {statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}]" for p, v in cells.items())
            print(f"{corpus:9} calls of {size:3}  {text}  ratio {ratio:.2f}")
    near = closeness(encoders["float32"], encoders["int8"], turns)
    print("int8 against float32 on the LoCoMo turns: " + ", ".join(f"{k} {v:.4f}" for k, v in near.items()))
    for encoder in encoders.values():
        encoder.close()


if __name__ == "__main__":
    main()
