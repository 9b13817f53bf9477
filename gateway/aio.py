"""Waiting on an ``asyncio.Event`` with a timeout, without losing a cancellation.

On Python 3.11, ``asyncio.wait_for(event.wait(), timeout_s)`` returns the event's result when the task is cancelled
in the same loop iteration as the event is set, and the cancellation is lost (CPython gh-86296, fixed in 3.12 by
building ``wait_for`` on ``asyncio.timeout``). A background loop that waits that way (``while True: wait_for(kick
.wait(), interval)``) then runs on after its owner cancelled it, and the owner's ``await task`` never returns: a
gateway whose worker left as it was told to stop (the leave sets the autoscaler's kick event) hung after SIGTERM in 2
of 8 shutdowns of a README trial. :func:`wait_event` waits with ``asyncio.timeout``, which delivers the cancellation.
"""

from __future__ import annotations

import asyncio


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait until ``event`` is set or ``timeout_s`` seconds pass; return whether it is set.

    Raises:
        asyncio.CancelledError: the waiting task was cancelled, even in the iteration the event was set in.
    """
    if event.is_set():
        return True
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        pass
    return event.is_set()
