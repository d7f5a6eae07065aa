"""A background loop that waits for its wake-up event with a time limit stops when its task is cancelled, even
when the cancellation comes in the same turn of the loop as the wake-up (``asyncio.wait_for`` on Python 3.11 lost
it, and a stage's shutdown, awaiting the cancelled task, hung)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from ibex_dataplane.proxy.analytics import AnalyticsRecorder
from ibex_dataplane.shared.waits import woken
from ibex_dataplane.store.clickhouse import ClickHouse


async def test_woken_says_whether_the_event_came() -> None:
    event = asyncio.Event()
    assert await woken(event, 0.01) is False
    event.set()
    assert await woken(event, 60) is True


async def test_a_cancellation_that_comes_with_the_event_is_not_lost() -> None:
    event = asyncio.Event()
    waiter = asyncio.create_task(woken(event, 60))
    await asyncio.sleep(0)  # one turn: the waiter is now waiting for the event
    event.set()
    waiter.cancel()  # in the same turn as the event
    with pytest.raises(asyncio.CancelledError):
        await waiter


async def test_the_analytics_recorder_stops_when_a_wake_up_and_its_stop_come_together(tmp_path: Path) -> None:
    recorder = AnalyticsRecorder(ClickHouse(f"chdb://{tmp_path / 'never-opened'}"), CollectorRegistry(),
                                 flush_interval=60)  # fmt: skip
    await recorder.start()
    task = recorder._task
    assert task is not None
    await asyncio.sleep(0)  # one turn: the recorder is waiting for its next flush
    recorder._wake.set()  # a full batch wakes it...
    task.cancel()  # ...as the application stops it
    done, _ = await asyncio.wait({task}, timeout=10)  # the bound only turns a lost stop into a failure
    assert done == {task} and task.cancelled()
