"""A per-test watchdog: a test's setup, call or teardown that runs longer than its bound gets its threads and
asyncio tasks dumped, then the session is interrupted (SIGINT), so a hang ends the run early with the evidence
instead of at CI's time limit. If the interrupted run still has not ended after a grace period (its own teardown
hangs, say on a pool waiting for connections the interrupted tasks hold), the stacks are dumped again and the
process exits.

The bounds are far above the slowest phase; they detect hangs, they are not timing assertions. A test's call:
``IBEX_TEST_WATCHDOG_SECONDS``, default 900 s (the slowest, the cluster test, takes about eight minutes here).
Setup and teardown: ``IBEX_TEST_WATCHDOG_FIXTURE_SECONDS``, default 1800 s (the cluster test's fixtures build the
container image, which a fresh machine takes minutes for).
"""

from __future__ import annotations

import asyncio
import gc
import io
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from typing import TextIO

DEFAULT_SECONDS = 900.0
DEFAULT_FIXTURE_SECONDS = 1800.0
GRACE_SECONDS = 120.0
"""After the interrupt: how long the run may take to end by itself before the process exits."""
EXIT_CODE = 70


def bound(phase: str = "call") -> float:
    """Seconds a test's ``phase`` (setup, call, teardown) may run before the watchdog fires."""
    if phase == "call":
        return float(os.environ.get("IBEX_TEST_WATCHDOG_SECONDS", DEFAULT_SECONDS))
    return float(os.environ.get("IBEX_TEST_WATCHDOG_FIXTURE_SECONDS", DEFAULT_FIXTURE_SECONDS))


def dump(nodeid: str, seconds: float, out: TextIO) -> None:
    """Every thread's stack and every pending task of every running event loop, to ``out``.

    What a reader needs most comes last, because a CI log is often read from its tail: the other threads and
    loops first, then the tasks of the loop the main thread runs (the test's own), then the main thread's stack,
    then the headline again."""
    print(f"\n=== watchdog: {nodeid} still running after {seconds:.0f} s ===", file=out, flush=True)
    main = threading.main_thread().ident
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sys._current_frames()
    loops = [o for o in gc.get_objects() if isinstance(o, asyncio.AbstractEventLoop) and o.is_running()]
    loops.sort(key=lambda loop: getattr(loop, "_thread_id", None) == main)  # the main thread's loop last
    for ident, frame in frames.items():
        if ident != main:
            print(f"--- thread {names.get(ident, ident)} ---", file=out)
            traceback.print_stack(frame, file=out)
    for loop in loops:
        tasks = asyncio.all_tasks(loop)
        owner = names.get(getattr(loop, "_thread_id", None), "?")
        print(f"--- {len(tasks)} pending asyncio tasks of the loop in thread {owner} ---", file=out, flush=True)
        for task in tasks:
            print(f"* {task.get_name()}: {task.get_coro()!r}", file=out)
            try:
                task.print_stack(limit=30, file=out)
            except Exception as e:  # compiled coroutines (grpc's) have no Python frames to print
                print(f"  (no stack: {type(e).__name__}: {e})", file=out)
    if main in frames:
        print(f"--- thread {names.get(main, main)} ---", file=out)
        traceback.print_stack(frames[main], file=out)
    print(f"=== watchdog: {nodeid} still running after {seconds:.0f} s (end of dump) ===", file=out)
    out.flush()


class Watchdog:
    """``write`` receives the dump (the terminal: pytest holds the process's own stderr while a test runs)."""

    def __init__(
        self, nodeid: str, seconds: float, write: Callable[[str], None], *, grace: float = GRACE_SECONDS
    ) -> None:
        self._nodeid = nodeid
        self._seconds = seconds
        self._grace = grace
        self._write = write
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True

    def __enter__(self) -> Watchdog:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()

    def _report(self, seconds: float) -> None:
        out = io.StringIO()
        dump(self._nodeid, seconds, out)
        self._write(out.getvalue())

    def _fire(self) -> None:
        last = threading.Timer(self._grace, self._exit)  # not cancelled by __exit__: it covers the run's end
        last.daemon = True
        last.start()
        try:
            self._report(self._seconds)
        finally:  # the run ends even if the dump could not be made
            os.kill(os.getpid(), signal.SIGINT)

    def _exit(self) -> None:
        try:
            self._write(f"\n=== watchdog: the interrupted run did not end within {self._grace:.0f} s; exiting ===\n")
            self._report(self._seconds + self._grace)
        finally:
            os._exit(EXIT_CODE)
