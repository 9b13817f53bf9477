"""``gateway.aio.wait_event``: a timed wait on an event that never loses a cancellation (CPython gh-86296 on 3.11),
and the background loops built on it stop when told to even as their event is set."""

from __future__ import annotations

import asyncio

from gateway.aio import wait_event
from tests.gateway.test_fleet import sim_pool_fleet


async def test_wait_event_returns_whether_the_event_was_set():
    event = asyncio.Event()
    assert await wait_event(event, 0.01) is False
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await wait_event(event, 5.0) is True
    assert await wait_event(event, 0.0) is True  # already set: no wait


async def _loop(event: asyncio.Event) -> None:
    while True:
        await wait_event(event, 10.0)
        event.clear()


async def test_a_loop_cancelled_as_its_event_is_set_stops():
    """``asyncio.wait_for(event.wait(), 10)`` in this loop runs on forever on Python 3.11 (checked by hand)."""
    event = asyncio.Event()
    task = asyncio.create_task(_loop(event))
    await asyncio.sleep(0.01)
    event.set()
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=2.0)
    assert done == {task} and task.cancelled()


async def test_the_autoscale_loop_stops_when_a_kick_comes_with_the_stop():
    fleet = sim_pool_fleet([1000.0])
    fleet.scaling.start()
    await asyncio.sleep(0.3)  # past its first tick: waiting for the next kick
    fleet.scaling.kick()  # e.g. a worker leaving as the gateway stops
    stopping = asyncio.ensure_future(fleet.scaling.stop())
    done, _ = await asyncio.wait([stopping], timeout=2.0)
    assert done == {stopping}
