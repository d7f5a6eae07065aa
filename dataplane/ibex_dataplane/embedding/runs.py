"""How a call's texts are cut into model runs: both ONNX encoders pad every text of a run to the run's longest.

A run costs about (texts x longest text's tokens) of model work plus a fixed overhead per run (launching the
graph, the intra-op threads' hand-offs). With texts sorted by length, :func:`padded_runs` picks the contiguous runs
that minimise that cost, a few texts at a time where lengths vary widely and up to ``max_size`` where they are
alike. Fixed-size runs pad the short texts of a mixed request up to its long ones: on LoCoMo turns, fixed runs of
32 cost the dense model 1.5 times the CPU per text of this cut in requests of 100 texts, and 2.4 times in requests
of 25 (the write path's slices).
"""

from __future__ import annotations

from collections.abc import Sequence

#: The fixed cost of one model run, in padded token slots. Measured on 2 cores, CPU per text of both models over
#: LoCoMo turns and over the memory benchmark's sentences, in requests of 100 and of 25: overheads from 0 to 64
#: were within each other's spread, all far below fixed-size runs on LoCoMo; 8 was kept (bench/results/ingest.md).
RUN_OVERHEAD_TOKENS = 8


def padded_runs(lengths: Sequence[int], *, max_size: int, overhead: int = RUN_OVERHEAD_TOKENS) -> list[list[int]]:
    """Indexes into ``lengths``, grouped into runs of at most ``max_size``, shortest texts first.

    Exact (dynamic programming over the length-sorted texts): the cost of a run is its size times its longest
    length plus ``overhead``, and the runs returned have the least total cost. Every index appears once.
    """
    if max_size < 1:
        raise ValueError("max_size must be at least 1")
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    n = len(order)
    best = [0] * (n + 1)  # best[j]: least cost of the first j sorted texts
    cut = [0] * (n + 1)  # cut[j]: where the last run of that best split starts
    for j in range(1, n + 1):
        width = lengths[order[j - 1]]
        best[j] = best[j - 1] + width + overhead
        cut[j] = j - 1
        for i in range(max(0, j - max_size), j - 1):
            cost = best[i] + (j - i) * width + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    runs: list[list[int]] = []
    j = n
    while j > 0:
        runs.append(order[cut[j] : j])
        j = cut[j]
    runs.reverse()
    return runs
