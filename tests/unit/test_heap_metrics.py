"""The serving processes' garbage collector: pauses observed by generation, the startup heap frozen."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from ibex_dataplane.runtime.heap import HeapMetrics


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """A test that freezes puts the objects back into the collected generations afterwards."""
    try:
        yield
    finally:
        gc.unfreeze()


def pauses(registry: CollectorRegistry, prefix: str, generation: str) -> float:
    return registry.get_sample_value(f"{prefix}_gc_pause_seconds_count", {"generation": generation}) or 0.0


def test_a_watched_collection_is_observed_under_its_generation_and_nothing_after_unwatch(
    registry: CollectorRegistry,
) -> None:
    heap = HeapMetrics("ibex_test", registry)
    heap.watch()
    heap.watch()  # once per instance, however often it is asked
    try:
        gc.collect(2)
        gc.collect(0)
    finally:
        heap.unwatch()
    assert pauses(registry, "ibex_test", "2") == 1
    assert pauses(registry, "ibex_test", "0") >= 1  # the allocator may run its own young collections too
    assert heap._callback not in gc.callbacks
    gc.collect(2)
    assert pauses(registry, "ibex_test", "2") == 1


@pytest.mark.usefixtures("unfrozen")
def test_freezing_moves_the_surviving_heap_out_of_later_collections_and_reports_how_much(
    registry: CollectorRegistry,
) -> None:
    heap = HeapMetrics("ibex_test", registry)
    kept = [{"startup": i} for i in range(1000)]  # long-lived objects a stage allocates while it starts
    frozen = heap.freeze()
    assert frozen == gc.get_freeze_count()
    assert frozen > len(kept)
    assert registry.get_sample_value("ibex_test_gc_frozen_objects") == frozen
    # What a full collection still walks no longer includes the frozen heap.
    assert len(gc.get_objects(generation=2)) < frozen


async def test_the_stage_watches_only_while_its_application_runs(registry: CollectorRegistry) -> None:
    heap = HeapMetrics("ibex_test", registry)
    watching = heap.watching(None)  # type: ignore[arg-type]
    await anext(watching)
    assert heap._callback in gc.callbacks
    with pytest.raises(StopAsyncIteration):
        await anext(watching)
    assert heap._callback not in gc.callbacks
