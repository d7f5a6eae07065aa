"""The test suite's hang watchdog dumps what a hung test is waiting on (tests/support/watchdog.py)."""

from __future__ import annotations

import asyncio
import io
import threading

from tests.support.watchdog import dump


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
