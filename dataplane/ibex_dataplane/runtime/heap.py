"""The garbage collector of a serving process: its startup heap frozen, its pauses measured.

A stage's process allocates most of its long-lived objects while it starts (modules, the ONNX and tokenizer
wrappers, Presidio's recognizers, the catalog, compiled patterns), and CPython's full collection walks all of them
every time it runs: about 80 ms in ``ibex dev`` on the benchmark machine, with the event loop stopped and every
request in flight waiting. :meth:`HeapMetrics.freeze` collects once, then moves every surviving object to the
permanent generation (:func:`gc.freeze`), which later collections skip; the same full collection then takes a
millisecond or two. Frozen objects are still freed by reference counting; only cycles among them are never
collected, and the collection just before freezing clears those that startup left.

Every pause is observed per generation in ``<prefix>_gc_pause_seconds``, and the number of frozen objects is the
gauge ``<prefix>_gc_frozen_objects``, on the stage's own registry (in multiprocess mode the gauge shows the largest
among live workers).
"""

from __future__ import annotations

import gc
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, Histogram

__all__ = ["HEAP", "HeapMetrics"]

_PAUSE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class HeapMetrics:
    """GC pauses by generation and the objects frozen at startup, for one stage (``prefix``: ``ibex_proxy``...)."""

    def __init__(self, prefix: str, registry: CollectorRegistry) -> None:
        self.pauses = Histogram(
            f"{prefix}_gc_pause_seconds", "Garbage collector pauses of this process, by generation.", ["generation"],
            buckets=_PAUSE_BUCKETS, registry=registry,
        )  # fmt: skip
        self.frozen = Gauge(
            f"{prefix}_gc_frozen_objects", "Objects moved to the permanent generation once startup finished.",
            registry=registry, multiprocess_mode="livemax",
        )  # fmt: skip
        self._by_generation = [self.pauses.labels(str(g)) for g in range(3)]
        self._started = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self._by_generation[info["generation"]].observe(time.perf_counter() - self._started)

    def watch(self) -> None:
        """Observe every collection from now on (once per instance; :meth:`unwatch` stops)."""
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def unwatch(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    async def watching(self, _app: web.Application) -> AsyncIterator[None]:
        """A ``cleanup_ctx`` entry: observe collections while the application runs."""
        self.watch()
        try:
            yield
        finally:
            self.unwatch()

    def freeze(self) -> int:
        """Collect, then freeze everything that survived: call it once the stage is up, before it serves."""
        gc.collect()
        gc.freeze()
        frozen = gc.get_freeze_count()
        self.frozen.set(frozen)
        return frozen


HEAP = web.AppKey("heap", HeapMetrics)
"""The stage's :class:`HeapMetrics` on its ``web.Application``, for the command that serves it."""
