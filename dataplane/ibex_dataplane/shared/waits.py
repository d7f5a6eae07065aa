"""Waiting for an event with a time limit, without losing a cancellation.

``asyncio.wait_for(event.wait(), t)`` on Python 3.11 returns normally when its task is cancelled in the same turn
of the loop as the event is set: the cancellation is lost. A background loop stopped by cancelling its task (the
memory stage's outbox worker, the proxy's analytics recorder) then goes round again, and whoever awaits the
cancelled task waits forever (seen as a test run that hung in a stage's shutdown). :func:`woken` waits under
``asyncio.timeout`` instead, which tells its own expiry from a cancellation that comes with it.
"""

from __future__ import annotations

import asyncio


async def woken(event: asyncio.Event, seconds: float) -> bool:
    """Wait until ``event`` is set or ``seconds`` pass; True when it was set. A cancellation always propagates."""
    try:
        async with asyncio.timeout(seconds):
            await event.wait()
    except TimeoutError:
        return False
    return True
