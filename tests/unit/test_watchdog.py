"""The test suite's hang watchdog dumps what a hung test is waiting on (tests/support/watchdog.py)."""

from __future__ import annotations

import asyncio
import io
import os
import subprocess
import sys
import threading
from pathlib import Path

from tests.support.watchdog import EXIT_CODE, dump

REPO = Path(__file__).resolve().parents[2]


async def test_the_dump_names_the_thread_and_the_task_a_hang_waits_in() -> None:
    async def waits_forever(event: asyncio.Event) -> None:
        await event.wait()

    event = asyncio.Event()
    task = asyncio.get_running_loop().create_task(waits_forever(event), name="the-hung-one")
    await asyncio.sleep(0)  # let the task start and block on the event (a scheduling step, not a timing wait)
    out = io.StringIO()
    dumper = threading.Thread(target=dump, args=("tests/x.py::test_y", 900.0, out), name="watchdog-test")
    dumper.start()
    dumper.join()
    event.set()
    await task
    text = out.getvalue()
    assert "tests/x.py::test_y still running after 900 s" in text
    assert "--- thread MainThread ---" in text
    assert "* the-hung-one" in text and "in waits_forever" in text and "await event.wait()" in text
    # A CI log is read from its tail: the test's own task, then the main thread, then the headline come last.
    assert "pending asyncio tasks of the loop in thread MainThread" in text
    assert text.index("--- thread watchdog-test ---") < text.index("* the-hung-one")
    assert text.index("* the-hung-one") < text.index("--- thread MainThread ---")
    assert text.rstrip().endswith("tests/x.py::test_y still running after 900 s (end of dump) ===")


HANGS_THROUGH_THE_INTERRUPT = """
import signal, sys, threading
from tests.support.watchdog import Watchdog

interrupted = threading.Event()
signal.signal(signal.SIGINT, lambda *_: interrupted.set())  # a run whose own teardown then hangs
with Watchdog("tests/x.py::test_hangs", 0.2, lambda text: print(text, flush=True), grace=0.3):
    threading.Event().wait()  # never set
"""


def test_a_run_that_does_not_end_after_the_interrupt_is_ended() -> None:
    done = subprocess.run(
        [sys.executable, "-c", HANGS_THROUGH_THE_INTERRUPT],
        capture_output=True, text=True, timeout=60, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert done.returncode == EXIT_CODE, done.stderr
    out = done.stdout
    assert "tests/x.py::test_hangs still running after 0 s" in out  # the first dump, then the interrupt
    assert "the interrupted run did not end within 0 s; exiting" in out
    assert out.count("--- thread MainThread ---") == 2  # and the stacks once more before the exit


HANGS_IN_A_FIXTURE = """
import time
import pytest

@pytest.fixture
def stuck():
    time.sleep(600)  # a fixture that never returns (interrupted by the watchdog's SIGINT)

def test_x(stuck):
    pass
"""


def test_a_fixture_that_hangs_is_caught_in_setup_too(tmp_path: Path) -> None:
    (tmp_path / "test_hang.py").write_text(HANGS_IN_A_FIXTURE)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-c", os.devnull, "--rootdir", str(tmp_path),
         "-p", "no:cacheprovider", "-q", str(tmp_path / "test_hang.py")],
        capture_output=True, text=True, timeout=120, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "IBEX_TEST_WATCHDOG_FIXTURE_SECONDS": "1"},
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr  # pytest's exit code for an interrupted run
    assert "test_hang.py::test_x (setup) still running after 1 s" in done.stdout
    assert "in stuck" in done.stdout  # the dump shows where it hangs
